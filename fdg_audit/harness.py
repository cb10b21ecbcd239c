"""The attack harness: plan which attack reads which run, build views, run workers, score, write the results.

``run_attacks(root, attack_cfgs)`` attacks every finished run of a run folder. It reads the runs from the folder's
records (``RunInfo`` in summary.json, fdg_audit.runfolder) and never re-plans the scenario. Each attack is first
described by a metadata probe in a throw-away worker (``describe``), so plugin code never runs in the harness;
then its controls and every run it applies to run in worker processes on materialised views (fdg_audit.sandbox),
``parallel`` at a time, each within the folder's ``attack_timeout`` and ``attack_memory_gb``. What a worker returns
is data from plugin code: every field is checked (``checked_outputs``) before it is scored, and what a job keeps for
later jobs of its attack (``AdversaryView.keep``) is checked and stored in RUN/attack_cache/ (``store_kept``). Outputs are joined with the truth by fdg_audit.scoring and written through the run folder
module: leakage.csv, controls.json, attacks.json, items/, mia/, recon/. An attack applies to a run when its
adversary observed a kind it ``consumes`` (``applicable``; ``selection`` lists them per run), which is how
``attacks = "all"`` picks attacks. Membership scores of several victims are also scored pooled (victim "pooled").
"""
from __future__ import annotations

import copy
import dataclasses
import json
import numbers
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from . import seeding
from .api.attack import (ADVERSARIES, AUX, CAPABILITIES, PRIORS, AdversaryView, Audit, Control, Estimate,
                         Predictions, Reconstruction, Scores, Skipped, view_envelopes)
from .errors import UserError
from .ledger import Ledger, open_verified
from .params import resolve_device, safe_name, typed
from .plugins import available, from_folder, import_path, load_attack, resolve
from .progress import Eta
from .runfolder import RunFolder, RunInfo
from . import sandbox
from .sandbox import AttackFailed, portrait, run_isolated, stop_workers, store_kept
from .scoring import Truth, build_aux, score

OUTPUTS = {c.__name__: c for c in (Reconstruction, Scores, Predictions, Estimate, Audit, Skipped, Control)}


# ------------------------------------------------------------------------------------------- attacks as described

@dataclass
class Described:
    """An attack as the harness knows it: what a metadata probe read off the plugin in a throw-away worker
    (``describe``), so that plugin code (its import, ``__init__``) never runs in the harness. ``p``: its
    parameters after ``__init__``, as plain values."""
    name: str
    consumes: tuple
    adversary: str
    aux: tuple
    outputs: dict
    p: Any
    threat: dict = dataclasses.field(default_factory=dict)   # Attack.threat(): priors, budget, knows, rows

    def record(self, entry: str) -> dict:
        """The attack's line in attacks.json."""
        return dict(name=entry, adversary=self.adversary, aux=list(self.aux), consumes=list(self.consumes),
                    outputs=dict(self.outputs), **self.threat)


_DESCRIBED: dict = {}   # probe results of this process, by (attack config, device, import path)


MAX_NAME = 200   # characters of an attack name ("module:Class") or label


def check_name(name, label) -> None:
    """An attack's name and label are short strings (one line before any worker starts)."""
    for what, v in (("name", name), ("label", label)):
        if v is not None and not (isinstance(v, str) and 0 < len(v) <= MAX_NAME and v.isprintable()):
            shown = repr(v)[:60] + ("..." if len(repr(v)) > 60 else "")
            raise UserError(f"attack {what} {shown} is not a printable string of 1 to {MAX_NAME} characters: "
                            "use a registered name or \"module:Class\"")


