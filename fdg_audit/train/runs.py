"""A scenario's runs trained into a run folder: every federation through the bus, its records written.

Outputs (``runs/<name>/<timestamp>/``): manifest.json, config.resolved.toml, messages.jsonl, payloads/,
truth/ (ground truth for scorers only), metrics.csv (one row per run and round), summary.json (one entry
per run, rewritten atomically after each). A failed run is recorded in summary.json and the others go on; finished
runs are never lost. Each finished run's summary entry holds its config hash and its hash-chain head;
``scenario FILE --resume RUN_DIR`` keeps the runs that match and runs the rest. The scenario driver
(fdg_audit.runner) plans the runs before and attacks and reports the folder after.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import __version__
from ..data import DataConfig, load_data
from ..errors import UserError
from ..params import resolve_device
from ..privacy import privacy_csv
from ..progress import Eta
from ..store.ledger import Ledger, atomic_write, npz_bytes, read_summary
from ..store.runfolder import RunFolder, RunInfo
from ..workers import worker_context
from .federation import RunSpec, run_federation


class Progress:
    """A tqdm bar per run (rounds done, accuracy); silent when stderr is not a TTY."""

    def __init__(self, label: str, total: int):
        self.bar = tqdm(total=total, desc=label, leave=True, disable=not sys.stderr.isatty(), dynamic_ncols=True)

    def __call__(self, row: dict) -> None:
        if row["round"] == 0:
            return
        if "target_acc" in row:
            self.bar.set_postfix(val=f"{row['source_val_acc']:.3f}", tgt=f"{row['target_acc']:.3f}", refresh=False)
        self.bar.update(1)
        if self.bar.n >= self.bar.total:
            self.bar.close()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def truth_writer(root: Path):
    def sink(run_id: str, client: str, name: str, arrays: dict) -> None:
        atomic_write(RunFolder(root).truth_file(run_id, client, name), npz_bytes(arrays))
    return sink


def _default(f):
    return f.default if f.default is not MISSING else f.default_factory() if f.default_factory is not MISSING else MISSING


def _as_recorded(obj, recorded: dict) -> dict:
    """``asdict(obj)`` without the fields that ``recorded`` (a finished run's summary entry for obj) lacks and obj leaves
    at their default, recursively: a field a later fdg_audit added, at its default, leaves an old run's configuration
    what it was."""
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if f.name not in recorded and v == _default(f):
            continue
        sub = recorded.get(f.name)
        out[f.name] = _as_recorded(v, sub) if is_dataclass(v) and isinstance(sub, dict) else \
            asdict(v) if is_dataclass(v) else v
    return out


def run_store(r: dict):
    """The run's payload policy: the scenario's ``store``, except "none" for a seed that no attack of the scenario
    reads when ``attack_seeds`` is set (not in it nor in an attack's own ``seeds``): such a run trains for the
    accuracy comparisons only; its envelopes (sizes, hashes) are recorded as every run's."""
    sc = r["sc"]
    read = set(sc.attack_seeds).union(*(a.params.get("seeds") or () for a in sc.attacks))
    return "none" if sc.attack_seeds and r["seed"] not in read else sc.store


def run_config_hash(r: dict, recorded: dict | None = None) -> str:
    """sha256 of everything that decides one run's records: ``--resume`` skips a finished run only if it matches.
    With ``recorded`` (the finished run's summary entry), fields it lacks that r leaves at their default are left out
    (``_as_recorded``): the hash that run was given before those fields existed."""
    sc = r["sc"]
    dc = lambda obj, key: asdict(obj) if recorded is None else _as_recorded(obj, recorded.get(key) or {})  # noqa: E731
    # the summary's data entry lacks label and targets, and a secret split seed: the hash always had them
    data = asdict(r["ds"]) if recorded is None else \
        _as_recorded(r["ds"], {**(recorded.get("data") or {}), "label": 0, "targets": 0, "split_seed": 0})
    data.pop("seeds", None)   # which seeds a data set trains is not part of any one run
    cfg = dict(run=r["run_id"], method=r["method"].name, params=dc(r["params"], "params"), data=data,
               model=dc(sc.model, "model"), target=r["target"], seed=r["seed"], store=run_store(r),
               store_rounds=sc.store_rounds, privacy=(dc(r["privacy"], "privacy")) if r["privacy"] else {})
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()


def _resume(root: Path, runs: list[dict]) -> tuple[dict, dict, Ledger]:
    """The finished runs of ``root`` that match the plan (by run id and config hash), their metrics rows, and the
    folder's ledger cut back to them (lines of unfinished or changed runs, and a torn last line, are dropped)."""
    if not (root / "config.resolved.toml").exists():
        raise UserError(f"--resume {root}: not a run folder (no config.resolved.toml); pass runs/<scenario>/<timestamp>")
    want = {r["run_id"]: run_config_hash(r) for r in runs}
    ok = [s for s in read_summary(root)["runs"] if s["status"] == "ok" and s.get("chain_head")]
    plan_of = {r["run_id"]: r for r in runs}
    done = {s["run"]: s for s in ok if s["run"] in plan_of and s.get("config_sha256") in
            (want[s["run"]], run_config_hash(plan_of[s["run"]], s))}
    other = [s["run"] for s in ok if s["run"] not in done]
    if other:   # before anything is written: resuming would drop finished runs from the ledger
        raise UserError(f"--resume {root}: {len(other)} finished run(s) (e.g. {other[0]}) were made with another "
                        f"configuration (other --set values, another scenario or another fdg_audit version); nothing "
                        f"was changed: resume with what made them, or start a new folder without --resume")
    old = Ledger.open(root) if (root / "messages.jsonl").exists() else None
    if old is not None:
        old.verify({k: v["chain_head"] for k, v in done.items()})
    lines = (root / "messages.jsonl").read_bytes().split(b"\n") if old is not None else []
    keep = [(e, ln) for e, ln in zip(old.envelopes, old.lines) if e.run in done] if old is not None else []
    atomic_write(root / "messages.jsonl", b"".join(lines[n - 1] + b"\n" for _, (n, _) in keep))
    rows = defaultdict(list)
    if (root / "metrics.csv").exists():
        with open(root / "metrics.csv", newline="") as f:
            for row in csv.DictReader(f):
                if row.get("run") in done:
                    rows[row["run"]].append(row)
    return done, rows, keep


def train_runs(runs: list[dict], resolved: str, keys: dict, path: str, sets: list[str], out: str | None,
               resume: str | None, preview: bool, quiet: bool) -> tuple[Path, dict, Ledger]:
    """Train the planned ``runs`` into a new folder under ``out`` (default the scenario's), or into ``resume``
    skipping the runs that folder already finished; ``resolved``: the scenario's TOML as recorded (without the secret
    split seeds ``keys``, which go to truth/). Returns the folder, its summary and its closed ledger. Ctrl-C ends with
    one line saying what finished and how to resume."""
    sc0 = runs[0]["sc"]
    if resume:
        root = Path(resume)
        done, rows_by, keep = _resume(root, runs)
    else:
        root = _new_folder(Path(out or sc0.out) / sc0.name)
        done, rows_by, keep = {}, defaultdict(list), []
    atomic_write(root / "truth" / "secrets.json", json.dumps(keys))
    atomic_write(root / "config.resolved.toml", resolved)
    atomic_write(root / "manifest.json", json.dumps({
        "scenario": sc0.name, "source": str(path), "sets": list(sets), "fdg_audit": __version__,
        "commit": git_commit(), "python": platform.python_version(), "torch": torch.__version__,
        "numpy": np.__version__, "seeds": sc0.seeds, "config_sha256": hashlib.sha256(resolved.encode()).hexdigest(),
        "runs": [r["run_id"] for r in runs], "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "preview": preview,
        "resumed_with": sorted(done)}, indent=1))
    ledger = Ledger(root, store=sc0.store, rounds=sc0.store_rounds)
    for e, ln in keep:   # messages.jsonl now holds exactly these lines; the ledger appends after them
        ledger.heads[e.run] = ln[1]
    ledger.count = len(keep)
    again = f"python -m fdg_audit scenario {shlex.join([str(path)] + (['--set', *sets] if sets else []))} " \
            f"--resume {shlex.quote(str(root))}"
    return root, _train_all(runs, root, ledger, done, rows_by, again, quiet), ledger


def _new_folder(parent: Path) -> Path:
    """A new run folder ``parent/<timestamp>`` (``_`` appended while one of that name exists)."""
    root = parent / time.strftime("%Y%m%d-%H%M%S")
    while root.exists():
        root = root.with_name(root.name + "_")
    try:
        root.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"cannot create the run folder {root} ({e.strerror}): set --out (or out = \"...\") to a "
                        f"writable folder") from None
    return root


def _train_all(runs: list[dict], root: Path, ledger: Ledger, done: dict, rows_by: dict, again: str,
               quiet: bool) -> dict:
    """Train the runs not ``done``, rewriting summary.json, metrics.csv (and privacy.csv) after each; the summary."""
    sc0 = runs[0]["sc"]
    sink = truth_writer(root)
    infos = dict(done)
    summary = {"scenario": sc0.name, "reference": sc0.compare_to, "runs": []}
    i, todo = 0, [(i, r) for i, r in enumerate(runs) if r["run_id"] not in done]
    if not quiet:
        print(f"training {len(todo)} runs" + (f" ({len(done)} already finished)" if done else "")
              + (f", {sc0.parallel} at a time" if sc0.parallel > 1 else "") + f"; results in {root}",
              file=sys.stderr, flush=True)
    _ETA[:] = [Eta("training", len(todo))]
    results = _parallel(todo, runs, root, quiet) if sc0.parallel > 1 and len(todo) > 1 else \
        ((i, r, lambda led, rows, i=i, r=r: _one_run(i, r, runs, led, sink, rows, quiet)) for i, r in todo)
    try:
        for i, r, finish in results:
            infos[r["run_id"]] = finish(ledger, rows_by)
            summary["runs"] = [infos[x["run_id"]] for x in runs if x["run_id"] in infos]
            write_csv(root / "metrics.csv", [row for x in runs for row in rows_by.get(x["run_id"], [])])
            atomic_write(root / "summary.json", json.dumps(summary, indent=1, default=str))
            if any(x["privacy"] for x in runs):
                atomic_write(root / "privacy.csv", privacy_csv(ledger.stream()))
    except KeyboardInterrupt:
        ledger.close()
        n = sum(s["status"] == "ok" for s in infos.values())
        raise UserError(f"interrupted during run {i + 1}/{len(runs)} ({runs[i]['run_id']}): {n} of {len(runs)} runs "
                        f"finished in {root}; resume with: {again}") from None
    finally:   # a parallel run's error or Ctrl-C: its workers stop at once, queued runs never start
        _parallel_stop()
    ledger.close()
    summary["runs"] = [infos[x["run_id"]] for x in runs if x["run_id"] in infos]
    return summary

_POOL = []   # the worker pool of parallel runs, so Ctrl-C can stop it


def _parallel_stop() -> None:
    """Stop the parallel runs' workers at once (their unfinished runs are dropped, as an interrupted run is)."""
    while _POOL:
        pool = _POOL.pop()
        for p in list(getattr(pool, "_processes", {}).values()):
            p.terminate()
        pool.shutdown(wait=False, cancel_futures=True)


def _parallel(todo: list, runs: list, root: Path, quiet: bool):
    """Train ``todo`` (index, run) in ``parallel`` worker processes (``workers.worker_context``), yielding them in plan order as
    (i, run, finish); ``finish(ledger, rows_by)`` appends the run's ledger lines (written by the worker to
    parts/<i>.jsonl, with its own hash chain) to messages.jsonl and returns its summary entry. Each run's records
    are those of the run trained alone with the same threads: its chain and payloads do not depend on the others,
    and messages.jsonl holds the runs in plan order."""
    sc0 = runs[0]["sc"]
    shutil.rmtree(root / "parts", ignore_errors=True)   # an interrupted run's part files are not records
    pool = ProcessPoolExecutor(sc0.parallel, mp_context=worker_context())
    _POOL.append(pool)
    light = lambda r: {k: v for k, v in r.items() if k != "data"}  # noqa: E731  (workers load their own data)
    futs = [(i, r, pool.submit(_worker_run, i, light(r), len(runs), str(root), sc0.store, sc0.store_rounds))
            for i, r in todo]
    for i, r, fut in futs:
        def finish(ledger: Ledger, rows_by: dict, i=i, r=r, fut=fut) -> dict:
            info, rows = fut.result()
            part = root / "parts" / f"{i}.jsonl"
            if part.exists():
                for line in part.read_bytes().splitlines():
                    ledger.append_line(line.decode())
                part.unlink()
            if rows:
                rows_by[r["run_id"]] = rows
            if info["status"] == "ok" and not quiet:
                _say_run(i, len(runs), r, info)
            return info
        yield i, r, finish
    pool.shutdown()
    _POOL.remove(pool)
    if (root / "parts").is_dir() and not any((root / "parts").iterdir()):
        (root / "parts").rmdir()


_DATA = {}   # a worker's data sets, loaded once per data configuration


def _worker_run(i: int, r: dict, n_runs: int, root: str, store, store_rounds) -> tuple[dict, list]:
    """One run in a worker process: its own ledger file parts/<i>.jsonl in the run folder (payloads and truth go
    where the in-process run puts them); returns (summary entry, metrics rows)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the driver's to handle
    key = json.dumps(asdict(r["ds"]), sort_keys=True, default=str)
    if key not in _DATA:
        _DATA[key] = load_data(r["ds"])
    r = dict(r, data=_DATA[key])
    ledger = Ledger(root, store=store, rounds=store_rounds, file=f"parts/{i}.jsonl")
    rows_by = {}
    try:
        info = _one_run(i, r, [None] * n_runs, ledger, truth_writer(Path(root)), rows_by, quiet=True)
    finally:
        ledger.close()
    return info, rows_by.get(r["run_id"], [])


_ETA: list = []   # the training phase's clock (train_runs sets it)


def _say_run(i: int, n: int, r: dict, info: dict) -> None:
    """One line per finished run on stderr when it is not a TTY (batch jobs; a TTY has the progress bar), with the
    phase's progress and time left."""
    eta = f"; {_ETA[-1].tick()}" if _ETA else ""
    if sys.stderr.isatty() and r["sc"].parallel <= 1:
        return
    print(f"[{i + 1}/{n}] {r['run_id']}: held-out acc {info['target_acc']:.3f} (round "
          f"{info['selected_round']}/{r['params'].rounds}{'' if info['converged'] else ', NOT CONVERGED'}), "
          f"{info['seconds']:.1f} s{eta}", file=sys.stderr, flush=True)


def _one_run(i: int, r: dict, runs: list, ledger: Ledger, sink, rows_by: dict, quiet: bool) -> dict:
    """Train and record one run; its summary entry (a failure is recorded, not raised)."""
    sc, threads = r["sc"], torch.get_num_threads()
    if sc.threads:   # the scenario's thread count for this run only; the caller's is restored below
        torch.set_num_threads(sc.threads)
    store, ledger.store = ledger.store, run_store(r)   # the one place a run's payload policy is set, either engine
    try:
        return _train(i, r, runs, ledger, sink, rows_by, quiet)
    finally:
        torch.set_num_threads(threads)
        ledger.store = store


def _train(i: int, r: dict, runs: list, ledger: Ledger, sink, rows_by: dict, quiet: bool) -> dict:
    sc = r["sc"]
    spec = RunSpec(r["run_id"], r["method"].name, r["params"], r["ds"], sc.model, r["target"], r["seed"],
                   resolve_device(sc.device), sc.engine, sc.threads or torch.get_num_threads(), privacy=r["privacy"],
                   workers=sc.workers, worker_threads=sc.worker_threads, ray=sc.ray)
    data = {f.name: getattr(r["ds"], f.name) for f in fields(DataConfig)}
    if r.get("secret"):   # the split seed stays in truth/secrets.json
        data.pop("split_seed")
    info = dict(run=r["run_id"], dataset=r["ds"].label, method=r["method"].label, variant=r["variant"],
                target=r["target"], seed=r["seed"], sweep=r["sweep"], params=asdict(r["params"]),
                plugin=r["method"].name, privacy=asdict(r["privacy"]) if r["privacy"] else {}, data=data,
                secret=r.get("secret", ""), model=asdict(sc.model), num_classes=r["data"].num_classes,
                channels=r["data"].channels, size=r["data"].size, config_sha256=run_config_hash(r))
    t0 = time.time()
    try:
        res = run_federation(spec, ledger, r["data"], truth_sink=sink,
                             on_round=None if quiet else Progress(f"[{i + 1}/{len(runs)}] {r['run_id']}",
                                                                  r["params"].rounds))
    except UserError:
        raise
    except Exception as e:  # keep finished runs; record the failure and go on
        info.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        print(f"run {r['run_id']} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    else:
        info.update(status="ok", seconds=round(time.time() - t0, 2), chain_head=ledger.heads.get(r["run_id"], ""),
                    **{k: v for k, v in res.items() if k != "history"})
        rows_by[r["run_id"]] = [{k: info[k] for k in ("run", "dataset", "method", "variant", "target", "seed")} | h
                                for h in res["history"]]
        if not quiet:
            _say_run(i, len(runs), r, info)
    return asdict(RunInfo(**info))   # the run's record in summary.json (fdg_audit.store.runfolder.RunInfo)


def write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())
