"""Reports: ``write_report(run_dirs, out)`` -> scorecard.csv and report.md (the scorecard first) with PNGs in
``out/plots/`` (relative links, so the folder can be copied), and ``headline(root)`` -> the compact scorecard a
scenario prints at the end. The scorecard's definitions (held-out selection, intervals, paired differences) are in
``scorecard``; per-item values come from items/<attack>/<run>.npz (fdg_audit.attack._save_items).

Inputs per run folder: summary.json, messages.jsonl, and when present leakage.csv, controls.json,
privacy.csv, recon/<attack>/<run>__<victim>__<variant>.npz (truth, recon, baseline) and mia/<attack>/<run>.npz
(score, member, victim, variant, round), with "/" in run ids written as "__". Absent inputs skip their section.
Definitions (groups, mean ± std, "strongest", bytes per round, ε per run) are in ``tables``.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from ..ledger import atomic_write

from . import plots as P
from . import scorecard as SC
from . import tables as T
from .dp import dp_section
from .tables import fmt, fmt_metric, human_bytes, md_table, text_table

__all__ = ["write_report", "headline"]


def _client_lines(clients: dict) -> list[str]:
    by = {}
    for c, kinds in clients.items():
        by.setdefault(tuple(kinds), []).append(c)
    return [f"{', '.join(cs)}: {', '.join(k)}" for k, cs in by.items()]


def _same_bytes(res, by: dict) -> list[tuple[str, dict]]:
    """Groups with the same bytes profile (as printed) and the same client kinds, merged: [(labels, entry)]."""
    merged = {}
    for g, b in by.items():
        sig = (tuple((k, d, tuple(human_bytes(v[f]) for f in ("once", "per_round", "total")))
                     for (k, d), v in b["kinds"].items()), tuple((c, tuple(k)) for c, k in b["clients"].items()))
        merged.setdefault(sig, ([], b))[0].append(res.label(g))
    return [(", ".join(labels), b) for labels, b in merged.values()]


def _bytes_lines(res, by: dict) -> list[str]:
    lines = []
    for label, b in _same_bytes(res, by):
        lines.append(f"{label}  ({b['runs']} runs; per run: {human_bytes(b['total'])} total, "
                     f"{human_bytes(b['once'])} once at round 0, {human_bytes(b['per_round'])} per round)")
        for (kind, d), v in b["kinds"].items():
            lines.append(f"  {T.ARROW[d]} {kind:<16} per round {human_bytes(v['per_round']):>9}   once "
                         f"{human_bytes(v['once']):>9}   total {human_bytes(v['total']):>9}")
        lines += [f"  left client(s) {s}" for s in _client_lines(b["clients"])]
    return lines


def _num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def _ci(r: dict, key: str = "", digits: int | None = None) -> str:
    """"v [lo, hi]" of a scorecard row's value (key ""), baseline ("baseline") or difference ("diff_fedavg")."""
    v, lo, hi = (r["value"], r["ci_low"], r["ci_high"]) if not key else \
        (r[key], r[f"{key}_ci_low" if key == "baseline" else "diff_ci_low"],
         r[f"{key}_ci_high" if key == "baseline" else "diff_ci_high"])
    if v in ("", None):
        return "—"
    if v == "not measurable":
        return v
    d = digits if digits is not None else (1 if T.info(r["metric"].split("|")[0]).unit == "dB" else 3)
    sign = "+" if key == "diff_fedavg" else ""
    f = lambda x: f"{_num(x):{sign}.{d}f}"  # noqa: E731
    same = lo == hi
    out = f(v) + ("" if lo in ("", None) or same or _num(lo) != _num(lo) else f" [{f(lo)}, {f(hi)}]")
    if key == "diff_fedavg" and r.get("diff_call"):
        out += f" (n = {r['diff_n']}, {r['diff_call']})"
    return out


