"""Reports: ``write_report(run_dirs, out)`` -> scorecard.csv and report.md (the scorecard first) with PNGs in
``out/plots/`` (relative links, so the folder can be copied), and ``headline(root)`` -> the compact scorecard a
scenario prints at the end. The scorecard's definitions (held-out selection, intervals, paired differences) are in
``scorecard``; the verdict in words is ``verdict``; bytes on the bus are ``traffic``.

Inputs: the run folders' files as fdg_audit.store.runfolder reads them (summary.json, messages.jsonl, and when present
leakage.csv, controls.json, attacks.json, privacy.csv, per-item values, membership scores and reconstruction grids).
Absent inputs skip their section. Definitions (groups, mean ± std, "strongest", ε per run) are in ``tables``;
metric units, directions, ranges and harms in fdg_audit/metrics/registry.py.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from ..store.ledger import atomic_write
from ..store.safe import entries
from ..metrics.registry import HARMS, card_metrics, info
from ..metrics import stats as S
from ..metrics.stats import CALLS_TEXT
from . import compare as CMP
from . import curves as CV
from . import plots as P
from . import scorecard as SC
from . import tables as T
from .dp import dp_section
from .html import write_html
from .pageone import page_one_md, page_one_text
from .formatting import ci, clean, fmt, fmt_metric, md_table, md_text, num, slug, text_table
from .traffic import bytes_lines, bytes_md, bytes_table
from .threat import legend_md
from .tradeoff import tradeoff
from .verdict import clears, differences_md, side, verdict_md

__all__ = ["write_report", "headline", "clears"]


def headline(root) -> str:
    """The scenario's terminal summary: the scorecard, compact (one row per method, one column per harm: the
    held-out strongest attack's value vs its baseline, with the adversary), then bytes on the bus."""
    res = T.load([root])
    card = SC.scorecard(res)
    by = bytes_table(res.envelopes, res.ok)
    harms = [h for h in ("accuracy",) + HARMS if any(r["harm"] == h for r in card)]
    rows = []
    for g in res.groups():
        mine = [r for r in card if (r["dataset"], r["method"], r["variant"]) == g and not SC.again(r)]
        cells = []
        for h in harms:
            rs = [r for r in mine if r["harm"] == h]
            if h == "accuracy":
                cells.append("\n".join(f"{ci(r)}" + (f"\nΔ {ci(r, 'diff_ref')}" if r["diff_ref"] else "")
                                       for r in rs) or "—")
            else:
                cells.append("\n".join(_short(r) for r in rs) or "—")
        eps = next((r["epsilon"] for r in mine), "inf")
        rows.append([res.label(g)] + cells + [eps, f"{by[g]['total'] / 1e6:.2f}" if g in by else "—"])
    names = {h: info(card_metrics(h)[-1]).label for h in harms if h != "accuracy"}
    names["accuracy"] = "held-out acc [95% CI]"
    out = ["privacy scorecard (scorecard.csv): value [95% CI] vs trivial baseline; strongest attack output "
           "cross-fitted on halves of the items; Δ: paired difference to "
           f"{res.reference or 'the reference (none recorded)'}",
           text_table(["method"] + [names[h] for h in harms] + ["ε", "MB/run"], rows)]
    if T.adaptation_note(res):
        out.append(T.adaptation_note(res))
    failed = [r["run"] for r in res.runs if r.get("status") != "ok"]
    if failed:
        out.append(f"failed runs ({len(failed)}): " + ", ".join(failed))
    if by:
        out += ["", "bytes on the bus by artifact kind (↑ client→server, ↓ server→client), mean per run:"]
        out += bytes_lines(res, by)
    figs = [f for f in entries(root, "plots") if f.startswith("tradeoff_") and f.endswith(".png")]
    out.append(page_one_text(res, card, CMP.between(res, card), CV.by_size(res), by, figs))
    return "\n".join(out)


