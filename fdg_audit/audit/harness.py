"""The attack harness: plan which attack reads which run, build views, run workers, score, write the results.

``run_attacks(root, attack_cfgs)`` attacks every finished run of a run folder (``attack_cfgs``: the scenario's
``AttackEntry``s as parsed, or their flat form ``{"name": ..., "label": ..., **params}``). It reads the runs from
the folder's records (``RunInfo`` in summary.json, fdg_audit.store.runfolder) and never re-plans the scenario. Each attack is first
described by a metadata probe in a throw-away worker (``describe``), so plugin code never runs in the harness;
then its controls and every run it applies to run in worker processes on materialised views (fdg_audit.audit.sandbox),
``parallel`` at a time, each within the folder's ``attack_timeout`` and ``attack_memory_gb``. What a worker returns
is data from plugin code: every field is checked (``checked_outputs``) before it is scored, and what a job keeps for
later jobs of its attack (``AdversaryView.keep``) is checked and stored in RUN/attack_cache/ (``store_kept``). Outputs are joined with the truth by fdg_audit.audit.scoring and written through the run folder
module: leakage.csv, controls.json, attacks.json, items/, mia/, recon/. An attack applies to a run when its
adversary observed a kind it ``consumes`` (``applicable``; ``selection`` lists them per run), which is how
``attacks = "all"`` picks attacks. Membership scores of several victims are also scored pooled (victim "pooled").
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import tomllib
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ..attack import AdversaryView, Control, Scores, Skipped, view_envelopes
from ..data import load_data
from ..errors import UserError
from ..params import resolve_device
from ..plugins import resolve
from ..progress import Eta
from ..store.ledger import Ledger, open_verified
from ..store.runfolder import RunFolder, RunInfo
from ..store.safe import read_in
from . import sandbox
from .bwrap import PROTECT
from .checks import OUTPUTS, Described, _checked, _make, checked_outputs
from .journal import Journal
from .sandbox import run_isolated, stop_workers
from .scoring import Truth, build_aux, score
from .transport import CACHE_KEY, AttackFailed, store_kept
from .worker import LIMITS, build, check_limits, portrait


# ------------------------------------------------------------------------------------------- which runs

def load_runs(root) -> tuple[dict[str, RunInfo], dict[str, Any]]:
    """The folder's finished runs and their data ({run: DomainSet}, each data set built once), from the runs'
    records: the scenario is not planned again."""
    folder = RunFolder(root)
    runs, data, built = folder.runs(), {}, {}
    for run_id, info in runs.items():
        resolve("method", info.plugin)   # a folder naming a method that is not installed is refused (no import)
        cfg = folder.data_config(info)
        key = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
        if key not in built:
            built[key] = load_data(cfg)
        data[run_id] = built[key]
    return runs, data


def observer(atk, run: RunInfo) -> str:
    """The party whose view the attack reads: server, eavesdropper, or the curious client (default the first)."""
    return {"server": "server", "eavesdropper": "eavesdropper"}.get(atk.adversary) or \
        atk.p.as_client or run.clients[0]


def applicable(atk, kinds) -> bool:
    """Whether an attack applies to a run: its adversary observed an artifact kind the attack consumes."""
    return bool(set(kinds) - set(getattr(atk, "ignores", ())) if "*" in atk.consumes else set(atk.consumes) & set(kinds))


def wanted(atk, run: RunInfo) -> bool:
    """The attack's ``targets``, ``seeds`` and ``datasets`` filters (empty: every run)."""
    return (not atk.p.targets or run.target in atk.p.targets) and \
        (not atk.p.seeds or int(run.seed) in [int(s) for s in atk.p.seeds]) and \
        (not atk.p.datasets or run.dataset in atk.p.datasets)


