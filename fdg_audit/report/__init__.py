"""Reports: ``write_report(run_dirs, out)`` -> scorecard.csv and report.md (the scorecard first) with PNGs in
``out/plots/`` (relative links, so the folder can be copied), and ``headline(root)`` -> the compact scorecard a
scenario prints at the end. The scorecard's definitions (held-out selection, intervals, paired differences) are in
``scorecard``; the verdict in words is ``verdict``; bytes on the bus are ``traffic``.

Inputs: the run folders' files as fdg_audit.runfolder reads them (summary.json, messages.jsonl, and when present
leakage.csv, controls.json, attacks.json, privacy.csv, per-item values, membership scores and reconstruction grids).
Absent inputs skip their section. Definitions (groups, mean ± std, "strongest", ε per run) are in ``tables``;
metric units, directions, ranges and harms in fdg_audit/metrics/registry.py.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from ..ledger import atomic_write
from ..metrics.registry import HARMS, card_metrics, info
from ..runfolder import victim_tag
from . import curves as CV
from . import plots as P
from . import scorecard as SC
from . import tables as T
from .dp import dp_section
from .formatting import ci, fmt, fmt_metric, md_table, num, slug, text_table
from .traffic import bytes_lines, bytes_md, bytes_table
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
        mine = [r for r in card if (r["dataset"], r["method"], r["variant"]) == g]
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
    out = ["privacy scorecard (scorecard.csv): value [95% CI] vs trivial baseline; strongest victim/round chosen "
           f"on held-out halves; Δ: paired difference to {res.reference or 'the reference (none recorded)'}",
           text_table(["method"] + [names[h] for h in harms] + ["ε", "MB/run"], rows)]
    if T.adaptation_note(res):
        out.append(T.adaptation_note(res))
    failed = [r["run"] for r in res.runs if r.get("status") != "ok"]
    if failed:
        out.append(f"failed runs ({len(failed)}): " + ", ".join(failed))
    if by:
        out += ["", "bytes on the bus by artifact kind (↑ client→server, ↓ server→client), mean per run:"]
        out += bytes_lines(res, by)
    return "\n".join(out)


def _short(r: dict) -> str:
    """One leakage cell in the terminal: adversary (and setting), value vs baseline, the reading; a dB cell's share at
    >= 25 dB and median, a membership cell's pool."""
    out = f"{r['adversary'][:6]}" + (f" [{r['setting']}]" if r.get("setting") else "") + \
        f": {ci(r)} vs {ci(r, 'baseline')}" + (f" ({r['reading'].split(':')[0]})" if r.get("reading") else "")
    if r.get("success_25dB"):
        out += f"\n  >=25 dB {num(r['success_25dB']):.2f}, median {num(r['median']):.1f} dB"
    if r.get("pool_members") not in ("", None):
        out += f"\n  pool {r['pool_members']}/{r['pool_nonmembers']}"
    return out


# ------------------------------------------------------------------------------------------- report.md

def _img(name: str, alt: str) -> str:
    return f"![{alt}](plots/{name})"