def _short(r: dict) -> str:
    """One leakage cell in the terminal: adversary (and setting), value vs baseline, the reading; a re-identification
    cell's aligned PSNR (vs its baseline) and share at >= 20 dB, a dB cell's share at >= 25 dB and median, a
    membership cell's pool."""
    out = f"{r['adversary'][:6]}" + (f" [{r['setting']}]" if r.get("setting") else "") + \
        f": {ci(r)} vs {ci(r, 'baseline')}" + (f" ({r['reading'].split(':')[0]})" if r.get("reading") else "")
    if r.get("psnr"):    # a re-identification cell: the same attack's aligned PSNR beside it
        out += (f"\n  PSNR {num(r['psnr']):.1f} vs {num(r['baseline_psnr']):.1f} dB, >=20 dB "
                f"{num(r['success_20dB']):.2f}")
    elif r.get("success_25dB") and r.get("median"):
        out += f"\n  >=25 dB {num(r['success_25dB']):.2f}, median {num(r['median']):.1f} dB"
    if r.get("pool_members") not in ("", None):
        out += f"\n  pool {r['pool_members']}/{r['pool_nonmembers']}"
    return out


# ------------------------------------------------------------------------------------------- report.md

def _img(name: str, alt: str) -> str:
    return f"![{alt}](plots/{name})"


def _converged(row: dict) -> str:
    """The accuracy table's converged cell: runs selected before their last 10% of rounds, and the late rise."""
    up, n, p = row["rising"]
    cell = f"{row['converged']}/{row['runs']}" + ("" if row["converged"] == row["runs"] else " NOT CONVERGED")
    if not n:
        return cell
    if p != p:
        return cell + f"; rising at the end {up}/{n} (not testable below {S.MIN_RUNS} runs)"
    return cell + f"; rising at the end {up}/{n} (p {p:.2g})" + (": NOT CONVERGED" if T.still_rising(row) else "")


def _accuracy_md(res, acc, files) -> list[str]:
    keys = T.sweep_keys(res)
    ref = res.published.get("values", {})
    md = ["## Held-out accuracy", "",
          "Accuracy on the held-out (unseen) domain at the round selected on the pooled source-validation "
          "splits (the earliest round within one standard error of the best; fdg_audit.train.federation.select_round). "
          "Per target: mean ± sample std over seeds; mean over targets: per seed the mean over targets, then mean ± "
          "std over seeds; [95% CI]: Student-t over the runs, stratified by target, with n runs. converged: runs "
          "whose selected round is before the last 10% of their rounds (a late selected round means still "
          "improving: NOT CONVERGED); then the runs whose source-validation accuracy is higher over their last 10% "
          "of evaluated rounds than over as many before, and the one-sided sign-flip p-value (exact up to 16 runs; "
          "Holm over the rows; n runs cannot go below 2^-n) that the group's gains are positive: below 0.05 the group "
          "is still rising (NOT CONVERGED) whatever round the one-SE rule selected. Chance is 1/classes.", ""]
    if ref:
        md += [md_text(f"Reference: {res.published.get('source', '')}"), ""]
    if T.adaptation_note(res):
        md += [md_text(T.adaptation_note(res) + "."), ""]
    for ds in dict.fromkeys(r["dataset"] for r in acc):
        rows = [r for r in acc if r["dataset"] == ds]
        targets = list(dict.fromkeys(t for r in rows for t in r["targets"]))
        head = ["method"] + [k.split(".")[-1] for k in keys] + targets + ["mean over targets", "[95% CI] (n)",
                                                                        "seeds", "converged"] + \
            (["reference"] if ref else [])
        body = [[r["method"] + ("" if keys else r["variant"]) + (f" ({T.ADAPTATION})" if r.get("adaptation") else "")]
                + [r["sweep"].get(k, "") for k in keys]
                + [fmt(r["targets"].get(t, T.stat([]))) for t in targets]
                + [fmt(r["mean"]) + (f" (seeds {r['incomplete']} lack a target)" if r["incomplete"] else ""),
                   f"[{r['ci'][1]:.3f}, {r['ci'][2]:.3f}] ({r['ci'][3]})" if r["ci"][1] == r["ci"][1] else
                   f"({r['ci'][3]})", len(r["seeds"]),
                   _converged(r)]
                + ([f"{ref[r['method']]:.4g}" if r["method"] in ref else "—"] if ref else []) for r in rows]
        md += [f"### {md_text(ds, 120)}", "", md_table(head, body), ""]
        extra = [(r, k, v) for r in rows for k, v in r["extra"].items()]
        if extra:   # what a method measures itself (e.g. personalised models on their clients' validation splits)
            md += ["Reported by the method itself at the selected round (the server's extra_metrics: e.g. "
                   "personal_acc, each client's personalised model on its own validation split, mean over clients), "
                   "mean ± std over runs [95% Student-t CI] (n):", "",
                   md_table(["method", "metric", "value", "[95% CI] (n)"],
                            [[r["method"] + r["variant"], k, fmt(st),
                              f"[{ci[1]:.3f}, {ci[2]:.3f}] ({ci[3]})" if ci[1] == ci[1] else f"({ci[3]})"]
                             for r, k, (st, ci) in extra]), ""]
        md += [_img(f, f"accuracy {ds}") for f in files if f.startswith(f"accuracy_{slug(ds)}.") or
               f.startswith(f"sweep_{slug(ds)}_")] + [""]
    return md


