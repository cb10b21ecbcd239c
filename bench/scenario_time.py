"""Time a scenario end to end and the share of each phase: training, evaluation, each attack, the report.

    python bench/scenario_time.py [SCENARIO] [--threads N] [--set key=value ...]

Default: scenarios/feddg_vs_csac.toml (the main job; its target is 15 minutes on 2 CPU cores). Runs the
scenario in this process and wraps, without changing them, ``run_federation`` (training + evaluation),
``federation.accuracy`` (evaluation), each attack's controls, runs and scoring (per attack, worker processes
included), and ``write_report``. It prints the wall time per phase and its share of the total, and CPU time of
this process and the children it reaps; then, per reconstruction attack and output, the CPU seconds and iterations
the attack recorded for its own optimisations (leakage.csv) and its plateau rule. Worker processes forked by the
forkserver (parallel runs, attack workers) are not its children: their CPU is missing from the CPU column, so read
the wall shares, on an idle machine.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fdg_audit.audit.harness as A         # noqa: E402
import fdg_audit.train.federation as F      # noqa: E402
import fdg_audit.report as R          # noqa: E402
import fdg_audit.runner as RUN        # noqa: E402
import fdg_audit.train.runs as TR      # noqa: E402

WALL, CPU = defaultdict(float), defaultdict(float)


def cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def timed(phase, fn):
    def wrap(*a, **k):
        w, c = time.perf_counter(), cpu()
        try:
            return fn(*a, **k)
        finally:
            WALL[phase] += time.perf_counter() - w
            CPU[phase] += cpu() - c
    return wrap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?", default=str(ROOT / "scenarios" / "feddg_vs_csac.toml"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the scenario's)")
    ap.add_argument("--set", nargs="*", default=[], dest="sets")
    ap.add_argument("--out", default="/tmp/fdg_bench_runs")
    a = ap.parse_args()
    sets = list(a.sets) + ([f"threads={a.threads}"] if a.threads else [])

    F.accuracy = timed("evaluation", F.accuracy)
    fed = TR.run_federation
    TR.run_federation = lambda spec, *a, **k: timed(f"training {spec.method}", fed)(spec, *a, **k)
    # attacks run in worker processes (fdg_audit.audit.sandbox), several at once with parallel > 1: time each attack's
    # whole phase (controls, runs, scoring of its outputs), per label
    one = A.attack_runs
    A.attack_runs = lambda env, label, *a, **k: timed(f"attack {label}", one)(env, label, *a, **k)
    RUN.write_report = timed("report", R.write_report)
    # parallel runs train in worker processes: time the whole run loop (training and evaluation) from the start
    # to the first attack (or the report), with the workers' CPU once they are reaped
    mark = {}
    run_attacks = A.run_attacks

    def first(*args, **kw):
        mark.setdefault("w", time.perf_counter())
        mark.setdefault("c", cpu())
        return run_attacks(*args, **kw)
    RUN.run_attacks = first

    w0, c0 = time.perf_counter(), cpu()
    root = RUN.run_scenario(a.scenario, sets, out=a.out, quiet=True)
    wall, total = time.perf_counter() - w0, cpu() - c0
    if not any(k.startswith("training ") for k in WALL) and mark:
        WALL["training + evaluation (parallel runs)"] = mark["w"] - w0
        CPU["training + evaluation (parallel runs)"] = mark["c"] - c0
        import json
        secs = {}
        for r in json.loads((root / "summary.json").read_text())["runs"]:
            secs[r["plugin"]] = secs.get(r["plugin"], 0.0) + r.get("seconds", 0.0)
        print("run seconds inside the workers, summed per method: "
              + ", ".join(f"{m} {v:.0f} s" for m, v in secs.items()))
    for d in (WALL, CPU):   # training phases include their evaluation: split it off pro rata
        train = [k for k in d if k.startswith("training ")]
        tot = sum(d[k] for k in train)
        for k in train:
            d[k] -= d["evaluation"] * d[k] / max(tot, 1e-9)
    WALL["other (plan, ledger, attack harness)"] = wall - sum(WALL.values())
    CPU["other (plan, ledger, attack harness)"] = total - sum(CPU.values())
    print(f"scenario {a.scenario} -> {root}")
    print(f"total: wall {wall:.1f} s ({wall / 60:.2f} min), CPU {total:.1f} s ({total / 60:.2f} min)")
    print(f"{'phase':<44} {'wall s':>8} {'share':>7} {'CPU s':>8}")
    for k in sorted(WALL, key=lambda k: -WALL[k]):
        print(f"{k:<44} {WALL[k]:>8.1f} {WALL[k] / max(wall, 1e-9):>7.1%} {CPU[k]:>8.1f}")
    costs(root)


def costs(root) -> None:
    """Per reconstruction attack and output, what the attack recorded of its own optimisations (leakage.csv
    metrics ``cpu_seconds`` and ``iterations``, one per reconstruction): total CPU, median iterations, and its rule."""
    import csv
    import statistics
    path = Path(root) / "leakage.csv"
    if not path.exists():
        return
    got, rule = defaultdict(lambda: defaultdict(list)), {}
    for r in csv.DictReader(open(path)):
        if r.get("metric") in ("cpu_seconds", "iterations") and r.get("value") not in ("", None):
            key = (r["attack"], r.get("output", ""))
            got[key][r["metric"]].append(float(r["value"]))
            rule.setdefault(key, r.get("plateau", ""))
    if got:
        print(f"\n{'attack / output':<52} {'outputs':>7} {'CPU s':>8} {'median its':>10}  rule")
    for (atk, out), m in sorted(got.items()):
        its = m.get("iterations", [])
        print(f"{atk + (' / ' + out if out else ''):<52} {len(m.get('cpu_seconds', its)):>7} "
              f"{sum(m.get('cpu_seconds', [])):>8.1f} {statistics.median(its) if its else float('nan'):>10.0f}  "
              f"{rule[atk, out]}")


if __name__ == "__main__":
    main()