def describe(cfg: dict, device, limits: dict = {}) -> tuple[str, Described, dict]:  # noqa: B006
    """(label, attack, job spec for the worker) of one [[attacks]] entry, validated. The attack is a ``Described``
    read by a probe worker (one per entry and process); the name is checked against a run folder's guard
    (``plugins.resolve``) first."""
    cfg = dict(cfg)
    name, label = cfg.pop("name"), cfg.pop("label", None) or None
    check_name(name, label)
    resolve("attack", name)
    key = (json.dumps(cfg, sort_keys=True, default=str), name, str(device), tuple(import_path(name)))
    if key not in _DESCRIBED:
        job = dict(attack=name, label=label, params=cfg, device=str(device), mode="describe", **limits)
        try:
            _DESCRIBED[key] = _checked(run_isolated(job, OUTPUTS)["describe"], label or name)
        except AttackFailed as e:
            raise UserError(f"attack {label or name!r} could not be loaded in its worker ({e}); "
                            f"FDG_AUDIT_SANDBOX=process tells a sandbox problem from a broken plugin") from None
    d = _DESCRIBED[key]
    label = label or d.name or name
    safe_name(label, f"attacks.{label}.label")
    return label, d, dict(attack=name, label=label, params=cfg, device=str(device), **limits)


def _checked(d, label: str) -> Described:
    """A probe's answer, checked as data from plugin code: the harness decides with it which runs and views the
    worker gets."""
    strs = lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)  # noqa: E731
    if not (isinstance(d, dict) and isinstance(d.get("name"), str) and strs(d.get("consumes"))
            and strs(d.get("aux")) and isinstance(d.get("params"), dict) and isinstance(d.get("outputs"), dict)):
        raise UserError(f"attack {label}: its class does not describe itself (name, consumes, aux, outputs, Params): "
                        "see attacks/README.md")
    if d.get("adversary") not in ADVERSARIES:
        raise UserError(f"attack {label}: adversary {d.get('adversary')!r} is not one of {ADVERSARIES}")
    if set(d["aux"]) - set(AUX):
        raise UserError(f"attack {label}: aux {sorted(set(d['aux']) - set(AUX))} unknown; use a subset of {AUX}")
    p = SimpleNamespace(**_shared_params(d["params"], label))
    if not all(isinstance(x, str) and 0 < len(x) <= MAX_NAME for x in (d["name"] or "x", *d["consumes"])):
        raise UserError(f"attack {label}: its name and consumes must be strings of 1 to {MAX_NAME} characters")
    return Described(d["name"], tuple(d["consumes"]), d["adversary"], tuple(d["aux"]),
                     {str(k): str(v) for k, v in d["outputs"].items()}, p, _threat(d.get("threat") or {}, label))


def _shared_params(p: dict, label: str) -> dict:
    """The ``AttackParams`` fields (fdg_audit.api.attack) of a described attack, checked: the harness filters runs,
    picks the curious client, caps victims and salts the seed with them, whatever ``__post_init__`` made of them."""
    p = dict(p)
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    strs = lambda v: isinstance(v, list) and all(isinstance(x, str) and len(x) <= MAX_NAME for x in v)  # noqa: E731
    checks = dict(as_client=(lambda v: isinstance(v, str) and len(v) <= MAX_NAME, "a client name (\"\" = the first)"),
                  max_victims=(lambda v: is_int(v) and v >= 0, "0 (every victim) or a positive integer"),
                  targets=(strs, "a list of domain names ([] = every run)"),
                  seeds=(lambda v: isinstance(v, list) and all(is_int(x) for x in v), "a list of integer seeds"),
                  datasets=(strs, "a list of [[datasets]] labels ([] = every run)"),
                  seed=(lambda v: is_int(v) and 0 <= v < 2 ** 63, "an integer >= 0"))
    defaults = dict(as_client="", max_victims=0, targets=[], seeds=[], datasets=[], seed=0)
    for k, (ok, want) in checks.items():
        p.setdefault(k, defaults[k])
        if not ok(p[k]):
            raise UserError(f"attacks.{label}.{k} = {repr(p[k])[:80]}: use {want}")
    return p