def _leakage_md(res, leak, controls) -> list[str]:
    if not leak:
        return ["## Leakage", "", "No leakage.csv in these run folders (no attacks ran).", ""]
    md = ["## Leakage", "",
          "Every attack output, for reference: per method, attack, artifact and metric, for each run the strongest "
          "value over victims and rounds (largest; smallest for error metrics; this maximum is biased upwards, the "
          "scorecard's held-out value is the one to compare), then mean ± std over runs (targets × seeds); "
          "\"strongest run\" is the strongest of those runs. Baseline: the attack's trivial baseline on the same "
          "rows (mean image, chance, prior), averaged the same way (domain rows: chance, a guesser that does not know "
          "the victim; the scorecard's domain baseline is the victim's own domain, which its client name gives). A "
          "failed positive control makes the numbers \"not measurable\".", ""]
    outputs = any(r["output"] not in ("", "main") for r in leak)
    terms = any(r["top"].get("alignment") for r in leak)   # how a reconstruction row was scored (leakage.csv)
    head = ["method", "attack", "adversary", "artifact"] + (["output"] if outputs else []) + \
        ["metric", "strongest (mean ± std over runs)", "baseline", "Δ vs baseline", "strongest run (target/seed, "
         "victim, round)", "status", "runs"] + (["alignment; baseline; plateau; distractors"] if terms else [])
    body = []
    order = {g: i for i, g in enumerate(res.groups())}
    for r in sorted(leak, key=lambda r: order.get(r["key"], 0)):
        top = r["top"]
        unit = " dB" if info(r["metric"]).unit == "dB" else ""
        d = r["value"]["mean"] - r["baseline"]["mean"]
        where = "—" if math.isnan(top["value"]) else \
            f"{top['value']:.3g}{unit} ({top['target']}/s{top['seed']}, {top['victim']}, r{top['round']})"
        body.append([res.label(r["key"]), r["attack"], r["adversary"], r["artifact"]]
                    + ([r["output"]] if outputs else [])
                    + [r["metric"], fmt_metric(r["metric"], r["value"]) if r["value"]["n"] else
                       "n/a (not resolvable)" if r["metric"].startswith("tpr@") else "—",
                       fmt(r["baseline"], 1 if unit else 3), "—" if math.isnan(d) else f"{d:+.{1 if unit else 3}f}",
                       where, r["status"], r["runs"]]
                    + (["; ".join(str(r["top"].get(k) or "—") for k in ("alignment", "baseline_kind", "plateau",
                                                                          "n_distractors"))] if terms else []))
    md += [md_table(head, body), ""]
    if res.attack_notes:
        count = {}
        for n in res.attack_notes:
            k = (n["attack"], n.get("status", ""))
            count[k] = count.get(k, 0) + 1
        md += ["Attack outputs without a number:", ""] + [f"- {md_text(a, 200)}: {md_text(st)} ({c}×)"
                                                         for (a, st), c in count.items()] + [""]
    if controls:
        md += ["### Controls", "", "Positive controls must reach the threshold; negative controls must stay at or "
               "below it (chance).", "",
               md_table(["attack", "control", "kind", "metric", "value", "threshold", "passed"],
                        [[c["attack"], c["name"], "positive" if c.get("positive", True) else "negative", c["metric"],
                          f"{c['value']:.3g}", f"{c['threshold']:.3g}", "yes" if c["passed"] else "NO"]
                         for c in controls]), ""]
    md += ["### Metrics", ""] + [f"- `{m}`: {info(m).text}" + (f" ({info(m).unit})" if info(m).unit else "")
                                 + ("; lower = stronger attack" if not info(m).higher else "")
                                 for m in dict.fromkeys(r["metric"] for r in leak)] + [""]
    return md


