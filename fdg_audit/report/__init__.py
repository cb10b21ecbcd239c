"""Reports: ``write_report(run_dirs, out)`` -> report.md with PNGs in ``out/plots/`` (relative links, so the
folder can be copied), and ``headline(root)`` -> the terminal table a scenario prints.

Inputs per run folder: summary.json, messages.jsonl, and when present leakage.csv, controls.json,
privacy.csv, recon/<attack>/<run>__<victim>__<variant>.npz (truth, recon, baseline) and mia/<attack>/<run>.npz
(score, member, victim, variant, round), with "/" in run ids written as "__". Absent inputs skip their section.
Definitions (groups, mean ± std, "strongest", bytes per round, ε per run) are in ``tables``.
"""
from __future__ import annotations

import math
from pathlib import Path

from . import plots as P
from . import tables as T
from .tables import fmt, fmt_metric, human_bytes, md_table, text_table

__all__ = ["write_report", "headline"]


def _leak_lines(leak_rows: list[dict], g) -> list[str]:
    """Per artifact, per primary metric: the strongest attack's value (mean over runs) vs its baseline."""
    out = []
    rows = [r for r in leak_rows if r["key"] == g]
    for art in dict.fromkeys(r["artifact"] for r in rows):
        ar = [r for r in rows if r["artifact"] == art]
        metrics = [m for m in T.PRIMARY if any(r["metric"] == m for r in ar)] or [ar[0]["metric"]]
        for m in metrics:
            cand = [r for r in ar if r["metric"] == m]
            ok = [r for r in cand if r["status"] == "ok"]
            if not ok:
                out.append(f"{art}: {m} not measurable ({cand[0]['attack']}: control failed)")
                continue
            best = ok[0]
            for r in ok[1:]:
                if T.stronger(m, r["value"]["mean"], best["value"]["mean"]):
                    best = r
            digits = 1 if T.info(m).unit == "dB" else 3
            out.append(f"{art}: {m} {fmt_metric(m, best['value'])} vs {fmt(best['baseline'], digits)} "
                       f"({best['attack']})")
    return out


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


def headline(root) -> str:
    """The scenario's terminal summary: one row per method (dataset x label x sweep variant)."""
    res = T.load([root])
    acc = {r["key"]: r for r in T.accuracy_table(res)}
    leak, by, eps = T.leakage_table(res), T.bytes_table(res), T.privacy_table(res)
    rows = []
    for g in res.groups():
        a = acc.get(g)
        e = eps.get(g)
        rows.append([res.label(g), (fmt(a["mean"]) + f"  ({len(a['seeds'])} seed{'s' * (len(a['seeds']) != 1)})") if a else "—",
                     "\n".join(_leak_lines(leak, g)) or "—",
                     f"{e['epsilon']['mean']:.2f}" if e else "—",
                     f"{by[g]['total'] / 1e6:.2f}" if g in by else "—"])
    out = [text_table(["method", "held-out acc (mean over targets ± std over seeds)",
                       "strongest leakage per artifact, mean ± std over attacked runs: metric value vs baseline (attack)", "ε", "MB/run"], rows)]
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
    md = ["## Held-out accuracy", "",
          "Accuracy on the held-out (unseen) domain at the round selected on the pooled source-validation "
          "splits. Per target: mean ± sample std over seeds; mean over targets: per seed the mean over "
          "targets, then mean ± std over seeds. Chance is 1/classes.", ""]
    for ds in dict.fromkeys(r["dataset"] for r in acc):
        rows = [r for r in acc if r["dataset"] == ds]
        targets = list(dict.fromkeys(t for r in rows for t in r["targets"]))
        head = ["method"] + [k.split(".")[-1] for k in keys] + targets + ["mean over targets", "seeds"]
        body = [[r["method"] + ("" if keys else r["variant"])] + [r["sweep"].get(k, "") for k in keys]
                + [fmt(r["targets"].get(t, T.stat([]))) for t in targets]
                + [fmt(r["mean"]) + (f" (seeds {r['incomplete']} lack a target)" if r["incomplete"] else ""),
                   len(r["seeds"])] for r in rows]
        md += [f"### {ds}", "", md_table(head, body), ""]
        md += [_img(f, f"accuracy {ds}") for f in files if f.startswith(f"accuracy_{T.slug(ds)}.") or
               f.startswith(f"sweep_{T.slug(ds)}_")] + [""]
    return md


def _leakage_md(res, leak, controls) -> list[str]:
    if not leak:
        return ["## Leakage", "", "No leakage.csv in these run folders (no attacks ran).", ""]
    md = ["## Leakage", "",
          "Per method, attack, artifact and metric: for each run the strongest value over victims and rounds "
          "(largest; smallest for error metrics), then mean ± std over runs (targets × seeds); "
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


def _pareto_md(res, acc, files) -> list[str]:
    if not files:
        return []
    md = ["## Accuracy versus leakage", "",
          "x: per run the strongest value of the metric over every measurable attack, artifact, victim and round, "
          "mean ± std over runs; y: held-out accuracy (mean over targets ± std over seeds). Black-edged points "
          "are Pareto-optimal (no other method is at least as accurate and leaks at most as much); grey × is "
          "the attack's trivial baseline.", ""]
    accs = {r["key"]: r for r in acc}
    for metric, f in files:
        leak = T.method_leakage(res, metric)
        gs = [g for g in leak if g in accs and accs[g]["mean"]["n"]]
        for ds in dict.fromkeys(g[0] for g in gs):
            sel = [g for g in gs if g[0] == ds]
            if f != f"pareto_{T.slug(ds)}_{T.slug(metric)}.png":
                continue
            front = T.pareto_front([(leak[g]["value"]["mean"], accs[g]["mean"]["mean"]) for g in sel],
                                   T.info(metric).higher)
            missing = [res.label(g) for g in res.groups() if g[0] == ds and g not in sel]
            md += [f"### {metric} ({ds})", "", _img(f, f"accuracy vs {metric}"), "",
                   "Pareto front: " + ", ".join(res.label(g) for g, on in zip(sel, front) if on) + "."
                   + (f" Not measured with this metric: {', '.join(missing)}." if missing else ""), ""]
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
    acc_files = P.accuracy(res, acc, plots) + P.sweep(res, acc, plots)
    par_files = P.pareto(res, acc, plots)
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
    md += _accuracy_md(res, acc, acc_files) + _leakage_md(res, leak, res.controls) + _pareto_md(res, acc, par_files)
    md += _bytes_md(res, by, byte_files) + _privacy_md(res, acc, eps, eps_files)
    if roc_files:
        md += ["## Membership inference ROC", "", "Log-log ROC, scores pooled over each method's runs and victims; "
               "the dashed diagonal is random guessing.", ""] + [_img(f, "ROC") for f in roc_files] + [""]
    if rec_files:
        md += ["## Reconstructions", "", "Row 1: the victim's images; row 2: the attack's reconstructions as "
               "returned (attacks on Fourier amplitudes are scored up to a circular shift and point inversion, "
               "so a shifted or flipped image can score high); row 3: the attack's trivial baseline. One example "
               "run and victim per method and attack variant.", ""] + \
            [_img(f, "reconstructions") for f in rec_files] + [""]
    from ..ledger import atomic_write
    path = out / "report.md"
    atomic_write(path, "\n".join(md))
    return path
