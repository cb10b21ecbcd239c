"""The report's privacy section: accuracy and each harm against epsilon, one line per method, and each stream's share.

``dp_section(scorecard_rows, privacy_rows, plots_dir, envelopes)`` returns markdown lines. ``scorecard_rows`` are rows of
``scorecard.csv`` (``dataset, method, epsilon, harm, metric, value, ci_low, ci_high, baseline, ...``; ``epsilon`` a
number or "inf"); ``privacy_rows`` are rows of ``privacy.csv``. A method's variants at several budgets are labelled
``<method>`` and ``<method>_eps<e>`` (as in scenarios/feddg_vs_csac_dp.toml) and are drawn as one line; any other
label is its own line; labels ending in ``_audit`` (canary runs) are left out. epsilon = inf is drawn at the right
of the finite values, on a log axis, and marked so.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

SUFFIX = re.compile(r"_eps[0-9.]+$")
HARMS = ("accuracy", "reconstruction", "membership", "domain", "class", "label_distribution", "dataset_size")


def _eps(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.inf


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def line_of(method: str) -> str:
    return SUFFIX.sub("", method)


def _plot(path: Path, title: str, metric: str, lines: dict, inf_x: float, finite: list) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, pts in sorted(lines.items()):
        pts = sorted(pts, key=lambda p: p[0])
        xs = [inf_x if math.isinf(e) else e for e, *_ in pts]
        ys = [v for _, v, _, _ in pts]
        err = [[max(0.0, v - lo) if not math.isnan(lo) else 0.0 for _, v, lo, _ in pts],
               [max(0.0, hi - v) if not math.isnan(hi) else 0.0 for _, v, _, hi in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xscale("log")
    ticks = sorted(set(finite)) + [inf_x]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in ticks[:-1]] + ["∞"])
    ax.minorticks_off()
    ax.set_xlabel("ε per client (δ from privacy.csv)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stream_shares(privacy_rows: list[dict]) -> list[dict]:
    """Per run: each mechanism's final epsilon (max over parties) next to the composed total, where a total exists."""
    last: dict = {}
    for r in privacy_rows:
        key = (r["run"], r["party"], r["mechanism"])
        if key not in last or int(r["round"]) >= int(last[key]["round"]):
            last[key] = r
    by_run: dict = defaultdict(lambda: defaultdict(float))
    adj: dict = {}
    for (run, _, mech), r in last.items():
        by_run[run][mech] = max(by_run[run][mech], _eps(r["epsilon"]))
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
    """Per run with any DP mechanism: the kinds its clients sent with no accounted mechanism on them (the ε does not
    cover what they carry: e.g. FedDG's amplitude bank under client-level DP on the weights)."""
    guarded, sent = set(), defaultdict(set)
    for e in envelopes:
        if e["sender"] == "server":
            continue
        if any(isinstance(ev, dict) and "epsilon" in ev for ev in e.get("filters") or []):
            guarded.add(e["run"])
        else:
            sent[e["run"]].add(e["kind"])
    return {run: sorted(sent[run]) for run in sorted(guarded) if sent[run]}


def dp_section(scorecard_rows: list[dict], privacy_rows: list[dict], plots_dir: Path, envelopes=()) -> list[str]:
    plots_dir = Path(plots_dir)
    rows = [r for r in scorecard_rows if not str(r.get("method", "")).endswith("_audit")]
    if not rows or all(math.isinf(_eps(r.get("epsilon"))) for r in rows):
        return []
    out = ["## Privacy: accuracy and leakage against ε", "",
           "One line per method (its variants at several budgets); ε is the composed total per client (max over "
           "clients), ∞ = no mechanism. Relations: see privacy.csv's `adjacency` column (client-level: one client's "
           "update replaced by zero; example-level: one example added/removed or zeroed).", ""]
    groups: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        groups[(r.get("dataset", ""), r["harm"], r.get("adversary", ""), r["metric"])][line_of(r["method"])].append(
            (_eps(r.get("epsilon")), _num(r["value"]), _num(r.get("ci_low")), _num(r.get("ci_high"))))
    order = {h: i for i, h in enumerate(HARMS)}
    for (ds, harm, adv, metric), lines in sorted(groups.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99),
                                                                                  kv[0][2], kv[0][3])):
        finite = [e for pts in lines.values() for e, *_ in pts if not math.isinf(e)]
        if not finite:
            continue
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"dp_{ds}_{harm}_{adv}_{metric}".strip("_"))
        inf_x = max(finite) * 4
        title = f"{ds} · {harm}" + (f" ({adv})" if adv else "") + f" · {metric}"
        _plot(plots_dir / f"{name}.png", title, metric, lines, inf_x, finite)
        out += [f"![{title}]({plots_dir.name}/{name}.png)", ""]
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
        out += ["Sent by clients outside every mechanism (not covered by the run's ε; the scorecard's leakage cells "
                "show what they give away):", "", "| run | kinds sent without a mechanism |", "|---|---|"]
        out += [f"| {run} | {', '.join(kinds)} |" for run, kinds in bare.items()] + [""]
    return out