def _conv(c) -> str:
    """"5/5", or "3/5 NOT CONVERGED" when some of a cell's runs selected a round in their last 10%."""
    if not c:
        return "—"
    done, n = c.split("/")
    return c if done == n else f"{c} NOT CONVERGED"


def _scorecard_md(res, card) -> list[str]:
    ref = res.reference or "reference"
    md = ["## Privacy scorecard", "",
          "One row per method, harm (and setting: with fixed client sizes, one per size) and adversary "
          "(scorecard.csv). **value**: the attack output (attack × artifact × variant × round, over every victim) "
          "strongest on one half of the images/candidates of all runs scores the other half, and the reverse "
          "(selection \"crossfit\"; \"single\" when there is one candidate); per run (held-out target × seed) the "
          "mean over its items, then the mean over runs. **baseline**: the chosen outputs' own trivial attack (mean "
          "or flat image, chance, the known victim's domain) on the same items. Brackets: 95% Student-t interval "
          "over the runs' values (one run: the bootstrap over its items; fdg_audit/metrics/stats.py). "
          f"**Δ {ref}**: this cell minus the cell of the scenario's reference method ({ref}; column `reference` of "
          "scorecard.csv), paired by target and seed: the leakage (or accuracy) a method adds beyond the reference, "
          "with n paired runs and the call on its t-test p-value Holm-adjusted over every Δ of the scorecard ("
          + CALLS_TEXT + "); only between cells of the same "
          "attack, prior and budget (columns prior, budget) that both beat their baselines. A value that does not "
          "beat its own baseline reads \"no reconstruction at "
          "this budget\" (or \"not above baseline\"; \"vacuous\" when the baseline is already perfect, e.g. a "
          "victim's domain that its client name gives). PSNR is capped at 60 dB (8-bit precision reaches 58.9 dB) and "
          "intervals are cut to each metric's range (a Δ's to the range of a difference: ±1 for AUC, re-identification "
          "and accuracy). **also**: for PSNR the headlines, the share of held-out images "
          "at >= 25 dB and the median PSNR (the baseline's in brackets); for membership the pool of calibrated "
          "held-out scores over victims and runs (within-model quantiles), its smallest detectable AUC (one-sided "
          "test against 0.5, alpha 0.05, power 0.8, Hanley-McNeil variance) and TPR at 1% / 0.1% FPR where the pool "
          "has >= 100 / >= 1000 non-members; below 500 members or non-members a cell is \"not resolvable\" and its "
          "Δ is not tested. **[any channel]**: per harm, adversary and method, the main cell again (the strongest "
          "attack over every channel the method sends; the channel in column attack (artifact)) with its Δ to "
          f"{ref} whatever the attack and channel: the comparison of \"Between methods\" (comparisons.csv), paired by "
          "target and seed, Holm-adjusted over those comparisons. For a re-identification cell, **also** gives the "
          "same chosen attack's aligned PSNR, its shares of held-out images at >= 20 dB and >= 25 dB (each with the "
          "baseline's, on the same runs, victims and images) and the CPU seconds it spent per victim. "
          "The chosen attack's threat model (prior, budget, what the attacker knows and assumes; "
          "oracle outputs are never the headline, see the per-victim table) is stated once per attack in \"Attacks "
          "and their threat models\"; differences across attacks and channels are in \"Between methods\". A harm "
          "in [brackets] names a setting an attack reports in a row of its own, or an artifact sent outside "
          "every DP mechanism of its run (its own row, at its own ε). "
          "**converged**: runs whose selected round is before the last "
          "10% of their rounds, of all runs. "
          "**control**: the attacks' positive/negative controls (failed: \"not measurable\", never \"no leak\").", ""]
    for ds in dict.fromkeys(r["dataset"] for r in card):
        body = [[r["method"] + r["variant"], r["harm"] + (f" [{r['setting']}]" if r.get("setting") else ""),
                 r["adversary"] or "—", r["metric"], ci(r) + (f" ({r['reading']})" if r.get("reading") and not
                                                              SC.again(r) else ""),
                 ci(r, "baseline"), ci(r, "diff_ref"), "as the row above" if SC.again(r) else side(r) or "—",
                 f"{r['attack']} ({r['artifact']})" if r["attack"] else "—", r["control"],
                 r["selection"] or "—", f"{r['n_runs']}" + (f" / {r['n_items']}" if r["n_items"] != "" else ""),
                 r["epsilon"], _conv(r.get("converged"))]
                for r in card if r["dataset"] == ds]
        md += [f"### {md_text(ds, 120)}", "", md_table(["method", "harm", "adversary", "metric", "value [95% CI]",
                                          "baseline [95% CI]", f"Δ {ref} [95% CI]", "also", "attack (artifact)",
                                          "control", "selection",
                                          "runs / items", "ε", "converged"], body), ""]
    return md


