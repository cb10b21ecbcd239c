"""How many paired runs does an accuracy comparison need? The measured paired SD per family, and the n it implies.

    python bench/accuracy_power.py RUN_FOLDER [RUN_FOLDER ...] [--margin 0.02]

Reads summary.json of each finished run folder (the main job's, or any scenario with a reference method), pairs
each method's run with the reference's run of the same folder, data set, held-out target and seed (the pairing the
report uses), and prints per data set and method: n paired runs, the mean paired difference in held-out accuracy
with its 95% Student-t interval, the SD of the differences (over all folders, and the range of the per-folder SDs),
the t-test p Holm-adjusted over the printed comparisons, and the
smallest n whose 95% interval's half-width t(n-1) * SD / sqrt(n) is at most the margin (0.02: the accuracy margin
of fdg_audit/metrics/registry.py). Folders of one scenario are independent draws when each seed draws its own
data (the default), so pooling them adds runs; a family whose runs hold out a single target measures the seed-to-seed
spread only, not the spread between targets.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fdg_audit.metrics.stats import holm, t_interval, t_test_p      # noqa: E402


def paired(folders: list[Path]) -> dict:
    """{(dataset, method, reference): [(folder index, target, seed, difference)]} over the folders' ok runs."""
    out = defaultdict(list)
    for i, folder in enumerate(folders):
        s = json.loads((folder / "summary.json").read_text())
        ref = s.get("reference") or "fedavg"
        acc = {(r["dataset"], r["method"], r["target"], r["seed"]): r["target_acc"]
               for r in s["runs"] if r["status"] == "ok" and r.get("target_acc") is not None}
        for (d, m, t, seed), a in sorted(acc.items()):
            if m != ref and (d, ref, t, seed) in acc:
                out[(d, m, ref)].append((i, t, seed, a - acc[(d, ref, t, seed)]))
    return out


def n_needed(sd: float, margin: float) -> int | None:
    """The smallest n >= 3 with t(0.975, n-1) * sd / sqrt(n) <= margin (None above 10,000)."""
    from scipy.stats import t
    for n in range(3, 10_001):
        if t.ppf(0.975, n - 1) * sd / math.sqrt(n) <= margin:
            return n
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--margin", type=float, default=0.02)
    a = ap.parse_args(argv)
    bad = [f for f in a.folders if not (f / "summary.json").is_file()]
    if bad:
        sys.exit(f"error: {bad[0]} has no summary.json; give finished run folders (runs/<scenario>/<timestamp>)")
    print(f"{len(a.folders)} run folder(s); margin ±{a.margin}")
    print(f"{'data set':<15} {'method − ref':<16} {'n':>3} {'mean [95% CI]':<28} {'SD':>6} {'per-folder SD':<14} "
          f"{'targets':>7} {'p Holm':>7} {'n for ±' + str(a.margin):>10}")
    pairs = sorted(paired(a.folders).items())
    p_holm = holm([t_test_p(np.array([r[3] for r in rows])) for _, rows in pairs])
    for ((d, m, ref), rows), p in zip(pairs, p_holm):
        diffs = np.array([r[3] for r in rows])
        mean, lo, hi, n = t_interval(diffs)
        sd = float(np.std(diffs, ddof=1)) if n > 1 else math.nan
        per = [np.std([r[3] for r in rows if r[0] == i], ddof=1) for i in sorted({r[0] for r in rows})
               if sum(r[0] == i for r in rows) > 1]
        span = f"{min(per):.3f}-{max(per):.3f}" if per else "—"
        need = n_needed(sd, a.margin) if sd == sd else None
        print(f"{d:<15} {m + ' − ' + ref:<16} {n:>3} {f'{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]':<28} {sd:>6.3f} "
              f"{span:<14} {len({r[1] for r in rows}):>7} {p:>7.4f} {need if need else '>10000':>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
