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
import re
from pathlib import Path

from ..store.ledger import atomic_write
from ..metrics.registry import info
from ..metrics import stats as S
from ..metrics.stats import CALLS_TEXT
from . import compare as CMP
from . import curves as CV
from . import model as M
from . import plots as P
from . import scorecard as SC
from . import tables as T
from .answer import answer_figure, strips
from .dp import dp_section
from .html import anchor, write_html
from .pageone import page_one_md, page_one_text
from .formatting import ci, clean, fmt, fmt_metric, md_table, md_text, slug
from .traffic import bytes_lines, bytes_md, bytes_table
from .threat import legend_md
from .verdict import clears, differences_md, verdict_md

__all__ = ["write_report", "headline", "clears"]


def headline(root) -> str:
    """The scenario's terminal summary: page one (wrapped at 100 columns) and where the report is."""
    m = M.build(T.load([root]))
    fig = "answer.png" if (Path(root) / "plots" / "answer.png").is_file() else None
    out = [page_one_text(m, fig)]
    by = bytes_table(m.res.envelopes, m.res.ok)
    if by:
        out += ["", "bytes on the bus by artifact kind (↑ client→server, ↓ server→client), mean per run:"]
        out += bytes_lines(m.res, by)
    if T.adaptation_note(m.res):
        out.append(T.adaptation_note(m.res))
    failed = [r["run"] for r in m.res.runs if r.get("status") != "ok"]
    if failed:
        out.append(f"failed runs ({len(failed)}): " + ", ".join(failed))
    return "\n".join(out)


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


LEGEND = [
    ("row", "the row's stable id (family, method, harm, setting, adversary): page one links to it"),
    ("value [95% CI]", "the cell's number, mean over runs (held-out target x seed), 95% Student-t interval over the "
                       "runs, n runs (one run: the bootstrap over its items)"),
    ("chosen channel", "the attack and artifact the cross-fitted rule chose: the output strongest on one half of the "
                       "items scores the other half, and the reverse, over every channel the method sends"),
    ("baseline", "the chosen output's own baseline on the same items: the strongest guess an attacker has for free "
                 "where the attack names one (its name in brackets), else the trivial one (mean image, chance)"),
    ("reading", "leak: the whole interval beyond the baseline's. no leak above baseline: it is not. not attacked: "
                "no row. not measurable: a control failed. not resolvable: a membership pool too small. vacuous: "
                "the baseline is already perfect. sent in the clear: the protocol sends the value itself (a "
                "client's image count), no attack needed"),
    ("Δ [95% CI] (n, call)", "the row's one comparison (comparisons.csv, same id): this cell minus the reference "
                         "method's cell at the same harm, adversary and setting whatever the channel (a channel's "
                         "own row: minus its method's other channel), paired by target and seed, Holm-adjusted "
                         "over the report's comparisons of the same harm. " + CALLS_TEXT),
    ("bytes", "scorecard.csv: mean bytes on the bus per run of the method's runs"),
]


def _scorecard_md(m, channels: bool = False) -> list[str]:
    """The scorecard (``channels``: the per-channel rows a method sending several channels adds, in the appendix)."""
    row = lambda c: [c.id, c.method, c.harm, c.setting or "—", c.adversary or "—",  # noqa: E731
                     f"{ci(c.row)} (n {c.n})", f"{c.row['attack']} ({c.row['artifact']})" if c.attack else "—",
                     ci(c.row, "baseline") + (f" ({c.baseline_kind})" if c.baseline_kind != "trivial" else ""),
                     c.state if c.harm != "accuracy" else "—", f"{ci(c.row, 'diff_ref')}" if c.comparison else "—"]
    head = ["row", "method", "harm", "setting", "adversary", "value [95% CI]", "chosen channel", "baseline",
            "reading", "Δ [95% CI] (n, call)"]
    if channels:
        cs = [c for c in m.cells if c.channel]
        return ["## Per-channel cells", "", "Each channel of a method that sends several, scored alone (the same "
                "rule and baseline as the scorecard); its Δ is against the method's other channel.", "",
                md_table(head, [row(c) for c in cs]), ""] if cs else []
    md = ["## Privacy scorecard", "", md_table(["term", "meaning"], [[a, b] for a, b in LEGEND]), ""]
    for ds in m.families():
        md += [f"### {md_text(ds, 120)}", "", md_table(head, [row(c) for c in m.cells if c.group[0] == ds
                                                             and not c.channel]), ""]
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
    """The run folders by name (never the producing machine's absolute path), their status and failures."""
    failed = [r for r in res.runs if r.get("status") != "ok"]
    names = ", ".join(Path(r).name for r in res.roots)
    md = ["## Runs", "", md_text(f"Run folders: {names}. Runs: {len(res.ok)} finished"
                                 + (f", {len(failed)} failed" if failed else "") + "."), ""]
    md += [clean(_relative(line), 20000) for line in runs_md]   # ledger.status_lines: run ids in code spans
    code = lambda x: "`" + clean(x, 200).replace("`", "'") + "`"  # noqa: E731  (a code span shows text as it is)
    md += [f"- failed: {code(r['run'])}: {md_text(_relative(r.get('error', '')), 2000)}" for r in failed]
    return md + [f"- note: {md_text(_relative(n), 2000)}" for n in res.notes] + [""]


