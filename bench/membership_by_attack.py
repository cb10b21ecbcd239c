"""The membership cells of a run folder attack by attack: the scorecard's cell (AUC against its baseline, the larger
of 0.5 and the blind AUC; TPR at 1% and 0.1% FPR of the calibrated pool with their cluster-bootstrap intervals; the
spread over victims) computed as if each membership attack were the only one, so LiRA and RMIA are read apart from
the strongest-attack cell the report gives.

    python bench/membership_by_attack.py RUN_DIR [RUN_DIR ...]

Prints one Markdown table row per (data set, method, attack, adversary); the report's own cells (the strongest attack)
are in the folder's scorecard.csv.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fdg_audit.report import tables as T          # noqa: E402
from fdg_audit.report.scorecard import scorecard  # noqa: E402


def only(res: T.Results, attack: str) -> T.Results:
    """``res`` with the membership rows, scores and items of every other membership attack left out."""
    keep = lambda r: not str(r.get("attack", "")).startswith("mia_") or r["attack"] == attack  # noqa: E731
    return dataclasses.replace(res, leakage=[r for r in res.leakage if keep(r)], mia=[r for r in res.mia if keep(r)],
                               items=[r for r in res.items if keep(r)], cache={})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+")
    a = ap.parse_args()
    res = T.load(a.run_dirs)
    attacks = sorted({r["attack"] for r in res.leakage if str(r["attack"]).startswith("mia_")})
    iv = lambda r, k: f"{float(r[k]):.3f} [{float(r[k + '_ci_low']):.3f}, {float(r[k + '_ci_high']):.3f}]"  # noqa: E731
    print("| data set | method | attack | adversary | AUC [95% CI] | baseline | TPR@1%FPR [95% CI] | "
          "TPR@0.1%FPR [95% CI] | pool (members / non-members) | per-victim AUC median (range) | victims clear |")
    print("|" + "---|" * 11)
    for name in attacks:
        for r in scorecard(only(res, name)):
            if r["harm"] != "membership" or r["setting"] or r["attack"] != name:
                continue
            tpr = lambda f: iv(r, f"tpr@{f}fpr") if r[f"tpr@{f}fpr"] not in ("", "nan") else "n/a"  # noqa: E731
            print(f"| {r['dataset']} | {r['method']}{r['variant']} | {name} | {r['adversary']} | "
                  f"{float(r['value']):.3f} [{float(r['ci_low']):.3f}, {float(r['ci_high']):.3f}] | "
                  f"{float(r['baseline']):.3f} | {tpr('0.01')} | {tpr('0.001')} | "
                  f"{r['pool_members']} / {r['pool_nonmembers']} | {float(r['victim_auc_median']):.3f} "
                  f"({float(r['victim_auc_min']):.3f}-{float(r['victim_auc_max']):.3f}) | {r['victims_clear']} |")


if __name__ == "__main__":
    main()
