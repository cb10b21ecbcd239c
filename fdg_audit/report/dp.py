"""The report's privacy section: accuracy and each harm against epsilon, one line per method, and each stream's share.

``dp_section(scorecard_rows, runs, privacy_rows, plots_dir, envelopes)`` returns markdown lines. ``scorecard_rows``
are rows of ``scorecard.csv`` (``dataset, method, variant, epsilon, harm, metric, value, ci_low, ci_high, ...``;
``epsilon`` a number or "inf"); ``runs`` are summary.json's run entries; ``privacy_rows`` are rows of privacy.csv.

What defines a line is what the runs record, never their labels: runs of the same dataset and method plugin
(``plugin``), the same sweep values outside ``privacy``, and the same DP mechanisms switched on in their ``privacy``
config (DP-SGD, client-level DP and its mode, noise on which artifact kinds) form one line, whose points differ by
budget (noise, clip, target ε). Runs of that plugin without any mechanism are the line's ε = ∞ point (or a line of
their own when the plugin has no DP run). Audit runs, whose privacy config inserts canaries, form lines of their
own ("+ audit canaries": the canaries perturb the audited client's releases). ε = ∞
is drawn at the right of the finite values, on a log axis, and marked so.
"""
from __future__ import annotations

import io
import math
from collections import defaultdict
from pathlib import Path

from ..metrics.registry import HARMS
from ..store.safe import write_in
from .formatting import num, slug
from .select import per_channel
from .formatting import gkey
from .plots import _legend

CANARIES = ("canaries", "update_canaries", "gradient_canaries")   # fdg_audit.privacy.AuditConfig's canary counts


def budget(v) -> float:
    e = num(v)
    return math.inf if math.isnan(e) else e


def mechanisms(privacy: dict) -> tuple[str, ...]:
    """The DP mechanisms a run's privacy config (fdg_audit.privacy.PrivacyConfig as a dict) switches on, without
    their budgets."""
    p = privacy or {}
    out = ["DP-SGD"] if p.get("dp_sgd") else []
    if p.get("client"):
        out.append(f"client-level DP ({p['client'].get('mode', '')})")
    return tuple(out + [f"noise on {k}" for k in sorted(p.get("artifacts") or {})])


def audited(privacy: dict) -> bool:
    """Whether a run's privacy config inserts canaries (an audit run)."""
    return any((((privacy or {}).get("audit") or {}).get(k) or 0) for k in CANARIES)


def lines_of(runs: list[dict]) -> dict:
    """{group: [names of the lines it is drawn in]} of every group with a finished run. Audit runs (canaries
    perturb the audited client's releases) are drawn on lines of their own, named "+ audit canaries", never on
    the lines of runs without canaries."""
    rec = {}
    for r in runs:
        if r.get("status", "ok") == "ok":
            p, mech = r.get("privacy") or {}, mechanisms(r.get("privacy"))
            sweep = [f"{k.split('.')[-1]}={v}" for k, v in sorted((r.get("sweep") or {}).items()) if "privacy" not in k]
            base = repr((r.get("dataset"), r.get("plugin"), sweep))
            name = r.get("plugin", "") + (f" [{', '.join(sweep)}]" if sweep else "")
            audit = audited(p)
            rec[gkey(r)] = (base, name + (f" ({', '.join(mech)})" if mech else "") + (" + audit canaries" if audit
                                                                                      else ""), mech, audit)
    dp = defaultdict(set)
    for base, name, mech, audit in rec.values():
        if mech and not audit:
            dp[base].add(name)
    return {g: [name] if mech or audit else sorted(dp[base]) or [name] for g, (base, name, mech, audit) in rec.items()}