def _threat(t, label: str) -> dict:
    """An attack's threat-model declarations (``Attack.threat``), checked against the core's vocabulary."""
    strmap = lambda v: isinstance(v, dict) and all(isinstance(x, str) for kv in v.items() for x in kv)  # noqa: E731
    budget = t.get("budget", {}) if isinstance(t, dict) else None
    if not (isinstance(t, dict) and strmap(t.get("priors", {})) and strmap(t.get("rows", {}))
            and isinstance(budget, dict) and all(isinstance(v, list) and len(v) == 2 and all(
                isinstance(n, int) and n >= 0 for n in v) for v in budget.values())
            and isinstance(t.get("knows", []), list)):
        raise UserError(f"attack {label}: priors, budget, knows and rows do not describe a threat model (see "
                        "fdg_audit/api/attack.py)")
    bad = sorted(set(t.get("priors", {}).values()) - set(PRIORS)) + sorted(set(t.get("knows", [])) - set(CAPABILITIES))
    if bad:
        raise UserError(f"attack {label}: {bad} not in the priors {PRIORS} or capabilities {sorted(CAPABILITIES)}")
    return dict(priors=dict(t.get("priors", {})), budget=dict(budget), knows=list(t.get("knows", [])),
                rows=dict(t.get("rows", {})))


def make_attack(cfg: dict, device):
    """(label, attack instance, job spec) built in this process, for ``isolate = False`` (debugging only: plugin
    code then runs in the harness)."""
    cfg = dict(cfg)
    name, label = cfg.pop("name"), cfg.pop("label", None) or None
    cls = load_attack(name)
    label = label or cls.name or name
    safe_name(label, f"attacks.{label}.label")
    atk = cls(typed(cls.Params, cfg, f"attacks.{label}"), device)
    _checked(portrait(atk), label)
    return label, atk, dict(attack=name, label=label, params=cfg, device=str(device))


def _make(cfg: dict, device, isolate: bool = True, limits: dict = {}):  # noqa: B006
    return describe(cfg, device, limits) if isolate else make_attack(cfg, device)


def check_attacks(attack_cfgs: list[dict], limits: dict = {}) -> None:  # noqa: B006
    """Every attack loads and its parameters are valid (before any training), each probed in a worker (within
    ``limits``: timeout, memory_gb; default sandbox.LIMITS)."""
    for c in attack_cfgs:
        describe(c, "cpu", limits)


# ------------------------------------------------------------------------------------------- which runs

def load_runs(root) -> tuple[dict[str, RunInfo], dict[str, Any]]:
    """The folder's finished runs and their data ({run: DomainSet}, each data set built once), from the runs'
    records: the scenario is not planned again."""
    from .data import load_data
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
    return bool(set(atk.consumes) & set(kinds))


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


def selection(root, attack_cfgs: list[dict]) -> dict[str, list[str]]:
    """{run: labels of the attacks that apply to it}, as ``run_attacks`` decides, without running them."""
    root = Path(root)
    return _selection(Ledger.open(root), RunFolder(root).runs(), [_make(c, "cpu") for c in attack_cfgs])


def salted(atk, job: dict, run_seed: int) -> tuple:
    """The attack (and its worker job) with its ``seed`` parameter salted by the run's seed, so that runs of
    different seeds draw independent attack randomness (restarts, batches, probes) and the intervals over seeds
    include it. Controls keep the unsalted seed."""
    seed = seeding.seed32(atk.p.seed, int(run_seed))
    a = copy.copy(atk)
    a.p = copy.copy(atk.p)
    a.p.seed = seed
    return a, dict(job, params=dict(job["params"], seed=seed))


# ------------------------------------------------------------------------------------------- running

def _controls(atk, job: dict, isolate: bool) -> list:
    if not isolate:
        return atk.control()
    try:
        return run_isolated(dict(job, mode="control"), OUTPUTS)["controls"]
    except AttackFailed as e:
        print(f"attack {job['label']}: control() failed: {one_line(str(e), e.detail)}", file=sys.stderr)
        return [Control(f"control() failed: {e}", "", float("nan"), float("nan"))]


