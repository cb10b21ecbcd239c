"""The example's FedAvg recorded through Flower against the same FedAvg run natively, seed by seed (issue 49, item 5).

    python examples/flower_fedavg/run.py --out runs/flower_fedavg --strategies fedavg      # records and attacks
    python -m fdg_audit scenario examples/flower_fedavg/native.toml --out runs/flower_native   # trains and attacks
    python examples/flower_fedavg/equivalence.py runs/flower_fedavg runs/flower_native/flower_fedavg_native/<time>

Weights: for each seed (its own data draw) and round, the largest absolute difference between the native and the
Flower payload of every (sender, receiver) weights envelope, and how many are the same bytes. Leakage: every cell
(attack, victim, round, metric) both folders scored, its mean over seeds in each with a 95% Student-t interval, and
the paired difference (Flower - native) with its interval, its call Holm-adjusted over the cells, and whether each
mean lies inside the other's interval; intervals are cut to the metric's range; n is printed (below 3 seeds: not
testable). Cost rows (CPU seconds, iterations) are not leakage cells and are left out. A seed
whose Flower folder is missing or not attacked yet is said and left out.
"""
from __future__ import annotations

import argparse
import csv
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from fdg_audit.metrics import stats as S
from fdg_audit.metrics.registry import METRICS, info
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
    print("\nleakage cells scored in both (mean over seeds, 95% Student-t cut to the metric's range; diff = Flower - "
          "native, paired by seed, Holm over every cell's difference):")
    keys = sorted((c for c in per_cell if c[3] in METRICS and info(c[3]).harm != "none"),
                  key=lambda c: (c[0], c[3], c[1], int(c[2])))
    diffs = S.holm_calls([S.compare([f - n for n, f in per_cell[c].values()], metric=c[3]) for c in keys])
    within = 0
    for c, d in zip(keys, diffs):
        mi, by = info(c[3]), per_cell[c]
        nat, fl = [cut(S.t_interval([v[i] for v in by.values()]), mi.lo, mi.hi) for i in (0, 1)]
        agree = nat[1] <= fl[0] <= nat[2] and fl[1] <= nat[0] <= fl[2]
        within += agree
        print(f"  {c[0]} {c[3]} {c[1]} round {c[2]}: native {fmt(*nat)}, Flower {fmt(*fl)}, diff "
              f"{fmt(*cut((d['mean'], d['lo'], d['hi'], d['n']), mi.lo - mi.hi, mi.hi - mi.lo))} (n = {d['n']}, "
              f"{d['call']}){'' if agree else ', a mean outside the other interval'}")
    calls = Counter(d["call"] for d in diffs)
    print(f"\n{len(keys)} cells; each mean inside the other's interval in {within}; calls after Holm: "
          + ", ".join(f"{k} {v}" for k, v in sorted(calls.items())))


def cut(t: tuple, lo: float, hi: float) -> tuple:
    """(mean, low, high, n) with the interval cut to [lo, hi] (metrics stay in their range)."""
    return (t[0], max(t[1], lo), min(t[2], hi), t[3])


if __name__ == "__main__":
    main()
