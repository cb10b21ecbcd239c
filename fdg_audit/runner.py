"""Run a scenario: expand it, run every federation through the bus, write the run folder.

Outputs (``runs/<name>/<timestamp>/``): manifest.json, config.resolved.toml, messages.jsonl, payloads/,
truth/ (ground truth for scorers only), metrics.csv (one row per run and round), summary.json (one entry
per run, rewritten atomically after each), then leakage.csv and report.md when attacks / the report run.
A failed run is recorded in summary.json and the others go on; finished runs are never lost.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import platform
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import __version__
from .errors import UserError
from .federation import RunSpec, run_federation
from .params import resolve_device
from .ledger import Ledger, atomic_write
from .privacy import privacy_csv
from .scenario import dump_toml, plan  # noqa: F401  (plan re-exported)


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


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def truth_writer(root: Path):
    def sink(run_id: str, client: str, name: str, arrays: dict) -> None:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write(root / "truth" / run_id / client / f"{name}.npz", buf.getvalue())
    return sink


def run_scenario(path: str, sets: list[str] = (), out: str | None = None, quiet: bool = False) -> Path:
    from .scenario import load_raw
    raw = load_raw(path, sets)
    runs = plan(raw)
    sc0 = runs[0]["sc"]
    root = Path(out or sc0.out) / sc0.name / time.strftime("%Y%m%d-%H%M%S")
    while root.exists():
        root = root.with_name(root.name + "_")
    root.mkdir(parents=True)
    resolved = dump_toml(raw)
    atomic_write(root / "config.resolved.toml", resolved)
    atomic_write(root / "manifest.json", json.dumps({
        "scenario": sc0.name, "source": str(path), "sets": list(sets), "fdg_audit": __version__,
        "commit": _git_commit(), "python": platform.python_version(), "torch": torch.__version__,
        "numpy": np.__version__, "seeds": sc0.seeds, "config_sha256": hashlib.sha256(resolved.encode()).hexdigest(),
        "runs": [r["run_id"] for r in runs], "started": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
    ledger = Ledger(root, store=sc0.store, rounds=sc0.store_rounds)
    sink = truth_writer(root)
    rows, summary = [], {"scenario": sc0.name, "runs": []}
    for i, r in enumerate(runs):
        sc = r["sc"]
        if sc.threads:
            torch.set_num_threads(sc.threads)
        spec = RunSpec(r["run_id"], r["method"].name, r["params"], r["ds"], sc.model, r["target"], r["seed"],
                       resolve_device(sc.device), sc.engine, sc.threads or torch.get_num_threads(),
                       privacy=r["privacy"])
        info = dict(run=r["run_id"], dataset=r["ds"].label, method=r["method"].label, variant=r["variant"],
                    target=r["target"], seed=r["seed"], sweep=r["sweep"], params=asdict(r["params"]),
                    plugin=r["method"].name, privacy=asdict(r["privacy"]) if r["privacy"] else {},
                    num_classes=r["data"].num_classes)
        t0 = time.time()
        try:
            res = run_federation(spec, ledger, r["data"], truth_sink=sink,
                                 on_round=None if quiet else Progress(f"[{i + 1}/{len(runs)}] {r['run_id']}",
                                                                      r["params"].rounds))
        except UserError:
            raise
        except Exception as e:  # keep finished runs; record the failure and go on
            info.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            print(f"run {r['run_id']} failed: {type(e).__name__}: {e}", file=sys.stderr)
        else:
            info.update(status="ok", seconds=round(time.time() - t0, 2), **{k: v for k, v in res.items()
                                                                           if k != "history"})
            rows += [{k: info[k] for k in ("run", "dataset", "method", "variant", "target", "seed")} | h
                     for h in res["history"]]
            _write_csv(root / "metrics.csv", rows)
        summary["runs"].append(info)
        atomic_write(root / "summary.json", json.dumps(summary, indent=1, default=str))
        if any(x["privacy"] for x in runs):
            atomic_write(root / "privacy.csv", privacy_csv(ledger.envelopes))
    ledger.close()
    summary["bytes"] = bytes_table(ledger.envelopes)
    atomic_write(root / "summary.json", json.dumps(summary, indent=1, default=str))
    if sc0.attacks:
        from .attack import run_attacks
        run_attacks(root, [dict(name=a.name, label=a.label, **a.params) for a in sc0.attacks], quiet=quiet)
    if sc0.report:
        from .report import write_report
        write_report([root], root, quiet=quiet)
    if any(r["status"] != "ok" for r in summary["runs"]):
        failed = [r["run"] for r in summary["runs"] if r["status"] != "ok"]
        raise RuntimeError(f"{len(failed)} run(s) failed (see {root / 'summary.json'}): {', '.join(failed)}")
    return root


def _write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def bytes_table(envelopes) -> dict:
    """Per dataset/method: bytes by artifact kind, one-time (round 0) and per training round, averaged over
    runs, and the artifact kinds that left the clients."""
    acc = defaultdict(lambda: {"once": defaultdict(int), "rounds": defaultdict(int), "runs": set(),
                               "round_ids": set(), "client_kinds": set()})
    for e in envelopes:
        ds, method = e.run.split("/")[:2]
        o = acc[f"{ds}/{method}"]
        o["runs"].add(e.run)
        if e.round == 0:
            o["once"][e.kind] += e.wire_bytes
        else:
            o["rounds"][e.kind] += e.wire_bytes
            o["round_ids"].add((e.run, e.round))
        if e.sender != "server":
            o["client_kinds"].add(e.kind)
    out = {}
    for k, o in acc.items():
        nr, nt = len(o["runs"]), max(1, len(o["round_ids"]))
        once = {kk: v / nr for kk, v in sorted(o["once"].items())}
        per_round = {kk: v / nt for kk, v in sorted(o["rounds"].items())}
        out[k] = {"one_time_by_kind": once, "per_round_by_kind": per_round,
                  "per_run_total": (sum(o["once"].values()) + sum(o["rounds"].values())) / nr,
                  "rounds_per_run": nt / nr, "kinds_from_clients": sorted(o["client_kinds"])}
    return out