def _execute(atk, job: dict, ledger, envs: list, run: RunInfo, me: str, aux, device, isolate: bool,
             cache: Path) -> list:
    """Run one attack on one run: in a worker process that sees only the materialised view (default), or in
    this process (``isolate=False``, debugging only: nothing is enforced there). ``cache``: the attack's folder of
    kept arrays (``AdversaryView.keep``/``cached``): read-only in the job, what it keeps is checked and added."""
    if not isolate:
        view = AdversaryView(ledger, run.protocol(), atk.adversary, me, device)
        view.cache_dir = str(cache) if cache.is_dir() else ""
        outs = checked_outputs(atk.run(view, aux), run, me)
        kept = view.__dict__.get("_kept", {})
    else:
        job = dict(job, mode="run", run=run.protocol(), adversary=atk.adversary, me=me)
        res = run_isolated(job, OUTPUTS, ledger, envs, aux, cache)
        outs, kept = checked_outputs(res.get("outputs"), run, me), res.get("keep") or {}
    store_kept(cache, kept)
    return outs


MAX_TEXT = 2000   # characters of a string field of an output (a skip reason, a variant, a truth name)


def checked_outputs(outs, run: RunInfo, me: str) -> list:
    """A job's outputs, checked as data from plugin code before anything uses them: a list of the output classes,
    every field of its declared kind (strings, integers, numbers, flags, numeric arrays), victims among the run's
    clients ("+"-joined for aggregates; a Skipped may also name the adversary itself), truth names and variants safe
    file-name parts. Array fields typed as tensors come back as tensors. Anything else is ``AttackFailed``."""
    if not isinstance(outs, list):
        raise AttackFailed("run() did not return a list of outputs")
    for o in outs:
        name = type(o).__name__
        if type(o) not in OUTPUTS.values() or isinstance(o, Control):
            raise AttackFailed(f"run() returned a {name}: return Reconstruction, Scores, Predictions, Estimate, "
                               "Audit or Skipped")
        for f in dataclasses.fields(o):
            v, kind = getattr(o, f.name), str(f.type)
            bad = lambda want: AttackFailed(  # noqa: E731
                f"{name}.{f.name} = {repr(v)[:80]}: {want}")
            if kind == "str":
                if not isinstance(v, str) or len(v) > MAX_TEXT:
                    raise bad(f"give a string of at most {MAX_TEXT} characters")
            elif kind == "int":
                if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)) or abs(v) > 10 ** 9:
                    raise bad("give an integer")
                setattr(o, f.name, int(v))
            elif kind == "float":
                if not isinstance(v, numbers.Real) or isinstance(v, (bool, np.bool_)):
                    raise bad("give a number")
                setattr(o, f.name, float(v))
            elif kind == "bool":
                if not isinstance(v, (bool, np.bool_)):
                    raise bad("give True or False")
                setattr(o, f.name, bool(v))
            elif f.name == "victims":
                if v is not None:
                    raise bad("leave it None (the harness pools victims)")
            elif v is not None or f.default is dataclasses.MISSING:
                try:
                    t = v.detach().cpu() if isinstance(v, torch.Tensor) else None
                    a = np.asarray(v if t is None else (t.float() if t.dtype == torch.bfloat16 else t).numpy())
                except (ValueError, TypeError, RuntimeError):
                    a = np.asarray(object())
                if a.dtype.kind not in "biuf":
                    raise bad("give a numeric array")
                setattr(o, f.name, torch.from_numpy(np.ascontiguousarray(a)) if "Tensor" in kind else a)
        parts = o.victim.split("+")
        if not (all(x in run.clients for x in parts) or isinstance(o, Skipped) and o.victim in (me, "")):
            raise AttackFailed(f"{name}.victim = {o.victim[:80]!r} is not a client of run {run.run} "
                               f"({', '.join(run.clients[:8])}{', ...' if len(run.clients) > 8 else ''})")
        for k, extra in (("truth", ""), ("variant", "/@+=:")):   # a variant may say "radial/public" (files: "__")
            v = getattr(o, k, "")
            if v and not (len(v) <= 100 and all(c.isalnum() and c.isascii() or c in "_.-" + extra for c in v)
                          and ".." not in v and set(v) != {"."} and not v.startswith("/")):
                raise AttackFailed(f"{name}.{k} = {v[:80]!r}: use letters, digits and _ . -{' ' + ' '.join(extra) if extra else ''} "
                                   "only")
    return outs


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
    sandbox.LIMITS) as a job's ``timeout`` and ``memory_gb``."""
    import tomllib
    cfg, raw = Path(root) / "config.resolved.toml", {}
    if cfg.exists():
        try:
            raw = tomllib.loads(cfg.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError):
            raise UserError(f"{cfg} is not valid TOML: the run folder is damaged") from None
    from .scenario import check_limits
    t, m = check_limits(raw.get("attack_timeout", sandbox.LIMITS["timeout"]),
                        raw.get("attack_memory_gb", sandbox.LIMITS["memory_gb"]), str(cfg))
    return dict(timeout=t, memory_gb=m)