def _tradeoff_md(res, files) -> list[str]:
    if not files:
        return []
    md = ["## Accuracy against leakage", "",
          "One figure per dataset family, one panel per harm (reconstruction, membership): each method at its "
          "held-out accuracy (y) and its scorecard cell (x: the strongest attack over every channel it sends, held-out "
          "choice), 95% Student-t intervals both ways, labelled with the channel that leaks; one colour per method "
          "in every figure; the grey bar on each point's row is that cell's trivial baseline.", ""]
    for ds, f in files:
        md += [f"### {md_text(ds, 120)}", "", _img(f, f"accuracy against leakage, {ds}"), ""]
    return md


def _privacy_md(res, acc, eps, files) -> list[str]:
    if not eps:
        return []
    accs = {r["key"]: r for r in acc}
    body = [[res.label(g), fmt(e["epsilon"], 2), f"{e['delta']:.0e}", fmt(accs[g]["mean"]) if g in accs else "—"]
            for g, e in eps.items()]
    return ["## Differential privacy", "", "ε: per run the largest ε in privacy.csv (spent by the end of "
            "training), mean ± std over runs.", "", md_table(["method", "ε", "δ", "held-out accuracy"], body), ""] + \
        [_img(f, "epsilon vs accuracy") for f in files] + [""]


def _csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue(), path.parent)