def headline(root) -> str:
    """The scenario's terminal summary: the scorecard, compact (one row per method, one column per harm: the
    held-out strongest attack's value vs its baseline, with the adversary), then bytes on the bus."""
    res = T.load([root])
    card = SC.scorecard(res)
    by = T.bytes_table(res)
    harms = [h for h in ["accuracy"] + list(SC.HARMS) if any(r["harm"] == h for r in card)]
    rows = []
    for g in res.groups():
        mine = [r for r in card if (r["dataset"], r["method"], r["variant"]) == g]
        cells = []
        for h in harms:
            rs = [r for r in mine if r["harm"] == h]
            if h == "accuracy":
                cells.append("\n".join(f"{_ci(r)}" + (f"\nΔ {_ci(r, 'diff_fedavg')}" if r["diff_fedavg"] else "")
                                       for r in rs) or "—")
            else:
                cells.append("\n".join(f"{r['adversary'][:6]}: {_ci(r)} vs {_ci(r, 'baseline')}"
                                       + (" (none at this budget)" if r.get("reading") else "") for r in rs) or "—")
        eps = next((r["epsilon"] for r in mine), "inf")
        rows.append([res.label(g)] + cells + [eps, f"{by[g]['total'] / 1e6:.2f}" if g in by else "—"])
    names = {"accuracy": "held-out acc [95% CI]", "reconstruction": "recon PSNR dB", "membership": "membership AUC",
             "domain": "domain bal. acc", "class": "class acc", "label_distribution": "label counts acc",
             "dataset_size": "size rel. error"}
    out = ["privacy scorecard (scorecard.csv): value [95% CI] vs trivial baseline; strongest victim/round chosen "
           "on held-out halves; Δ: paired difference to FedAvg",
           text_table(["method"] + [names[h] for h in harms] + ["ε", "MB/run"], rows)]
    failed = [r["run"] for r in res.runs if r.get("status") != "ok"]
    if failed:
        out.append(f"failed runs ({len(failed)}): " + ", ".join(failed))
    if by:
        out += ["", "bytes on the bus by artifact kind (↑ client→server, ↓ server→client), mean per run:"]
        out += _bytes_lines(res, by)
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- report.md

def _img(name: str, alt: str) -> str:
    return f"![{alt}](plots/{name})"


def _accuracy_md(res, acc, files) -> list[str]:
    keys = T.sweep_keys(res)
    ref = res.reference.get("values", {})
    md = ["## Held-out accuracy", "",
          "Accuracy on the held-out (unseen) domain at the round selected on the pooled source-validation "
          "splits (the earliest round within one standard error of the best; fdg_audit.federation.select_round). "
          "Per target: mean ± sample std over seeds; mean over targets: per seed the mean over targets, then mean ± "
          "std over seeds; [95% CI]: Student-t over the runs, stratified by target, with n runs. converged: runs "
          "whose selected round is before the last 10% of their rounds (a late selected round means still "
          "improving: NOT CONVERGED). Chance is 1/classes.", ""]
    if ref:
        md += [f"Reference: {res.reference.get('source', '')}", ""]
    for ds in dict.fromkeys(r["dataset"] for r in acc):
        rows = [r for r in acc if r["dataset"] == ds]
        targets = list(dict.fromkeys(t for r in rows for t in r["targets"]))
        head = ["method"] + [k.split(".")[-1] for k in keys] + targets + ["mean over targets", "[95% CI] (n)",
                                                                        "seeds", "converged"] + \
            (["reference"] if ref else [])
        body = [[r["method"] + ("" if keys else r["variant"])] + [r["sweep"].get(k, "") for k in keys]
                + [fmt(r["targets"].get(t, T.stat([]))) for t in targets]
                + [fmt(r["mean"]) + (f" (seeds {r['incomplete']} lack a target)" if r["incomplete"] else ""),
                   f"[{r['ci'][1]:.3f}, {r['ci'][2]:.3f}] ({r['ci'][3]})" if r["ci"][1] == r["ci"][1] else
                   f"({r['ci'][3]})", len(r["seeds"]),
                   f"{r['converged']}/{r['runs']}" + ("" if r["converged"] == r["runs"] else " NOT CONVERGED")]
                + ([f"{ref[r['method']]:.4g}" if r["method"] in ref else "—"] if ref else []) for r in rows]
        md += [f"### {ds}", "", md_table(head, body), ""]
        md += [_img(f, f"accuracy {ds}") for f in files if f.startswith(f"accuracy_{T.slug(ds)}.") or
               f.startswith(f"sweep_{T.slug(ds)}_")] + [""]
    return md


