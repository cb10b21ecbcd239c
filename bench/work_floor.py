"""The least wall time a finished run folder's work can take on N cores: its training and attack CPU seconds.

    python bench/work_floor.py RUN_DIR [--cores 2] [--target-min 15]

Training: each run's ``seconds`` in summary.json (one torch thread per run, so wall seconds of one core), per data
set and method, split into the seeds the attacks read (``attack_seeds`` of the resolved config) and the seeds kept
for held-out accuracy only. Attacks: the CPU seconds every attack job recorded (attack_jobs/<attack>/<key>/*.json,
``cpu``: the worker's own count); an attack's controls and the harness's scoring are not recorded in the folder, so
the attack line is a lower bound (the scenario's log prints the whole: "attack X: ..., N CPU s"). The floor is the
sum over the cores, as if no second were lost to start-up, waiting, data, controls, scoring or the report. It
answers one question: can this design fit the target on this machine by scheduling alone, or must the work shrink?
"""
from __future__ import annotations

import argparse
import json
import statistics
import tomllib
from collections import defaultdict
from pathlib import Path


def training(run: Path) -> dict:
    """{(data set, method, "attacked" | "accuracy only"): [seconds of each run]}"""
    cfg = tomllib.loads((run / "config.resolved.toml").read_text())
    attacked = set(cfg.get("attack_seeds") or cfg.get("seeds") or [])
    out = defaultdict(list)
    for r in json.loads((run / "summary.json").read_text())["runs"]:
        kind = "attacked" if r["seed"] in attacked else "accuracy only"
        out[r["dataset"], r["method"], kind].append(float(r.get("seconds") or 0))
    return out


def attacks(run: Path) -> dict:
    """{attack: CPU seconds over its jobs}"""
    out = defaultdict(float)
    for f in sorted((run / "attack_jobs").glob("*/*/*.json")):
        rec = json.loads(f.read_text())
        if isinstance(rec, dict) and "cpu" in rec:
            out[f.parts[-3]] += float(rec["cpu"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--target-min", type=float, default=15.0)
    a = ap.parse_args()
    run = Path(a.run_dir)
    train, att = training(run), attacks(run)
    print(f"{run}: training, run seconds (one thread per run)")
    for (ds, method, kind), secs in sorted(train.items()):
        print(f"  {ds:14s} {method:8s} {kind:14s} {len(secs):3d} runs  {sum(secs):7.0f} s  "
              f"(median {statistics.median(secs):.1f} s a run)")
    by_kind = {k: sum(sum(v) for key, v in train.items() if key[2] == k) for k in ("attacked", "accuracy only")}
    print("attacks, CPU seconds of their jobs (controls and scoring not included)")
    for name, cpu in sorted(att.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {cpu:7.0f} s")
    total = sum(by_kind.values()) + sum(att.values())
    parts = [("training, accuracy-only seeds", by_kind["accuracy only"]), ("training, attacked seeds",
             by_kind["attacked"]), ("attacks", sum(att.values())), ("all", total)]
    print(f"floor on {a.cores} cores (CPU seconds / {a.cores}), against {a.target_min:g} min:")
    for name, secs in parts:
        print(f"  {name:30s} {secs:7.0f} CPU s  {secs / a.cores / 60:5.1f} min  "
              f"{secs / a.cores / 60 / a.target_min:4.2f}x the target")


if __name__ == "__main__":
    main()