def _runs_md(res, run_dirs, runs_md) -> list[str]:
    failed = [r for r in res.runs if r.get("status") != "ok"]
    md = ["## Runs", "", md_text(f"Run folders: {', '.join(str(r) for r in res.roots)}. Runs: {len(res.ok)} finished"
                                 + (f", {len(failed)} failed" if failed else "") + "."), ""]
    md += [clean(line, 20000) for line in runs_md]   # ledger.status_lines: run ids in code spans, shown as they are
    code = lambda x: "`" + clean(x, 200).replace("`", "'") + "`"  # noqa: E731  (a code span shows text as it is)
    md += [f"- failed: {code(r['run'])}: {md_text(r.get('error', ''), 2000)}" for r in failed]
    return md + [f"- note: {md_text(n, 2000)}" for n in res.notes] + [""]


def _figures_md(roc_files, rec_files) -> list[str]:
    md = []
    if roc_files:
        md += ["## Membership inference ROC", "", "Log-log ROC per attack, scores pooled over each method's runs and "
               "victims: per method its strongest output variant (at most 6 curves), AUC and TPR at 1% and 0.1% FPR "
               "in the legend; the dashed grey diagonal is random guessing.", ""] + \
            [_img(f, "ROC") for f in roc_files] + [""]
    if rec_files:
        md += ["## Reconstructions", "", "Row 1: the victim's images; row 2: the attack's reconstructions as "
               "returned (scored after alignment: a shifted or flipped image can score high); row 3: the attack's "
               "trivial baseline. One example run and victim per method and attack variant, a few per page.", ""] + \
            [_img(f, "reconstructions") for f in rec_files] + [""]
    return md


def write_report(run_dirs, out, quiet: bool = False) -> Path:
    """Aggregate run folders into ``out/report.md`` (page one, then details under headings) and ``out/report.html``
    (the same, one self-contained file) with figures in ``out/plots/``, scorecard.csv and comparisons.csv; returns
    report.md."""
    from ..store.ledger import status_lines
    out = Path(out)
    plots = out / "plots"
    runs_md = status_lines(run_dirs)   # checks each folder first: damage is one line, not a traceback
    res = T.load(run_dirs)
    acc, leak, eps = T.accuracy_table(res), T.leakage_table(res), T.privacy_table(res)
    by = bytes_table(res.envelopes, res.ok)
    card = SC.scorecard(res)
    comps = CMP.between(res, card)
    _csv(out / "scorecard.csv", SC.FIELDS, card)
    _csv(out / "comparisons.csv", CMP.FIELDS, CMP.csv_rows(comps))
    acc_files = P.accuracy(res, acc, plots) + P.sweep(res, acc, plots)
    curve = CV.by_size(res)
    trade_files = tradeoff(res, card, plots, curve)
    byte_files = P.bytes_per_round(res, by, plots)
    eps_files = P.privacy(res, acc, eps, plots)
    roc_files, rec_files = P.roc(res, plots), P.recon(res, plots)
    curve_files = P.size_curve(res, curve, plots)
    md = [f"# fdg_audit report: {md_text(', '.join(dict.fromkeys(res.scenarios)), 200)}", ""]
    md += page_one_md(res, card, comps, curve, by, [f for _, f in trade_files])
    md += _scorecard_md(res, card) + CMP.between_md(comps) + legend_md(res) + verdict_md(res, card)
    md += differences_md(comps) + CV.domain_md(res, CV.per_domain(res)) + CV.curve_md(res, curve, curve_files)
    md += _tradeoff_md(res, trade_files) + _runs_md(res, run_dirs, runs_md)
    md += _accuracy_md(res, acc, acc_files) + _leakage_md(res, leak, res.controls)
    md += bytes_md(res, by, [_img(f, "bytes per run") for f in byte_files]) + _privacy_md(res, acc, eps, eps_files)
    md += dp_section(card, res.ok, res.privacy, plots, res.envelopes)   # accuracy and each harm against ε
    md += _figures_md(roc_files, rec_files)
    path = out / "report.md"
    atomic_write(path, "\n".join(md), out)
    write_html(md, out)
    return path