def _selection(ledger, runs: dict, attacks: list, absent_client: bool = False) -> dict[str, list[str]]:
    """``absent_client``: also list a curious-client attack whose client is not in the run (it gets a note row)."""
    out = {}
    for run_id, run in runs.items():
        out[run_id] = []
        for label, atk, *_ in attacks:
            me = observer(atk, run)
            if atk.adversary == "client" and me not in run.clients:
                if absent_client and wanted(atk, run):
                    out[run_id].append(label)
                continue
            if wanted(atk, run) and \
                    applicable(atk, {e.kind for e in view_envelopes(ledger, run_id, atk.adversary, me)
                                     if ledger.stored(e)}):
                out[run_id].append(label)
    return out


def selection(root, attack_cfgs: list) -> dict[str, list[str]]:
    """{run: labels of the attacks that apply to it}, as ``run_attacks`` decides, without running them."""
    root = Path(root)
    return _selection(Ledger.open(root), RunFolder(root).runs(), [_make(c, "cpu") for c in attack_cfgs])


def salted(atk, job: dict, run_seed: int) -> tuple:
    """The attack and its worker job for one run: the job carries the run's seed (``salt``) beside its params, and
    the attack is built from the job (``worker.build``: its ``Params``' ``seed`` salted by it) in the worker, or
    here for an attack built in this process, so that runs of different seeds draw independent attack randomness
    (restarts, batches, probes) and the intervals over seeds include it. Controls keep the unsalted seed."""
    job = dict(job, salt=int(run_seed))
    return (atk if isinstance(atk, Described) else build(job, type(atk))), job


# ------------------------------------------------------------------------------------------- running

def _controls(atk, job: dict, isolate: bool) -> tuple[list, float]:
    """The attack's controls and their CPU seconds (NaN: not reported)."""
    if not isolate:
        t = time.process_time()
        return atk.control(), time.process_time() - t
    try:
        res = run_isolated(dict(job, mode="control"), OUTPUTS)
        return res["controls"], res.get("cpu", math.nan)
    except AttackFailed as e:
        print(f"attack {job['label']}: control() failed: {one_line(str(e), e.detail)}", file=sys.stderr)
        return [Control(f"control() failed: {e}", "", float("nan"), float("nan"))], math.nan


def _execute(atk, job: dict, ledger, envs: list, run: RunInfo, me: str, aux, device, isolate: bool,
             cache: Path) -> tuple[list, float]:
    """Run one attack on one run: in a worker process that sees only the materialised view (default), or in
    this process (``isolate=False``, debugging only: nothing is enforced there). ``cache``: the attack's folder of
    kept arrays (``AdversaryView.keep``/``cached``): read-only in the job, what it keeps is checked and added.
    Returns its outputs and its CPU seconds (the worker's own count; NaN when it reports none)."""
    if not isolate:
        t = time.process_time()
        view = AdversaryView(ledger, run.protocol(), atk.adversary, me, device)
        view.cache_dir = str(cache) if cache.is_dir() else ""
        outs = checked_outputs(atk.run(view, aux), run, me)
        kept, cpu = view.__dict__.get("_kept", {}), time.process_time() - t
    else:
        job = dict(job, mode="run", run=run.protocol(), adversary=atk.adversary, me=me)
        res = run_isolated(job, OUTPUTS, ledger, envs, aux, cache)
        outs, kept = checked_outputs(res.get("outputs"), run, me), res.get("keep") or {}
        cpu = res.get("cpu")
        cpu = float(cpu) if isinstance(cpu, (int, float)) and not isinstance(cpu, bool) and 0 <= cpu < 1e9 else math.nan
    store_kept(cache, kept)
    return outs, cpu


def one_line(msg: str, detail: str = "") -> str:
    """A failure as one line: the message (at most 500 characters) and, from a worker's traceback, where it was
    raised (the innermost frame)."""
    msg = " ".join(str(msg).split())[:500]
    frames = [x.strip() for x in str(detail).splitlines() if x.strip().startswith("File \"")]
    return msg + (f" ({frames[-1][:300]})" if frames else "")


class _Later:
    """A call made when its ``result()`` is asked for, as a future's (the serial path of ``attack_runs``: the
    control first, then each run in plan order)."""

    def __init__(self, f, *a):
        self.call = lambda: f(*a)

    def result(self):
        return self.call()


