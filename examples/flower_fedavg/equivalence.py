"""The example's FedAvg recorded through Flower against the same FedAvg run natively, seed by seed (issue 49, item 5).

    python examples/flower_fedavg/run.py --out runs/flower_fedavg --strategies fedavg      # records and attacks
    python -m fdg_audit scenario examples/flower_fedavg/native.toml --out runs/flower_native   # trains and attacks
    python examples/flower_fedavg/equivalence.py runs/flower_fedavg runs/flower_native/flower_fedavg_native/<time>

Weights: for each seed (its own data draw) and round, the largest absolute difference between the native and the
Flower payload of every (sender, receiver) weights envelope, and how many are the same bytes. Leakage: every cell
(attack, victim, round, metric) both folders scored, its mean over seeds in each with a 95% Student-t interval, and
the paired difference (Flower - native) with its interval; n is printed (below 3 seeds: not testable). A seed
whose Flower folder is missing or not attacked yet is said and left out.
"""
from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from fdg_audit.metrics.stats import t_interval
from fdg_audit.store.ledger import Ledger


def weights(ledger: Ledger, run: str) -> dict:
    return {(e.round, e.sender, e.receiver): e for e in ledger.stream() if e.run == run and e.kind == "weights"}


def compare_weights(flower_root: Path, native: Ledger, run: str) -> dict[int, tuple[int, int, float]]:
    """{round: (same bytes, envelopes, max |native - flower|)} of one run."""
    fl = Ledger.open(flower_root)
    a, b = weights(native, run), weights(fl, run)
    if set(a) != set(b):
        raise SystemExit(f"{run}: the weights envelopes differ ({len(a)} native, {len(b)} Flower)")
    out = defaultdict(lambda: [0, 0, 0.0])
    for k in sorted(a):
        x, y = native.payload(a[k]).arrays, fl.payload(b[k]).arrays
        row = out[k[0]]
        row[0] += a[k].sha256 == b[k].sha256
        row[1] += 1
        row[2] = max(row[2], max(float((x[n] - y[n]).abs().max()) for n in x))
    return {r: tuple(v) for r, v in out.items()}


def cells(rows, run: str) -> dict:
    return {(r["attack"], r["victim"], r["round"], r["metric"]): float(r["value"]) for r in rows
            if r["run"] == run and r["status"] == "ok" and r["value"] not in ("", "nan")}


def fmt(m, lo, hi, n) -> str:
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]" if n >= 3 else f"{m:.3f} (n={n}: not testable)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("flower", help="run.py's --out (folders fedavg_s<seed>)")
    ap.add_argument("native", help="the native scenario's run folder")
    a = ap.parse_args(argv)
    native_root = Path(a.native)
    native = Ledger.open(native_root)
    runs = json.loads((native_root / "summary.json").read_text())["runs"]
    nat_rows = list(csv.DictReader(open(native_root / "leakage.csv")))
    per_cell = defaultdict(dict)   # cell -> {seed: (native, flower)}
    for r in sorted(runs, key=lambda r: r["seed"]):
        seed, run = r["seed"], r["run"]
        froot = Path(a.flower) / f"fedavg_s{seed}"
        if not (froot / "summary.json").exists():
            print(f"seed {seed}: no recorded Flower run in {froot}")
            continue
        w = compare_weights(froot, native, run)
        same = sum(v[0] for v in w.values())
        total = sum(v[1] for v in w.values())
        worst = {k: v[2] for k, v in w.items()}
        print(f"seed {seed}: weights envelopes same bytes {same}/{total} (round 1: {w[1][0]}/{w[1][1]}); "
              f"max |native - flower| round 2 {worst.get(2, 0):.2e}, round 10 {worst.get(10, 0):.2e}, "
              f"last round {worst[max(worst)]:.2e}")
        if not (froot / "leakage.csv").exists():
            print(f"seed {seed}: {froot} is not attacked yet (python -m fdg_audit attack {froot})")
            continue
        fl_rows = list(csv.DictReader(open(froot / "leakage.csv")))
        x, y = cells(nat_rows, run), cells(fl_rows, run)
        for c in sorted(set(x) & set(y)):
            per_cell[c][seed] = (x[c], y[c])
    print(f"\nleakage cells scored in both (mean over seeds, 95% Student-t; diff = Flower - native, paired by seed):")
    outside = 0
    for c, by in sorted(per_cell.items(), key=lambda kv: (kv[0][0], kv[0][3], kv[0][1], int(kv[0][2]))):
        nat, fl = np.array([v[0] for v in by.values()]), np.array([v[1] for v in by.values()])
        d = t_interval(fl - nat)
        if d[3] >= 3 and not (d[1] <= 0 <= d[2]) and not np.allclose(fl, nat):
            outside += 1
        print(f"  {c[0]} {c[3]} {c[1]} round {c[2]}: native {fmt(*t_interval(nat))}, Flower {fmt(*t_interval(fl))},"
              f" diff {fmt(*d)}, n={d[3]}")
    print(f"\n{len(per_cell)} cells; {outside} with a paired difference whose interval excludes 0 (no Holm correction)")


if __name__ == "__main__":
    main()