def _leakage_md(res, leak, controls) -> list[str]:
    if not leak:
        return ["## Leakage", "", "No leakage.csv in these run folders (no attacks ran).", ""]
    md = ["## Leakage", "",
          "Every attack output, for reference: per method, attack, artifact and metric, for each run the strongest "
          "value over victims and rounds (largest; smallest for error metrics; this maximum is biased upwards, the "
          "scorecard's held-out value is the one to compare), then mean ± std over runs (targets × seeds); "
          "\"strongest run\" is the strongest of those runs. Baseline: the attack's trivial baseline on the same "
          "rows (mean image, chance, prior), averaged the same way. A failed positive control makes the numbers "
          "\"not measurable\".", ""]
    outputs = any(r["output"] not in ("", "main") for r in leak)
    head = ["method", "attack", "adversary", "artifact"] + (["output"] if outputs else []) + \
        ["metric", "strongest (mean ± std over runs)", "baseline", "Δ vs baseline", "strongest run (target/seed, "
         "victim, round)", "status", "runs"]
    body = []
    order = {g: i for i, g in enumerate(res.groups())}
    for r in sorted(leak, key=lambda r: order.get(r["key"], 0)):
        top = r["top"]
        unit = " dB" if T.info(r["metric"]).unit == "dB" else ""
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
    md += ["### Metrics", ""] + [f"- `{m}`: {T.info(m).text}" + (f" ({T.info(m).unit})" if T.info(m).unit else "")
                                 + ("; lower = stronger attack" if not T.info(m).higher else "")
                                 for m in dict.fromkeys(r["metric"] for r in leak)] + [""]
    return md


def _conv(c) -> str:
    """"5/5", or "3/5 NOT CONVERGED" when some of a cell's runs selected a round in their last 10%."""
    if not c:
        return "—"
    done, n = c.split("/")
    return c if done == n else f"{c} NOT CONVERGED"


def _scorecard_md(res, card) -> list[str]:
    md = ["## Privacy scorecard", "",
          "One row per method, harm and adversary (scorecard.csv). **value**: per run (held-out target × seed) "
          "the strongest attack output (attack × artifact × variant × victim × round) is chosen on one half of "
          "the images/candidates and scored on the other half (selection \"heldout\"; \"heldout-ranked\" when a "
          "hash split of few items left a half empty; \"single\" when there is one candidate; \"mean\" of the "
          "candidates when there is one item), then the mean over runs. **baseline**: the trivial attack (mean or flat image, chance, "
          "prior), chosen and scored the same way. Brackets: 95% Student-t interval over the runs' values (one "
          "run: the bootstrap over its items; fdg_audit/metrics/stats.py). **Δ FedAvg**: this cell minus FedAvg's "
          "cell, paired by target and seed: the leakage (or accuracy) a method adds by what it sends beyond "
          "FedAvg's weights, with n paired runs and the call on its t-test p-value Holm-adjusted over every Δ of "
          "the scorecard (below 3 runs: not testable); only between cells of the same attack (budget and prior) "
          "that both beat their baselines. A value that does not beat its own baseline reads \"no reconstruction at "
          "this budget\" (or \"not above baseline\"). PSNR is capped at 60 dB (exact to 8-bit precision) and "
          "intervals are cut to each metric's range. **converged**: runs whose selected round is before the last "
          "10% of their rounds, of all runs. "
          "**control**: the attacks' positive/negative controls (failed: \"not measurable\", never \"no leak\").", ""]
    for ds in dict.fromkeys(r["dataset"] for r in card):
        body = [[r["method"] + r["variant"], r["harm"], r["adversary"] or "—", r["metric"],
                 _ci(r) + (f" ({r['reading']})" if r.get("reading") else ""),
                 _ci(r, "baseline"), _ci(r, "diff_fedavg"),
                 f"{r['attack']} ({r['artifact']})" if r["attack"] else "—", r["assumes"] or "—", r["control"],
                 r["selection"] or "—", f"{r['n_runs']}" + (f" / {r['n_items']}" if r["n_items"] != "" else ""),
                 r["epsilon"], _conv(r.get("converged"))]
                for r in card if r["dataset"] == ds]
        md += [f"### {ds}", "", md_table(["method", "harm", "adversary", "metric", "value [95% CI]",
                                          "baseline [95% CI]", "Δ FedAvg [95% CI]", "attack (artifact)",
                                          "attacker assumes", "control", "selection", "runs / items", "ε",
                                          "converged"], body), ""]
    return md