def _relative(text: str) -> str:
    """``text`` with every absolute path cut to its last part (a committed report names no machine's folders)."""
    return re.sub(r"(?<![\w.])/(?:[^\s`'\"/]+/)*([^\s`'\"/]+)", r"\1", str(text))


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


def _toc(md: list[str]) -> str:
    """One line of links to report.md's ``## `` sections after page one."""
    heads = [x[3:].strip() for x in md if x.startswith("## ")][1:]
    return "Contents: " + " · ".join(f"[{h}](#{anchor(h)})" for h in heads) + \
        " · files: [scorecard.csv](scorecard.csv) · [comparisons.csv](comparisons.csv)"


def write_report(run_dirs, out, quiet: bool = False) -> Path:
    """Aggregate run folders into ``out/report.md`` (page one, the scorecard, per-family sections, then the appendix)
    and ``out/report.html`` (the same, one self-contained file) with figures in ``out/plots/``, scorecard.csv and
    comparisons.csv, all read off one results model (report/model.py); returns report.md."""
    from ..store.ledger import status_lines
    out = Path(out)
    plots = out / "plots"
    runs_md = status_lines(run_dirs)   # checks each folder first: damage is one line, not a traceback
    res = T.load(run_dirs)
    m = M.build(res)
    acc, leak, eps = T.accuracy_table(res), T.leakage_table(res), T.privacy_table(res)
    by = bytes_table(res.envelopes, res.ok)
    card, comps = m.rows(), CMP.between(res, [c.row for c in m.cells])
    _csv(out / "scorecard.csv", SC.FIELDS, card)
    _csv(out / "comparisons.csv", CMP.FIELDS, CMP.csv_rows(comps))
    acc_files = P.accuracy(res, acc, plots) + P.sweep(res, acc, plots)
    curve = CV.by_size(res)
    fig, strip_files = answer_figure(m, plots), strips(m, plots)
    byte_files = P.bytes_per_round(res, by, plots)
    eps_files = P.privacy(res, acc, eps, plots)
    roc_files, rec_files = P.roc(res, plots), P.recon(res, plots)
    curve_files = P.size_curve(res, curve, plots)
    body = page_one_md(m, fig, strip_files)
    body += _scorecard_md(m) + _accuracy_md(res, acc, acc_files) + _privacy_md(res, acc, eps, eps_files)
    body += ["## Appendix", "", "Detail tables: the per-channel cells, every comparison, bytes by kind, every "
             "attack output, the verdict per method, reconstruction per client size and per victim domain, the "
             "attacks' threat models, the runs, ROC curves and "
             "reconstruction grids.", ""]
    body += _scorecard_md(m, channels=True) + CMP.between_md(comps) + differences_md(comps)
    body += bytes_md(res, by, [_img(f, "bytes per run") for f in byte_files])
    body += verdict_md(res, card) + CV.domain_md(res, CV.per_domain(res)) + CV.curve_md(res, curve, curve_files)
    body += legend_md(res) + _leakage_md(res, leak, res.controls) + _runs_md(res, run_dirs, runs_md)
    body += dp_section(card, res.ok, res.privacy, plots, res.envelopes)   # accuracy and each harm against ε
    body += _figures_md(roc_files, rec_files)
    md = [f"# fdg_audit report: {md_text(', '.join(dict.fromkeys(res.scenarios)), 200)}", "", _toc(body), ""] + body
    path = out / "report.md"
    atomic_write(path, "\n".join(md), out)
    write_html(md, out)
    return path
