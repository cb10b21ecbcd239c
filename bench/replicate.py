"""Does the verdict replicate? The main job's "distinguishable" claims under another thread count and another seed set.

    python bench/replicate.py [SCENARIO] [--base DIR] [--threads2 DIR] [--seeds DIR] [--out DIR] [--set k=v ...]

Runs the scenario three times (or reuses a finished run folder for any of them: ``--base``, ``--threads2``,
``--seeds``):
  * base:          the scenario as written (seeds 0-4, one torch thread per run);
  * threads = 2:   the same seeds, one run at a time on two torch threads (other floating-point sums);
  * seeds 5-9:     the scenario's thread setting, seeds shifted by the number of seeds (another seed set).
and prints every difference the report tests (the scorecard's same-attack Δ to the reference, and every pair of
methods of comparisons.csv: held-out accuracy and each harm over every channel), with its call and Holm-adjusted p in
each variant, and whether the call held. Calls (fdg_audit/metrics/stats.py): distinguishable (p < 0.01) and not
distinguishable (p >= 0.1 and the interval inside ± the metric's margin) are firm claims; borderline
(0.01 <= p < 0.1), inconclusive (p >= 0.1, the interval reaching a difference that matters) and not testable are not.
A claim "held" when its call is the same in every variant; a firm claim that changed is "FIRM CALL CHANGED" (what the
calls that are not firm exist to prevent); a claim that was not firm in some variant and changed is "not firm"
(allowed). The last line counts the firm calls that held.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fdg_audit.metrics.stats import FIRM_CALLS      # noqa: E402
from fdg_audit.report.scorecard import again        # noqa: E402
from fdg_audit.runner import run_scenario          # noqa: E402
from fdg_audit.scenario import load_raw            # noqa: E402


def claims(root: Path) -> dict:
    """{claim: (call, adjusted p, mean difference)} of one run folder's scorecard.csv (same-attack Δ) and
    comparisons.csv (every pair of methods, whatever the channel)."""
    out = {}
    with open(root / "scorecard.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["diff_call"] and not again(r):   # those are comparisons.csv's rows
                key = (f"{r['dataset']}/{r['method']}{r['variant']} − {r['reference']} (same attack): {r['harm']}"
                       + (f" [{r['setting']}]" if r["setting"] else "") + f" ({r['adversary'] or '—'})")
                out[key] = (r["diff_call"], float(r["diff_p_holm"] or "nan"), float(r["diff_ref"] or "nan"))
    with open(root / "comparisons.csv", newline="") as f:
        for r in csv.DictReader(f):
            key = f"{r['dataset']}: {r['a']} − {r['b']}: {r['harm']}" + (f" [{r['setting']}]" * bool(r["setting"])) \
                + (f" ({r['adversary']})" * bool(r["adversary"]))
            out[key] = (r["call"], float(r["p_holm"] or "nan"), float(r["diff"] or "nan"))
    return out


def held(cells: list) -> str:
    """"yes" (one call in every variant), "not firm" (changed, through a call that is not firm in some variant) or
    "FIRM CALL CHANGED" (changed between firm calls only)."""
    calls = {c[0] for c in cells if c}
    if len(calls) <= 1:
        return "yes"
    return "FIRM CALL CHANGED" if calls <= set(FIRM_CALLS) else "not firm"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?", default=str(ROOT / "scenarios" / "feddg_vs_csac.toml"))
    ap.add_argument("--base", default="", help="a finished run folder of the scenario as written (skips that run)")
    ap.add_argument("--threads2", default="", help="a finished run folder of the threads = 2 variant")
    ap.add_argument("--seeds", default="", help="a finished run folder of the shifted-seeds variant")
    ap.add_argument("--out", default="/tmp/fdg_replicate")
    ap.add_argument("--set", nargs="*", default=[], dest="sets")
    a = ap.parse_args()
    raw = load_raw(a.scenario, a.sets)
    seeds = list(raw.get("seeds", [0]))
    shifted = [s + len(seeds) for s in seeds]
    variants = {"base": [], "threads = 2": ["threads=2", "parallel=1"], f"seeds {shifted[0]}-{shifted[-1]}":
                [f"seeds={shifted}"] + [f"attacks.{e['label'] if 'label' in e else e['name']}.seeds="
                                        f"{[s + len(seeds) for s in e['seeds']]}"
                                        for e in raw.get("attacks", []) if isinstance(e, dict) and e.get("seeds")]}
    roots, given = {}, dict(zip(variants, (a.base, a.threads2, a.seeds)))
    for name, sets in variants.items():
        if given[name]:
            roots[name] = Path(given[name])
            continue
        t = time.perf_counter()
        roots[name] = run_scenario(a.scenario, list(a.sets) + sets, out=str(Path(a.out) / name.replace(" ", "")),
                                   quiet=True)
        print(f"{name}: {roots[name]} ({(time.perf_counter() - t) / 60:.1f} min)", file=sys.stderr)
    got = {name: claims(root) for name, root in roots.items()}
    keys = list(dict.fromkeys(k for c in got.values() for k in c))
    names = list(got)
    print("claim | " + " | ".join(names) + " | held")
    print("|".join(["---"] * (len(names) + 2)))
    count = {"yes": 0, "not firm": 0, "FIRM CALL CHANGED": 0}
    firm_held = []
    for k in keys:
        cells = [got[n].get(k) for n in names]
        verdict = held(cells)
        count[verdict] += 1
        if verdict == "yes" and cells[0] and cells[0][0] in FIRM_CALLS and all(cells):
            firm_held.append(f"{k}: {cells[0][0]}")
        fmt = lambda c: "—" if not c else f"{c[0]} ({c[2]:+.3g}, p {c[1]:.2g})"  # noqa: E731
        print(f"{k} | " + " | ".join(fmt(c) for c in cells) + f" | {verdict}")
    print("\nFirm calls that held in every variant:")
    print("\n".join(f"- {c}" for c in firm_held) or "- none")
    print(f"\n{len(keys)} tested differences: {count['yes']} same call in every variant ({len(firm_held)} firm), "
          f"{count['not firm']} changed through a call that is not firm (allowed), "
          f"{count['FIRM CALL CHANGED']} firm calls "
          "changed (distinguishable <-> not distinguishable).")


if __name__ == "__main__":
    main()