def attack_limits(root: Path) -> dict:
    """The run folder's ``attack_timeout`` and ``attack_memory_gb`` (config.resolved.toml; else the defaults,
    LIMITS) as a job's ``timeout`` and ``memory_gb``."""
    cfg, raw = Path(root) / "config.resolved.toml", {}
    data = read_in(root, cfg)
    if data is not None:
        try:
            raw = tomllib.loads(data.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError):
            raise UserError(f"{cfg} is not valid TOML: the run folder is damaged") from None
    t, m = check_limits(raw.get("attack_timeout", LIMITS["timeout"]),
                        raw.get("attack_memory_gb", LIMITS["memory_gb"]), str(cfg))
    return dict(timeout=t, memory_gb=m)


def run_attacks(root, attack_cfgs: list, quiet: bool = False, isolate: bool = True, parallel: int = 1,
                threads: int = 0, resume: bool = False, estimates: dict | None = None) -> Path:
    """Run attacks on every finished run of a run folder; write leakage.csv, controls, attacks.json and grids.

    ``isolate``: each attack runs in a worker process on a materialised view (fdg_audit.audit.sandbox); False runs
    it in this process, for debugging, with no boundary enforced. ``parallel``: worker processes at once (an
    attack's control and its runs), each on ``threads`` torch threads (0: this process's count split among them);
    rows, items and grids come out in plan order whatever finishes first. Each finished job is kept at once in
    RUN/attack_jobs/ (``journal``); ``resume`` takes the kept jobs of the same attack settings instead of running them
    again (an interrupted attack phase goes on where it stopped), else an attack's kept jobs are dropped first.
    ``estimates``: the cost guard's CPU s per attack label (None: not estimated), for the progress line's time left."""
    folder = RunFolder(root)
    ledger = open_verified(folder.root, folder.summary())
    if (folder.root / "leakage.csv").exists():   # earlier attacks' rows are kept: a damaged file stops us now
        folder.leakage()
    limits = attack_limits(folder.root)
    PROTECT.add(str(folder.root.resolve()))
    sandbox.allow_workers()
    runs, data = load_runs(folder.root)
    device = torch.device(resolve_device("auto"))
    parallel = max(1, parallel) if isolate else 1
    threads = threads or (max(1, torch.get_num_threads() // parallel) if parallel > 1 else 0)
    rows, controls, cache, pool = [], [], {}, None
    try:   # from the first describe job on
        attacks = [_make(c, device, isolate, limits) for c in attack_cfgs]
        chosen = _selection(ledger, runs, attacks, True)
        used = {label for labels in chosen.values() for label in labels}
        attacks = [a for a in attacks if a[0] in used]   # no controls for attacks without a run
        if isolate and sandbox.sandbox_mode() == "process":   # the forkserver starts now, well before the first job
            sandbox.worker_context()
        pool = ThreadPoolExecutor(parallel) if parallel > 1 else None   # threads that wait on worker processes
        env = SimpleNamespace(folder=folder, ledger=ledger, runs=runs, data=data, cache=cache, device=device,
                              isolate=isolate, pool=pool, quiet=quiet, resume=resume,
                              eta=Eta("attack jobs", sum(len(v) for v in chosen.values()),
                                      _weights(chosen, attacks, estimates)))
        for label, atk, job in attacks:
            rows += attack_runs(env, label, atk, dict(job, threads=threads) if threads else job, controls)
    except BaseException:   # an error or Ctrl-C: no job starts any more, the attack processes running stop at once
        stop_workers()
        if pool is not None:   # its threads end at once (their workers are gone); then workers may start again
            pool.shutdown(wait=True, cancel_futures=True)
        sandbox.allow_workers()
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        sandbox.close_warm()
    described = {label: (atk if isolate else _checked(portrait(atk), label)).record(job["attack"])
                 for label, atk, job in attacks}
    folder.write_results(rows, controls, described)
    if not quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    return folder / "leakage.csv"


def cache_dir(root: Path, atk, label: str) -> Path:
    """RUN/attack_cache/<name>/: the arrays jobs of one attack class (or of the attacks that name one ``cache``) keep
    for later ones (attacker side: the jobs' own results, never truth). The label names it when the name is not a
    safe file name."""
    name = getattr(atk, "cache", "") or atk.name
    name = name if isinstance(name, str) and CACHE_KEY.fullmatch(name) and ".." not in name else label
    return Path(root) / "attack_cache" / name


def _weights(chosen: dict, attacks: list, estimates: dict | None) -> list:
    """Each attack job's estimated CPU s, in the order the jobs finish: its attack's estimate shared by its jobs."""
    n = {label: sum(label in v for v in chosen.values()) for label, *_ in attacks}
    est = estimates or {}
    return [est[label] / n[label] if est.get(label) is not None else None for label, *_ in attacks
            for _ in range(n[label])]


def attack_runs(env, label: str, atk, job: dict, controls: list) -> list[dict]:
    """One attack: its controls and every run it applies to (in ``env.pool``'s threads when given); appends to
    ``controls`` and returns the attack's rows (per-item values and grids are saved on the way). Its line says its
    CPU seconds: its workers' (as they report them) and this process's (views, scoring) while it ran."""
    t0, c0 = time.perf_counter(), time.process_time()
    jobs, rows = [], []
    for run_id, run in env.runs.items():
        if not wanted(atk, run):
            continue
        me = observer(atk, run)
        if atk.adversary == "client" and me not in run.clients:
            jobs.append((run, me, None, None))   # a note row: this client is not in the run
            continue
        envs = view_envelopes(env.ledger, run_id, atk.adversary, me)
        if not applicable(atk, {e.kind for e in envs if env.ledger.stored(e)}):
            continue
        key = (run_id, tuple(sorted(atk.aux)))   # built once per run (and aux need), shared by the attacks
        if key not in env.cache:
            env.cache[key] = build_aux(env.data[run_id], run.target, atk.aux, run.seed)
        jobs.append((run, me, envs, env.cache[key]))
    submit = (lambda f, *a: env.pool.submit(f, *a)) if env.pool is not None else _Later
    book = Journal(env.folder.root, label, job, env.resume)
    done = {run.run: k for run, *_ in jobs if env.resume and (k := book.job(run.run))}
    kept = book.controls() if env.resume else None
    ctl = _Later(lambda: (kept, 0.0)) if kept is not None else submit(_controls, atk, job, env.isolate)
    cache = cache_dir(env.folder.root, atk, label)
    futs = [submit(_execute, *salted(atk, job, run.seed), env.ledger, envs, run, me, am[0], env.device, env.isolate,
                   cache) if envs is not None and run.run not in done else None for run, me, envs, am in jobs]
    ok = True   # a failed positive control (attack too weak) or negative control (sees leakage where there is
    got, cpu = ctl.result()   # none) makes every number of this attack "not measurable"
    for c in got:
        ok &= c.passed
        controls.append(dict(attack=label, **dataclasses.asdict(c), passed=c.passed))
    book.keep_controls(got)
    status = "ok" if ok else "not measurable (control failed)"
    for (run, me, envs, am), fut in zip(jobs, futs):
        got, t = done[run.run] if run.run in done else _collect(env, label, run, me, fut, am, status, book)
        rows, cpu = rows + got, cpu + t
    attacked = sum(f is not None for f in futs) + len(done)
    eta = [env.eta.tick() for _ in jobs][-1:]   # every job of this attack is done now
    if not env.quiet and not sys.stderr.isatty() and attacked:   # batch jobs: one line per attack
        print(f"attack {label}: {attacked} runs" + (f" ({len(done)} kept from before)" if done else "")
              + f", {time.perf_counter() - t0:.0f} s, {cpu + time.process_time() - c0:.0f} CPU s"
              + ("" if ok else " (a control failed: not measurable)") + "".join(f"; {e}" for e in eta),
              file=sys.stderr, flush=True)
    return rows


def _collect(env, label: str, run: RunInfo, me: str, fut, am: tuple, status: str, book: Journal) -> tuple:
    """One run's job of an attack, once finished: (its rows, its CPU seconds); a job that scored is kept in the
    journal at once, a failed one is a "failed" row (not kept: it runs again on resume)."""
    row = lambda o, victim, r: dict(  # noqa: E731
        {k: getattr(run, k) for k in ("dataset", "method", "variant", "target", "seed")}, run=run.run,
        attack=label, adversary=me, artifact=getattr(o, "artifact", ""), round=getattr(o, "round", ""),
        victim=victim, output=getattr(o, "variant", ""), status=status, **r)
    note = lambda metric, why, o=None, victim="": row(  # noqa: E731  (a row without a number)
        o, victim, dict(metric=metric, value=float("nan"), baseline=float("nan"))) | {"status": why}
    if fut is None:
        return [note("skipped", f"skipped: {me} is not a client of this run")], 0.0
    if not env.quiet and sys.stderr.isatty():
        sys.stderr.write(f"\rattack {label} on {run.run} ...")
    try:
        outs, t = fut.result()
    except UserError:
        raise
    except Exception as e:  # keep the other attacks' and runs' numbers; record the failure
        detail = e.detail if isinstance(e, AttackFailed) else traceback.format_exc()
        why = str(e) if isinstance(e, AttackFailed) else f"{type(e).__name__}: {e}"
        print(f"attack {label} failed on {run.run}: {one_line(why, detail)}", file=sys.stderr)
        return [note("failed", f"failed: {one_line(why)}")], 0.0
    rows = _score_run(env, label, run, outs, am, row, note)
    book.keep_job(run.run, rows, t)
    return rows, t

def _score_run(env, label: str, run: RunInfo, outs: list, am: tuple, row, note) -> list[dict]:
    """Score one run's outputs of one attack and save its items, membership scores and grids."""
    aux, members = am
    truth = env.cache.get(run.run) or env.cache.setdefault(run.run, Truth(env.folder.root, run.run,
                                                                           env.data[run.run]))
    rows, good = [], []
    for o in outs:
        if isinstance(o, Skipped):
            rows.append(note("skipped", f"skipped: {o.reason}", o, o.victim))
            continue
        try:
            scored, images = score(o, truth, members, aux)
        except FileNotFoundError as e:   # e.g. a DP audit of a run without canaries
            rows.append(note("skipped", f"skipped: {e}", o, o.victim))
            continue
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (an output that does not fit its truth: shapes, rows, classes)
            print(f"attack {label} failed on {run.run}: {type(o).__name__} cannot be scored ({type(e).__name__}: "
                  f"{str(e)[:200]})", file=sys.stderr)
            rows.append(note("failed", f"failed: {type(o).__name__} cannot be scored ({type(e).__name__})", o,
                             o.victim))
            continue
        good.append(o)
        rows += [row(o, o.victim, r) for r in scored]
        if images is not None:
            env.folder.save_grid(label, run.run, o.victim, o.variant, images)
    for o in _pooled(good):   # membership scores pooled over victims (resolves lower FPRs)
        rows += [row(o, "pooled", r) for r in score(o, truth, members, aux)[0]]
    env.folder.save_scores(label, run.run, [o for o in good if isinstance(o, Scores) and not o.victims], members)
    env.folder.save_items(label, run.run, rows)
    return rows


def _pooled(outs: list) -> list:
    """One Scores per (artifact, round, variant) concatenating every victim's, when there are several victims."""
    groups: dict = {}
    for o in outs:
        if isinstance(o, Scores):
            groups.setdefault((o.artifact, o.round, o.variant), []).append(o)
    return [Scores("pooled", a, r, np.concatenate([np.asarray(o.scores) for o in g]), v,
                   victims=[o.victim for o in g]) for (a, r, v), g in groups.items() if len(g) > 1]
