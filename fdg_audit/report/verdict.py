"""The report's verdict in words, generated from the scorecard rows only (every number it prints is a cell of
scorecard.csv), and the list of which accuracy differences between methods are real."""
from __future__ import annotations

from ..metrics.stats import CALLS_TEXT
from ..metrics.registry import info
from .formatting import ci, md_text, num
from .select import per_channel


def clears(row: dict) -> bool:
    """A scorecard cell whose whole 95% interval lies beyond its baseline's (above it; below for an error metric):
    a leak measured at this budget, not a point estimate that happens to sit past the baseline."""
    if row["harm"] == "accuracy" or row.get("reading") or row.get("control") == "failed":
        return False
    lo, hi, blo, bhi = (num(row.get(k)) for k in ("ci_low", "ci_high", "baseline_ci_low", "baseline_ci_high"))
    b = num(row.get("baseline"))
    blo, bhi = (b, b) if blo != blo else (blo, bhi)
    return lo > bhi if info(row["metric"].split("|")[0]).higher else hi < blo


def _harm(r: dict) -> str:
    """The harm, with the setting of a row an attack reports apart."""
    return r["harm"] + (f" [{r['setting']}]" if r.get("setting") else "")


def _cell(r: dict) -> str:
    return f"{_harm(r)} ({r['adversary']})"


def _pm(r: dict, key: str, d: int, unit: str = "", ci: str = "") -> str:
    """"v [lo, hi]" of one of a row's side numbers (``key`` with ``ci``_ci_low/high when present; ``ci`` defaults to
    ``key`` up to its first "_")."""
    ci = ci or key.split("_")[0]
    v, lo, hi = (num(r.get(k)) for k in (key, f"{ci}_ci_low", f"{ci}_ci_high"))
    return "n/a" if v != v else f"{v:.{d}f}" + ("" if lo != lo else f" [{lo:.{d}f}, {hi:.{d}f}]") + unit


def _recon(r: dict) -> str:
    """A re-identification cell's companions: the same attack's aligned PSNR, shares at >= 20 / >= 25 dB (each with
    the baseline's) and CPU seconds per victim."""
    b = lambda k, d, u="": "" if num(r.get(k)) != num(r.get(k)) else f" (baseline {num(r[k]):.{d}f}{u})"  # noqa
    has = lambda k: r.get(k) not in ("", None)  # noqa: E731
    out = [f"aligned PSNR {_pm(r, 'psnr', 1, ' dB')}{b('baseline_psnr', 1, ' dB')}"] if has("psnr") else []
    out += [f">= {t} dB: {_pm(r, f'success_{t}dB', 2, ci=ci)}{b(f'baseline_success_{t}dB', 2)}"
            for t, ci in (("20", "success_20dB"), ("25", "success")) if has(f"success_{t}dB")]
    if has("cpu_seconds"):
        out.append(f"{num(r['cpu_seconds']):.3g} CPU s per victim")
    return "; ".join(out)


def side(r: dict) -> str:
    """A cell's numbers beside its value, in words: a re-identification cell's PSNR companions (``_recon``); a dB
    cell's share of images at >= 25 dB and median (the PSNR headlines, with the baseline's); a membership cell's pool,
    smallest detectable AUC and TPR at low FPR (n/a where the pool has too few non-members); "" otherwise."""
    if r["harm"] == "reconstruction" and info(r["metric"].split("|")[0]).unit != "dB":
        return _recon(r)
    if r.get("success_25dB") not in ("", None):
        return (f">= 25 dB: {_pm(r, 'success_25dB', 2)} (baseline {num(r['baseline_success_25dB']):.2f}); median "
                f"{_pm(r, 'median', 1, ' dB')} (baseline {num(r['baseline_median']):.1f} dB)")
    if r.get("pool_members") not in ("", None):
        v = lambda k: "n/a" if num(r[k]) != num(r[k]) else f"{num(r[k]):.3f}"  # noqa: E731
        tpr = lambda f: v(f"tpr@{f}fpr") + ("" if v(f"tpr@{f}fpr_ci_low") == "n/a" else  # noqa: E731
                                              f" [{v(f'tpr@{f}fpr_ci_low')}, {v(f'tpr@{f}fpr_ci_high')}]")
        per = "" if not r.get("victims_clear") else (
            f"; per victim AUC median {v('victim_auc_median')} (range {v('victim_auc_min')}-{v('victim_auc_max')}), "
            f"{r['victims_clear']} victims clear their baseline")
        return (f"pool {r['pool_members']} members / {r['pool_nonmembers']} non-members, smallest detectable AUC "
                f"{v('min_auc')}; TPR@1%FPR {tpr('0.01')}, TPR@0.1%FPR {tpr('0.001')}" + per)
    return ""


