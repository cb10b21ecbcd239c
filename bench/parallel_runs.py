"""Parallel runs vs one run at a time: wall time of the same runs, side by side, interleaved.

    python bench/parallel_runs.py [--runs 4] [--rounds 8] [--repeats 2]

Variant "one at a time": ``parallel = 1`` with every core's torch threads (``threads = 2`` on 2 cores); variant
"parallel": ``parallel = 2`` with ``threads = 1`` each. Both train the same FedAvg runs on real rotated MNIST (no
attacks, no report; process start-up and data loading included) and must write the same per-run results (checked).
Prints each repetition and the ratio of wall times (one at a time / parallel; > 1: parallel pays).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fdg_audit.runner import run_scenario  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4, help="runs (seeds) of FedAvg held out on rot75")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    text = textwrap.dedent(f"""
        name = "par"
        seeds = {list(range(a.runs))}
        store = "none"
        report = false
        [data]
        dataset = "mnist"
        family = "rotated"
        per_domain = 500
        targets = ["rot75"]
        [train]
        rounds = {a.rounds}
        [[methods]]
        name = "fedavg"
        """)
    variants = {"one at a time (threads 2)": ["parallel=1", "threads=2"],
                "parallel (2 x threads 1)": ["parallel=2", "threads=1"]}
    ratios = []
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "s.toml"
        f.write_text(text)
        for rep in range(a.repeats):
            wall, acc = {}, {}
            for name, sets in variants.items():
                t = time.perf_counter()
                root = run_scenario(str(f), sets, out=str(Path(d) / "runs"), quiet=True)
                wall[name] = time.perf_counter() - t
                acc[name] = [r["target_acc"] for r in json.loads((root / "summary.json").read_text())["runs"]]
            seq, par = wall.values()
            ratios.append(seq / par)
            print(f"rep {rep + 1}: " + "  ".join(f"{k}: {v:.1f} s" for k, v in wall.items())
                  + f"  ratio {seq / par:.2f}", flush=True)
    print(f"wall ratio one-at-a-time / parallel: mean {sum(ratios) / len(ratios):.2f} (min {min(ratios):.2f}, "
          f"max {max(ratios):.2f}) over {len(ratios)} repetitions; {a.runs} FedAvg runs of {a.rounds} rounds")


if __name__ == "__main__":
    main()