def run_attacks(root, attack_cfgs: list[dict], quiet: bool = False, isolate: bool = True, parallel: int = 1,
                threads: int = 0) -> Path:
    """Run attacks on every finished run of a run folder; write leakage.csv, controls, attacks.json and grids.

    ``isolate``: each attack runs in a worker process on a materialised view (fdg_audit.sandbox); False runs
    it in this process, for debugging, with no boundary enforced. ``parallel``: worker processes at once (an
    attack's control and its runs), each on ``threads`` torch threads (0: this process's count split among them);
    rows, items and grids come out in plan order whatever finishes first."""
    folder = RunFolder(root)
    ledger = open_verified(folder.root, folder.summary())
    if (folder.root / "leakage.csv").exists():   # earlier attacks' rows are kept: a damaged file stops us now
        folder.leakage()
    limits = attack_limits(folder.root)
    sandbox.PROTECT.add(str(folder.root.resolve()))
    sandbox.allow_workers()
    runs, data = load_runs(folder.root)
    device = torch.device(resolve_device("auto"))
    attacks = [_make(c, device, isolate, limits) for c in attack_cfgs]
    chosen = _selection(ledger, runs, attacks, True)
    used = {label for labels in chosen.values() for label in labels}
    attacks = [a for a in attacks if a[0] in used]   # no controls for attacks without a run
    parallel = max(1, parallel) if isolate else 1
    threads = threads or (max(1, torch.get_num_threads() // parallel) if parallel > 1 else 0)
    rows, controls, cache = [], [], {}
    pool = ThreadPoolExecutor(parallel) if parallel > 1 else None   # threads that wait on worker processes
    env = SimpleNamespace(folder=folder, ledger=ledger, runs=runs, data=data, cache=cache, device=device,
                          isolate=isolate, pool=pool, quiet=quiet,
                          eta=Eta("attack jobs", sum(len(v) for v in chosen.values())))
    try:
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
    """RUN/attack_cache/<attack name>/: the arrays jobs of one attack class keep for later ones (attacker side: the
    jobs' own results, never truth). The label names it when the attack's name is not a safe file name."""
    name = atk.name if isinstance(atk.name, str) and sandbox.CACHE_KEY.fullmatch(atk.name) and ".." not in atk.name \
        else label
    return Path(root) / "attack_cache" / name


def attack_runs(env, label: str, atk, job: dict, controls: list) -> list[dict]:
    """One attack: its controls and every run it applies to (in ``env.pool``'s threads when given); appends to
    ``controls`` and returns the attack's rows (per-item values and grids are saved on the way)."""
    t0 = time.perf_counter()
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
    ctl = submit(_controls, atk, job, env.isolate)
    cache = cache_dir(env.folder.root, atk, label)
    futs = [submit(_execute, *salted(atk, job, run.seed), env.ledger, envs, run, me, am[0], env.device, env.isolate,
                   cache) if envs is not None else None for run, me, envs, am in jobs]
    ok = True   # a failed positive control (attack too weak) or negative control (sees leakage where there is
    for c in ctl.result():   # none) makes every number of this attack "not measurable"
        ok &= c.passed
        controls.append(dict(attack=label, **dataclasses.asdict(c), passed=c.passed))
    status = "ok" if ok else "not measurable (control failed)"
    for (run, me, envs, am), fut in zip(jobs, futs):
        row = lambda o, victim, r: dict(  # noqa: E731
            {k: getattr(run, k) for k in ("dataset", "method", "variant", "target", "seed")}, run=run.run,
            attack=label, adversary=me, artifact=getattr(o, "artifact", ""), round=getattr(o, "round", ""),
            victim=victim, output=getattr(o, "variant", ""), status=status, **r)
        note = lambda metric, why, o=None, victim="": row(  # noqa: E731  (a row without a number)
            o, victim, dict(metric=metric, value=float("nan"), baseline=float("nan"))) | {"status": why}
        if fut is None:
            rows.append(note("skipped", f"skipped: {me} is not a client of this run"))
            continue
        if not env.quiet and sys.stderr.isatty():
            sys.stderr.write(f"\rattack {label} on {run.run} ...")
        try:
            outs = fut.result()
        except UserError:
            raise
        except Exception as e:  # keep the other attacks' and runs' numbers; record the failure
            detail = e.detail if isinstance(e, AttackFailed) else traceback.format_exc()
            why = str(e) if isinstance(e, AttackFailed) else f"{type(e).__name__}: {e}"
            print(f"attack {label} failed on {run.run}: {one_line(why, detail)}", file=sys.stderr)
            rows.append(note("failed", f"failed: {one_line(why)}"))
            continue
        rows += _score_run(env, label, run, outs, am, row, note)
    attacked = sum(f is not None for f in futs)
    eta = [env.eta.tick() for _ in jobs][-1:]   # every job of this attack is done now
    if not env.quiet and not sys.stderr.isatty() and attacked:   # batch jobs: one line per attack
        print(f"attack {label}: {attacked} runs, {time.perf_counter() - t0:.0f} s"
              + ("" if ok else " (a control failed: not measurable)") + "".join(f"; {e}" for e in eta),
              file=sys.stderr, flush=True)
    return rows


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
    import numpy as np
    groups: dict = {}
    for o in outs:
        if isinstance(o, Scores):
            groups.setdefault((o.artifact, o.round, o.variant), []).append(o)
    return [Scores("pooled", a, r, np.concatenate([np.asarray(o.scores) for o in g]), v,
                   victims=[o.victim for o in g]) for (a, r, v), g in groups.items() if len(g) > 1]


def run_attacks_cli(run_dir: str, names: list[str], quiet: bool = False, trust: bool = False,
                    isolate: bool = True) -> str:
    """``attack RUN_DIR``: plugins named by the folder load only if installed (or ``trust``); ``names`` are the
    user's own choice (command line) and load from anywhere."""
    root = Path(run_dir)
    RunFolder(root).summary()
    with from_folder(root, allow=names, trust=trust):
        from .scenario import Scenario, load_raw, parse
        cfg = root / "config.resolved.toml"   # its attacks, and its parallel and threads settings
        sc = parse(load_raw(cfg)) if cfg.exists() or not names else Scenario()
        conf = [dict(name=a.name, label=a.label, **a.params) for a in sc.attacks]
        # a name on the command line takes the folder's settings of the entry of that label (else of that name)
        pick = lambda n: next((c for c in conf if c["label"] == n), None) or \
            next((c for c in conf if c["name"] == n), None) or {"name": n}  # noqa: E731
        cfgs = [pick(n) for n in names] if names else conf or [{"name": n} for n in sorted(available("attack"))]
        out = run_attacks(root, cfgs, quiet, isolate, sc.parallel, sc.threads)
    return f"leakage: {out}"