def _plot(path: Path, title: str, metric: str, lines: dict, inf_x: float, finite: list, baseline=()) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    for name, pts in sorted(lines.items()):
        pts = sorted(pts, key=lambda p: p[0])
        xs = [inf_x if math.isinf(e) else e for e, *_ in pts]
        ys = [v for _, v, _, _ in pts]
        err = [[max(0.0, v - lo) if not math.isnan(lo) else 0.0 for _, v, lo, _ in pts],
               [max(0.0, hi - v) if not math.isnan(hi) else 0.0 for _, v, _, hi in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
    base = [b for b in baseline if not math.isnan(b)]
    if base:   # the cells' own baselines (mean): a point below it is "no reconstruction at this budget"
        ax.axhline(sum(base) / len(base), color="grey", ls="--", lw=1, label="baseline (mean over the cells)")
    ax.set_xscale("log")
    ticks = []
    for t in sorted(set(finite)):   # one tick per cluster of budgets within 25% (e.g. 7.77 and 8.00)
        if not ticks or t > ticks[-1] * 1.25:
            ticks.append(t)
    ax.set_xticks(ticks + [inf_x])
    ax.set_xticklabels([f"{t:.2g}" for t in ticks] + ["∞"])
    ax.minorticks_off()
    ax.set_xlabel("ε per client (δ from privacy.csv)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=10)
    _legend(ax, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    return write_in(path.parents[1], path, buf.getvalue()).name   # inside the report folder (fdg_audit.store.safe)


def stream_shares(privacy_rows: list[dict]) -> list[dict]:
    """Per run: each mechanism's final epsilon (max over parties) next to the composed total, where a total exists."""
    last: dict = {}
    for r in privacy_rows:
        if r.get("adversary", "server") != "server":   # the server's view: the shares of what it reads
            continue
        key = (r["run"], r["party"], r["mechanism"])
        if key not in last or int(r["round"]) >= int(last[key]["round"]):
            last[key] = r
    by_run: dict = defaultdict(lambda: defaultdict(float))
    adj: dict = {}
    for (run, _, mech), r in last.items():
        by_run[run][mech] = max(by_run[run][mech], budget(r["epsilon"]))
        adj[(run, mech)] = r.get("adjacency", "")
    out = []
    for run, mechs in sorted(by_run.items()):
        if "total" not in mechs:
            continue
        total = mechs["total"]
        for mech, e in sorted(mechs.items()):
            if mech != "total":
                out.append(dict(run=run, mechanism=mech, epsilon=e, total=total, share=e / total if total else math.nan,
                                adjacency=adj[(run, mech)]))
    return out


def unprotected(envelopes) -> dict:
    """Per run with any DP mechanism: the kinds its clients emitted with no accounted mechanism on them (the ε does
    not cover what they carry: e.g. a style statistic under client-level DP on the weights)."""
    guarded, bare = set(), defaultdict(set)
    for e in envelopes:
        if e["sender"] in ("server", "public"):   # "public": the core's record of the server's public data
            continue
        if any(isinstance(ev, dict) and "epsilon" in ev for ev in e.get("filters") or []):
            guarded.add(e["run"])
        else:
            bare[e["run"]].add(e["kind"])
    return {run: sorted(bare[run]) for run in sorted(guarded) if bare[run]}


def dp_section(scorecard_rows: list[dict], runs: list[dict], privacy_rows: list[dict], plots_dir: Path,
               envelopes=()) -> list[str]:
    plots_dir = Path(plots_dir)
    line = lines_of(runs)
    rows = [r for r in scorecard_rows if line.get((r.get("dataset", ""), r["method"], r.get("variant", "")))
            and not per_channel(r)]   # a main cell again, with its Δ over channels
    if not rows or all(math.isinf(budget(r.get("epsilon"))) for r in rows):
        return []
    out = ["## Privacy: accuracy and leakage against ε", "",
           "One line per method plugin and set of DP mechanisms (its runs at several budgets; runs without a "
           "mechanism at ε = ∞; audit runs, whose canaries perturb training, on lines of their own); ε is the composed "
           "total per client (max over clients). Relations: see privacy.csv's `adjacency` column (client-level: one client's update replaced by "
           "zero; example-level: one example added/removed or zeroed).", ""]
    groups: dict = defaultdict(lambda: defaultdict(list))
    bases: dict = defaultdict(list)
    for r in rows:
        for name in line[(r.get("dataset", ""), r["method"], r.get("variant", ""))]:
            key = (r.get("dataset", ""), r["harm"] + (f" [{r['setting']}]" if r.get("setting") else ""),
                   r.get("adversary", ""), r["metric"])
            groups[key][name].append(
                (budget(r.get("epsilon")), num(r["value"]), num(r.get("ci_low")), num(r.get("ci_high"))))
            bases[key].append(num(r.get("baseline")))
    order = {h: i for i, h in enumerate(("accuracy",) + HARMS)}
    for (ds, harm, adv, metric), lines in sorted(groups.items(), key=lambda kv: (
            kv[0][0], order.get(kv[0][1].split(" [")[0], 99), kv[0][1], kv[0][2], kv[0][3])):
        finite = [e for pts in lines.values() for e, *_ in pts if not math.isinf(e)]
        if not finite:
            continue
        name = slug(f"dp_{ds}_{harm}_{adv}_{metric}")
        inf_x = max(finite) * 4
        title = f"{ds} · {harm}" + (f" ({adv})" if adv else "") + f" · {metric}"
        name = _plot(plots_dir / f"{name}.png", title, metric, lines, inf_x, finite, bases[(ds, harm, adv, metric)])
        out += [f"![{title}]({plots_dir.name}/{name})", ""]
    shares = stream_shares(privacy_rows)
    if shares:
        out += ["Where mechanisms compose, each stream's ε alone next to the composed total (final round, max over "
                "clients; ε does not add, so the ratios need not sum to 1):", "",
                "| run | stream | relation | ε alone | ε total | alone / total |", "|---|---|---|---|---|---|"]
        out += [f"| {s['run']} | {s['mechanism']} | {s['adjacency']} | {s['epsilon']:.2f} | {s['total']:.2f} | "
                f"{s['share']:.2f} |" for s in shares]
        out.append("")
    bare = unprotected(envelopes)
    if bare:
        out += ["Emitted by clients outside every mechanism (not covered by the run's ε; the scorecard's leakage "
                "cells "
                "show what they give away):", "", "| run | kinds emitted without a mechanism |", "|---|---|"]
        out += [f"| {run} | {', '.join(kinds)} |" for run, kinds in bare.items()] + [""]
    return out