def clears(row: dict) -> bool:
    """A scorecard cell whose whole 95% interval lies beyond its baseline's (above it; below for an error metric):
    a leak measured at this budget, not a point estimate that happens to sit past the baseline."""
    num = lambda k: float(row[k]) if row.get(k) not in ("", None) else float("nan")  # noqa: E731
    if row["harm"] == "accuracy" or row.get("reading") or row.get("control") == "failed":
        return False
    lo, hi, blo, bhi = num("ci_low"), num("ci_high"), num("baseline_ci_low"), num("baseline_ci_high")
    b = num("baseline")
    blo, bhi = (b, b) if blo != blo else (blo, bhi)
    return lo > bhi if T.info(row["metric"].split("|")[0]).higher else hi < blo


def _verdict_md(res, card: list[dict]) -> list[str]:
    """The report's first lines: per dataset, which accuracy differences are distinguishable, and which leaks clear
    their baselines, per method."""
    diffs = SC.accuracy_differences(res)
    md = ["", "## Verdict", ""]
    for ds in dict.fromkeys(r["dataset"] for r in card):
        rows = [r for r in card if r["dataset"] == ds]
        d = [x for x in diffs if x["dataset"] == ds]
        yes = [f"{x['a']} − {x['b']} = {x['diff']:+.3f} [{x['lo']:+.3f}, {x['hi']:+.3f}] (n = {x['n']})"
               for x in d if x["call"] == "distinguishable"]
        acc = ("distinguishable: " + "; ".join(yes)) if yes else \
            f"no difference between methods is distinguishable ({len(d)} pairs, n = " \
            f"{', '.join(map(str, sorted({x['n'] for x in d})))} paired runs each, Holm-adjusted t-tests)" if d else \
            "no pair of methods to compare"
        leaks, who = [], lambda r: r["method"] + (f" ({r['variant']})" if r["variant"] else "")  # noqa: E731
        for m in dict.fromkeys(map(who, rows)):
            cells = [r for r in rows if who(r) == m and clears(r)]
            leaks.append(f"{m}: " + ("; ".join(
                f"{r['harm']} {r['metric']} {float(r['value']):.3g} vs {float(r['baseline']):.3g} ({r['adversary']}: "
                f"{r['attack']} on {r['artifact']})"
                for r in cells) if cells else "none"))
        md += [f"- **{ds}**: held-out accuracy: {acc}. Leaks whose 95% interval clears the "
               f"baseline's: {'. '.join(leaks)}. Every other cell is within its baseline at these budgets "
               "(\"no reconstruction at this budget\" is no evidence of safety at a larger one)."]
    return md + [""]


def _differences_md(res) -> list[str]:
    diffs = SC.accuracy_differences(res)
    if not diffs:
        return []
    md = ["### Which accuracy differences are real", "",
          "Paired by held-out target and seed: the mean over targets of the difference of held-out accuracy, its "
          "95% Student-t interval (stratified by target) and n, the number of paired runs; p is the t-test's "
          f"p-value Holm-adjusted over the {len(diffs)} comparisons of this report. Distinguishable: adjusted "
          "p < 0.05; below 3 paired runs a difference is not testable.", ""]
    for ds in dict.fromkeys(d["dataset"] for d in diffs):
        rs = [d for d in diffs if d["dataset"] == ds]
        say = lambda call: "; ".join(  # noqa: E731
            f"{d['a']} − {d['b']} = {d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] (n = {d['n']}, "
            f"p = {d['p_holm']:.3g})" if call != "not testable" else f"{d['a']} − {d['b']} (n = {d['n']})"
            for d in rs if d["call"] == call) or "none"
        md += [f"- **{ds}**: distinguishable: {say('distinguishable')}. Not distinguishable: "
               f"{say('not distinguishable')}." + (f" Not testable: {say('not testable')}."
                                                  if any(d["call"] == "not testable" for d in rs) else "")]
    return md + [""]