def _method(rows: list[dict], reference: str, is_ref: bool) -> str:
    """A few sentences on one method's scorecard rows (``reference``: the label its differences are to)."""
    leak = [r for r in rows if r["harm"] != "accuracy"]
    above = [f"{_harm(r)} against the {r['adversary']}: {info(r['metric'].split('|')[0]).label} {ci(r)} vs "
             f"baseline {ci(r, 'baseline')} ({r['attack']} on {r['artifact']}" + (f"; {x}" if (x := side(r)) else "")
             + ")" for r in leak if clears(r)]
    out = ["Measured above baseline (the whole 95% interval beyond the baseline's, no control failed): "
           + "; ".join(above) + "." if above else "No harm is measured above its baseline at these budgets."]
    calls = {c: [r for r in leak if r["diff_call"] == c] for c in ("distinguishable", "borderline",
                                                                   "not distinguishable", "inconclusive")}
    for c, say in (("distinguishable", "Distinguishable from"), ("borderline", "Borderline (not a firm claim) "
                                                                              "against")):
        if calls[c]:
            out.append(f"{say} {reference} (Holm-adjusted): " + "; ".join(
                f"{_cell(r)} Δ {ci(dict(r, diff_call=''), 'diff_ref')} (n = {r['diff_n']}, "
                f"p = {num(r['diff_p_holm']):.3g})" for r in calls[c]) + ".")
    for c, say in (("not distinguishable", "Not distinguishable from"), ("inconclusive", "Inconclusive (neither "
                                                                          "a difference nor its absence) against")):
        if calls[c]:
            out.append(f"{say} {reference}: " + ", ".join(map(_cell, calls[c])) + ".")
    unresolved = [f"{_cell(r)}: not measurable (a control failed)" for r in leak if r["control"] == "failed"]
    clear = [_cell(r) for r in leak if r.get("reading", "").startswith("sent in the clear")]
    if clear:
        out.append("Sent in the clear (the protocol sends the value itself, no attack needed): " + ", ".join(clear)
                   + ".")
    unresolved += [f"{_cell(r)}: {r['reading']}" for r in leak
                   if r.get("reading") and not r["reading"].startswith("sent in the clear")]
    unresolved += [f"{_cell(r)}: its interval reaches the baseline's" for r in leak
                   if r["control"] != "failed" and not r.get("reading") and not clears(r)]
    unresolved += [f"{_cell(r)} against {reference}: not testable (n = {r['diff_n']} paired runs, fewer than 3)"
                   for r in leak if r["diff_call"] == "not testable"]
    unresolved += [f"{_cell(r)} against {reference}: Δ {num(r['diff_ref']):+.3f} not tested (a membership pool is "
                   "not resolvable)" for r in leak if r["diff_call"] == "not resolvable"]
    if unresolved:
        out.append("Not resolved: " + "; ".join(unresolved) + ".")
    for r in (r for r in rows if r["harm"] == "accuracy"):
        cost = f"; Δ {r['reference']} {ci(r, 'diff_ref')}" if r["diff_ref"] not in ("", None) else \
            " (the reference)" if is_ref else ""
        out.append(f"Held-out accuracy {ci(r)}{cost}.")
    return " ".join(out)


def verdict_md(res, card: list[dict]) -> list[str]:
    """The report's first section: per dataset and method, in words, which harms are measured above baseline and
    against which adversary, which differences to the reference method are distinguishable, what could not be
    resolved, and the accuracy cost."""
    ref = res.reference or "the reference"
    md = ["", "## Verdict", "",
          f"From the scorecard below: Δ is the paired difference to {ref} (the scenario's reference method) between "
          "cells of the same attack. " + CALLS_TEXT + " \"No reconstruction at this budget\" is no evidence of "
          "safety at a larger one.", ""]
    for ds in dict.fromkeys(r["dataset"] for r in card):
        md += [f"### {md_text(ds, 120)}", ""] if len({r["dataset"] for r in card}) > 1 else []
        mine = [r for r in card if r["dataset"] == ds and not per_channel(r)]   # its Δ: "Between methods"
        refs = {r["reference"] for r in mine if r["reference"]}
        for m in dict.fromkeys((r["method"], r["variant"]) for r in mine):
            rows = [r for r in mine if (r["method"], r["variant"]) == m]
            name = next((r["reference"] for r in rows if r["reference"]), None) or next(iter(sorted(refs)), ref)
            md.append(f"- **{md_text(''.join(m), 120)}**: "
                      + md_text(_method(rows, name, res.label((ds,) + m) in refs), 20000))
        md.append("")
    return md


def _family(comps: list[dict]) -> int:
    """The size of the Holm family of these comparisons (``compare.between``: one family per harm)."""
    return max((c.get("family_size", 0) for c in comps), default=0)


def differences_md(comps: list[dict]) -> list[str]:
    """Which accuracy differences are real, from ``compare.between`` (the accuracy comparisons: one Holm family)."""
    diffs = [c for c in comps if c["harm"] == "accuracy"]
    if not diffs:
        return []
    md = ["### Which accuracy differences are real", "",
          "Paired by held-out target and seed: the mean over targets of the difference of held-out accuracy, its "
          "95% Student-t interval (stratified by target) and n, the number of paired runs; p is the t-test's "
          f"p-value Holm-adjusted over the {_family(diffs)} accuracy comparisons of this report (the leakage "
          "comparisons, section \"Between methods\", are a family per harm of their own). " + CALLS_TEXT, ""]
    for ds in dict.fromkeys(d["dataset"] for d in diffs):
        rs = [d for d in diffs if d["dataset"] == ds]
        say = lambda call: "; ".join(  # noqa: E731
            f"{d['a']} − {d['b']} = {d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] (n = {d['n']}, "
            f"p = {d['p_holm']:.3g})" if call != "not testable" else f"{d['a']} − {d['b']} (n = {d['n']})"
            for d in rs if d["call"] == call) or "none"
        md += [md_text(f"{ds}: distinguishable: {say('distinguishable')}. Borderline: {say('borderline')}. "
                       f"Not distinguishable: {say('not distinguishable')}. Inconclusive: {say('inconclusive')}."
                       + (f" Not testable: {say('not testable')}." if any(d["call"] == "not testable" for d in rs)
                          else ""), 20000)]
    return md[:4] + [f"- {line}" for line in md[4:]] + [""]
