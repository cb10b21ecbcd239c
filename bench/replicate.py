"""Does the verdict replicate? The main job's "distinguishable" claims under another thread count and another seed set.

    python bench/replicate.py [SCENARIO] [--base DIR] [--threads2 DIR] [--seeds DIR] [--out DIR] [--set k=v ...]

Runs the scenario three times (or reuses a finished run folder for any of them: ``--base``, ``--threads2``,
``--seeds``):
  * base:          the scenario as written (seeds 0-4, one torch thread per run);
  * threads = 2:   the same seeds, one run at a time on two torch threads (other floating-point sums);
  * seeds 5-9:     the scenario's thread setting, seeds shifted by the number of seeds (another seed set).
and prints every difference the scorecard tests (accuracy and leakage, Δ to FedAvg, and every accuracy pair of
the report), with its call and Holm-adjusted p in each variant, and whether the call held. A claim is "on the
boundary" when its adjusted p lies between 0.01 and 0.2 in some variant: a change of call there is what an
interval near zero does under any perturbation, and is reported apart from a real flip.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fdg_audit.report import scorecard as SC      # noqa: E402
from fdg_audit.report import tables as T          # noqa: E402
from fdg_audit.runner import run_scenario          # noqa: E402
from fdg_audit.scenario import load_raw            # noqa: E402

BOUNDARY = (0.01, 0.2)


def claims(root: Path) -> dict:
    """{claim: (call, adjusted p, mean difference)} of one run folder's scorecard.csv and accuracy pairs."""
    out = {}
    with open(root / "scorecard.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["diff_call"]:
                key = f"{r['dataset']}/{r['method']}{r['variant']} − fedavg: {r['harm']} ({r['adversary'] or '—'})"
                out[key] = (r["diff_call"], float(r["diff_p_holm"] or "nan"), float(r["diff_ref"] or "nan"))
    for d in SC.accuracy_differences(T.load([root])):
        out[f"{d['dataset']}: accuracy {d['a']} − {d['b']}"] = (d["call"], d["p_holm"], d["diff"])
    return out


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
    held = flips = boundary = 0
    for k in keys:
        cells = [got[n].get(k) for n in names]
        calls = {c[0] for c in cells if c}
        ps = [c[1] for c in cells if c and c[1] == c[1]]
        on_edge = any(BOUNDARY[0] <= p <= BOUNDARY[1] for p in ps)
        verdict = "yes" if len(calls) == 1 else "boundary" if on_edge else "NO"
        held += verdict == "yes"
        flips += verdict == "NO"
        boundary += verdict == "boundary"
        fmt = lambda c: "—" if not c else f"{c[0]} ({c[2]:+.3g}, p {c[1]:.2g})"  # noqa: E731
        print(f"{k} | " + " | ".join(fmt(c) for c in cells) + f" | {verdict}")
    yes = {n: sum(c[0] == "distinguishable" for c in got[n].values()) for n in names}
    print(f"\n{len(keys)} tested differences: {held} same call in every variant, {boundary} changed on the boundary "
          f"(adjusted p in [{BOUNDARY[0]}, {BOUNDARY[1]}]), {flips} changed off it. Distinguishable claims per "
          f"variant: " + ", ".join(f"{n}: {v}" for n, v in yes.items()))


if __name__ == "__main__":
    main()