def _victims_md(res) -> list[str]:
    rows = SC.per_victim(res)
    if not rows:
        return []
    md = ["### Reconstruction per victim domain", "",
          "Mean PSNR (dB) over runs of each victim's reconstructions, per attack and variant (leakage.csv; no "
          "selection, every victim shown), with the trivial baseline.", ""]
    for key in dict.fromkeys((r["key"], r["attack"]) for r in rows):
        rs = [r for r in rows if (r["key"], r["attack"]) == key]
        victims = list(dict.fromkeys(r["victim"] for r in rs))
        outs = list(dict.fromkeys(r["output"] for r in rs))
        cell = {(r["output"], r["victim"]): r for r in rs}
        body = [[o or "main"] + [fmt(cell[(o, v)]["value"], 1) if (o, v) in cell else "—" for v in victims]
                for o in outs]
        body.append(["baseline"] + [fmt(next(r["baseline"] for r in rs if r["victim"] == v), 1) for v in victims])
        md += [f"**{res.label(key[0])}, {key[1]}**", "", md_table(["variant"] + victims, body), ""]
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


def _bytes_md(res, by, files) -> list[str]:
    if not by:
        return []
    md = ["## Communication", "",
          "Encoded bytes on the bus (messages.jsonl), per run, mean over the method's runs. Round 0 is the one-time "
          "set-up; \"per round\" is the mean over training rounds 1..T. ↑ client→server, ↓ server→client, "
          "↔ client→client.", ""]
    body = []
    for label, b in _same_bytes(res, by):
        for (kind, d), v in b["kinds"].items():
            body.append([label, kind, T.ARROW[d], human_bytes(v["once"]), human_bytes(v["per_round"]),
                         human_bytes(v["total"])])
        body.append([f"**{label}**", "**all**", "", human_bytes(b["once"]), human_bytes(b["per_round"]),
                     human_bytes(b["total"])])
    md += [md_table(["method", "artifact kind", "dir", "round 0 (once)", "per round", "total per run"], body), ""]
    md += ["Artifact kinds that left each client:", ""]
    for label, b in _same_bytes(res, by):
        md += [f"- {label}: " + "; ".join(_client_lines(b["clients"]) or ["none"])]
    md += [""] + [_img(f, "bytes per run") for f in files] + [""]
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
    acc, leak, by, eps = T.accuracy_table(res), T.leakage_table(res), T.bytes_table(res), T.privacy_table(res)
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
    failed = [r for r in res.runs if r.get("status") != "ok"]
    src = [str(r) for r in res.roots]
    md = [f"# fdg_audit report: {', '.join(dict.fromkeys(res.scenarios))}", "",
          f"Run folders: {', '.join(f'`{s}`' for s in src)}. Runs: {len(res.ok)} finished"
          + (f", {len(failed)} failed" if failed else "") + ".", ""]
    md += runs_md + [f"- failed: `{r['run']}`: {r.get('error', '')}" for r in failed]
    md += [f"- note: {n}" for n in res.notes] + ([""] if failed or res.notes else [])
    md += _verdict_md(res, card) + _scorecard_md(res, card) + _differences_md(res) + _victims_md(res)
    md += _tradeoff_md(res, trade_files)
    md += _accuracy_md(res, acc, acc_files) + _leakage_md(res, leak, res.controls)
    md += _bytes_md(res, by, byte_files) + _privacy_md(res, acc, eps, eps_files)
    md += dp_section(card, res.privacy, plots, res.envelopes)   # accuracy and each harm against ε, from the scorecard rows
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