def _accuracy_md(res, acc, files) -> list[str]:
    keys = T.sweep_keys(res)
    ref = res.published.get("values", {})
    md = ["## Held-out accuracy", "",
          "Accuracy on the held-out (unseen) domain at the round selected on the pooled source-validation "
          "splits (the earliest round within one standard error of the best; fdg_audit.federation.select_round). "
          "Per target: mean ± sample std over seeds; mean over targets: per seed the mean over targets, then mean ± "
          "std over seeds; [95% CI]: Student-t over the runs, stratified by target, with n runs. converged: runs "
          "whose selected round is before the last 10% of their rounds (a late selected round means still "
          "improving: NOT CONVERGED). Chance is 1/classes.", ""]
    if ref:
        md += [f"Reference: {res.published.get('source', '')}", ""]
    if T.adaptation_note(res):
        md += [T.adaptation_note(res) + ".", ""]
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
                   f"{r['converged']}/{r['runs']}" + ("" if r["converged"] == r["runs"] else " NOT CONVERGED")]
                + ([f"{ref[r['method']]:.4g}" if r["method"] in ref else "—"] if ref else []) for r in rows]
        md += [f"### {ds}", "", md_table(head, body), ""]
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
    head = ["method", "attack", "adversary", "artifact"] + (["output"] if outputs else []) + \
        ["metric", "strongest (mean ± std over runs)", "baseline", "Δ vs baseline", "strongest run (target/seed, "
         "victim, round)", "status", "runs"]
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
                       where, r["status"], r["runs"]])
    md += [md_table(head, body), ""]
    if res.attack_notes:
        count = {}
        for n in res.attack_notes:
            k = (n["attack"], n.get("status", ""))
            count[k] = count.get(k, 0) + 1
        md += ["Attack outputs without a number:", ""] + [f"- {a}: {st} ({c}×)" for (a, st), c in count.items()] + [""]
    if controls:
        md += ["### Controls", "", "Positive controls must reach the threshold; negative controls must stay at or "
               "below it (chance).", "",
               md_table(["attack", "control", "kind", "metric", "value", "threshold", "passed"],
                        [[c["attack"], c["name"], "positive" if c.get("positive", True) else "negative", c["metric"],
                          f"{c['value']:.3g}", f"{c['threshold']:.3g}", "yes" if c["passed"] else "**no**"]
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
          "One row per method, harm (and setting) and adversary (scorecard.csv). **value**: per run (held-out "
          "target × seed) the strongest attack output (attack × artifact × variant × victim × round) is chosen on "
          "one half of the images/candidates and scored on the other half (selection \"heldout\"; \"heldout-ranked\" "
          "when a hash split of few items left a half empty; \"single\" when there is one candidate; \"mean\" of the "
          "candidates when there is one item), then the mean over runs. **baseline**: the chosen attack's own "
          "trivial attack (mean or flat image, chance, the known victim's domain) on the same victim and held-out "
          "half. Brackets: 95% Student-t interval over the runs' values (one "
          "run: the bootstrap over its items; fdg_audit/metrics/stats.py). "
          f"**Δ {ref}**: this cell minus the cell of the scenario's reference method ({ref}; column `reference` of "
          "scorecard.csv), paired by target and seed: the leakage (or accuracy) a method adds beyond the reference, "
          "with n paired runs and the call on its t-test p-value Holm-adjusted over every Δ of the scorecard (below "
          "3 runs: not testable); only between cells of the same attack, prior and budget (columns prior, budget) "
          "that both beat their baselines. A value that does not beat its own baseline reads \"no reconstruction at "
          "this budget\" (or \"not above baseline\"; \"vacuous\" when the baseline is already perfect, e.g. a "
          "victim's domain that its client name gives). PSNR is capped at 60 dB (8-bit precision reaches 58.9 dB) and "
          "intervals are cut to each metric's range. **also**: for PSNR the headlines, the share of held-out images "
          "at >= 25 dB and the median PSNR (the baseline's in brackets); for membership the pool of calibrated "
          "held-out scores over victims and runs (within-model quantiles), its smallest detectable AUC (one-sided "
          "test against 0.5, alpha 0.05, power 0.8, Hanley-McNeil variance) and TPR at 1% / 0.1% FPR where the pool "
          "has >= 100 / >= 1000 non-members; below 500 members or non-members a cell is \"not resolvable\" and its "
          "Δ is not tested. **threat model**: the chosen attack's prior (none, layout, learned; oracle outputs are "
          "never the headline, see the per-victim table), budget (iterations x restarts) and what the attacker "
          "knows, as the attacks declare them (attacks.json). A harm in [brackets] names a setting an attack reports "
          "in a row of its own, or an artifact sent outside every DP mechanism of its run (its own row, at its own ε). "
          "**converged**: runs whose selected round is before the last "
          "10% of their rounds, of all runs. "
          "**control**: the attacks' positive/negative controls (failed: \"not measurable\", never \"no leak\").", ""]
    for ds in dict.fromkeys(r["dataset"] for r in card):
        body = [[r["method"] + r["variant"], r["harm"] + (f" [{r['setting']}]" if r.get("setting") else ""),
                 r["adversary"] or "—", r["metric"], ci(r) + (f" ({r['reading']})" if r.get("reading") else ""),
                 ci(r, "baseline"), ci(r, "diff_ref"), side(r) or "—",
                 f"{r['attack']} ({r['artifact']})" if r["attack"] else "—", _threat(r), r["assumes"] or "—",
                 r["control"],
                 r["selection"] or "—", f"{r['n_runs']}" + (f" / {r['n_items']}" if r["n_items"] != "" else ""),
                 r["epsilon"], _conv(r.get("converged"))]
                for r in card if r["dataset"] == ds]
        md += [f"### {ds}", "", md_table(["method", "harm", "adversary", "metric", "value [95% CI]",
                                          "baseline [95% CI]", f"Δ {ref} [95% CI]", "also", "attack (artifact)",
                                          "threat model", "attacker assumes", "control", "selection",
                                          "runs / items", "ε", "converged"], body), ""]
    return md


def _threat(r: dict) -> str:
    """A cell's threat model in one cell: prior, budget, what the attacker knows ("—" where nothing is declared)."""
    parts = [f"prior {r['prior']}" if r.get("prior") else "", f"budget {r['budget']}" if r.get("budget") else "",
             f"knows {r['capabilities']}" if r.get("capabilities") else ""]
    return "; ".join(p for p in parts if p) or "—"


def _victims_md(res) -> list[str]:
    rows = SC.per_victim(res)
    if not rows:
        return []
    md = ["### Reconstruction per victim domain", "",
          "Mean PSNR (dB) over runs of each victim's reconstructions, per attack and variant (leakage.csv; no "
          "selection, every victim shown), with the trivial baseline. Variants with the oracle prior (the data set's "
          "own generator) are upper bounds, labelled so, never a scorecard headline.", ""]
    for key in dict.fromkeys((r["key"], r["attack"]) for r in rows):
        rs = [r for r in rows if (r["key"], r["attack"]) == key]
        victims = list(dict.fromkeys(r["victim"] for r in rs))
        outs = list(dict.fromkeys(r["output"] for r in rs))
        cell = {(r["output"], r["victim"]): r for r in rs}
        oracle = {r["output"] for r in rs if r.get("oracle")}
        body = [[(o or "main") + (" (oracle: upper bound)" if o in oracle else "")]
                + [fmt(cell[(o, v)]["value"], 1) if (o, v) in cell else "—" for v in victims] for o in outs]
        body.append(["baseline"] + [fmt(next(r["baseline"] for r in rs if r["victim"] == v), 1) for v in victims])
        heads = [victim_tag(v).replace("@", "/") for v in victims]   # a curious client's "a+...+z", shortened
        md += [f"**{res.label(key[0])}, {key[1]}**", "", md_table(["variant"] + heads, body), ""]
    return md


def _tradeoff_md(res, files) -> list[str]:
    if not files:
        return []
    md = ["## Accuracy versus each harm", "",
          "One figure per harm and dataset family: every method (marker: adversary) at its scorecard value and "
          "held-out accuracy, with 95% intervals both ways; black-edged points are Pareto-optimal (no other point is "
          "at least as accurate and leaks at most as much); grey × is the trivial baseline.", ""]
    for ds, harm, f in files:
        md += [f"### {harm} ({ds})", "", _img(f, f"accuracy vs {harm}"), ""]
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


def write_report(run_dirs, out, quiet: bool = False) -> Path:
    """Aggregate run folders into ``out/report.md`` with figures in ``out/plots/``; returns report.md."""
    from ..ledger import status_lines
    out = Path(out)
    plots = out / "plots"
    runs_md = status_lines(run_dirs)   # checks each folder first: damage is one line, not a traceback
    res = T.load(run_dirs)
    acc, leak, eps = T.accuracy_table(res), T.leakage_table(res), T.privacy_table(res)
    by = bytes_table(res.envelopes, res.ok)
    card = SC.scorecard(res)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=SC.FIELDS)
    w.writeheader()
    w.writerows(card)
    atomic_write(out / "scorecard.csv", buf.getvalue())
    acc_files = P.accuracy(res, acc, plots) + P.sweep(res, acc, plots)
    trade_files = P.tradeoff(res, card, plots)
    byte_files = P.bytes_per_round(res, by, plots)
    eps_files = P.privacy(res, acc, eps, plots)
    roc_files, rec_files = P.roc(res, plots), P.recon(res, plots)
    curve = CV.by_size(res)
    curve_files = P.size_curve(res, curve, plots)
    failed = [r for r in res.runs if r.get("status") != "ok"]
    src = [str(r) for r in res.roots]
    md = [f"# fdg_audit report: {', '.join(dict.fromkeys(res.scenarios))}", "",
          f"Run folders: {', '.join(f'`{s}`' for s in src)}. Runs: {len(res.ok)} finished"
          + (f", {len(failed)} failed" if failed else "") + ".", ""]
    md += runs_md + [f"- failed: `{r['run']}`: {r.get('error', '')}" for r in failed]
    md += [f"- note: {n}" for n in res.notes] + ([""] if failed or res.notes else [])
    md += verdict_md(res, card) + _scorecard_md(res, card) + differences_md(res) + _victims_md(res)
    md += CV.curve_md(res, curve, curve_files)
    md += _tradeoff_md(res, trade_files)
    md += _accuracy_md(res, acc, acc_files) + _leakage_md(res, leak, res.controls)
    md += bytes_md(res, by, [_img(f, "bytes per run") for f in byte_files]) + _privacy_md(res, acc, eps, eps_files)
    md += dp_section(card, res.ok, res.privacy, plots, res.envelopes)   # accuracy and each harm against ε
    if roc_files:
        md += ["## Membership inference ROC", "", "Log-log ROC, scores pooled over each method's runs and victims; "
               "the dashed diagonal is random guessing.", ""] + [_img(f, "ROC") for f in roc_files] + [""]
    if rec_files:
        md += ["## Reconstructions", "", "Row 1: the victim's images; row 2: the attack's reconstructions as "
               "returned (attacks on Fourier amplitudes are scored up to a circular shift and point inversion, "
               "so a shifted or flipped image can score high); row 3: the attack's trivial baseline. One example "
               "run and victim per method and attack variant.", ""] + \
            [_img(f, "reconstructions") for f in rec_files] + [""]
    path = out / "report.md"
    atomic_write(path, "\n".join(md))
    return path
