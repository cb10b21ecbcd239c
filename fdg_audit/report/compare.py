"""Between methods, whatever the channel (issue 32, item 5): for each dataset family, harm, adversary and primary
setting (the main row, or one client size where a family's clients have fixed sizes: ``scorecard.primary``), one cell
per method (the scorecard's main cell: the strongest non-oracle attack over every channel, i.e. artifact, the method
sends, cross-fitted on halves of the items; ``scorecard.selections``) and the paired difference between every two
methods of the family, so that "does one method's bank of image statistics leak more than another's weights?" has a
number even though the two cells are read off different artifacts by different attacks. This is meaningful because
every channel of a harm is scored with the same metric (the registry's headline, e.g. re-identification for
reconstruction); a pair whose chosen metrics differ in a run is not compared in that run.

Each difference is A − B of the per-run values (held-out target x seed, the runs of both methods paired by target and
seed), with its Student-t interval stratified by target; held-out accuracy is compared the same way. One family of
tests per question, i.e. per harm (held-out accuracy is one): Holm over that harm's comparisons of every family and
adversary, called by ``stats.call`` (distinguishable / borderline / not distinguishable / inconclusive). Each harm
is read on its own (a row of page one's matrix, its own sentence), so an accuracy call does not pay for the number of
leakage cells, nor a membership call for the reconstruction cells. A membership difference where either pool is
below the resolvable size is printed with the call "not resolvable" and left out of the family. When one of the two
is the scenario's reference method, B is the reference. Intervals are cut to the range of a difference of the metric
(``scorecard.cut_diff``).

The scorecard shows each method's comparison with the reference in a row of its own (``any_channel_rows``, setting
"any channel"), so computed once per Results (``res.cache``) and read by both.
"""
from __future__ import annotations

import numpy as np

from ..metrics import stats as S
from ..metrics.registry import HARMS
from . import select as SC
from . import tables as T
from .formatting import md_table

FIELDS = ["id", "dataset", "harm", "setting", "adversary", "a", "b", "metric", "channel_a", "channel_b", "attack_a", "attack_b",
          "diff", "lo", "hi", "n", "p_holm", "call"]


def _pairs(res: T.Results, gs: list) -> list[tuple]:
    """Every two groups of a family, the reference method (when one of them) second."""
    ref = lambda g: is_reference(res, g)  # noqa: E731
    return [(b, a) if ref(a) else (a, b) for i, a in enumerate(gs) for b in gs[i + 1:]]


def is_reference(res: T.Results, g: tuple) -> bool:
    """Whether group ``g`` runs the scenario's reference method (its plugin name, as the scorecard's Δ)."""
    return bool(res.reference) and any(T.gkey(r) == g and r.get("plugin", r.get("method")) == res.reference
                                       for r in res.ok)


def _leak(res: T.Results, card: list[dict], chosen: dict, ka: tuple, kb: tuple) -> dict | None:
    """The paired difference of two cells (keys of ``select.selections``: two groups' cells of one harm, adversary
    and setting, or two channels' cells of one group), or None."""
    sa, sb = chosen.get(ka), chosen.get(kb)
    if not sa or not sb:
        return None
    tag = {r["run"]: (r["target"], r["seed"]) for r in res.ok}
    fb = {tag[r]: s for r, s in sb.items() if s["ok"]}
    pairs = [(tag[r][0], s, fb[tag[r]]) for r, s in sa.items() if s["ok"] and tag[r] in fb
             and s["chosen"]["metric"] == fb[tag[r]]["chosen"]["metric"]]
    if not pairs:
        return None
    d = np.array([x["items"].stat() - y["items"].stat() for _, x, y in pairs], float)
    metric = pairs[0][1]["chosen"]["metric"]
    c = S.compare(d, strata=[t for t, _, _ in pairs], metric=metric) if len(pairs) > 1 else \
        S.paired([x["items"] for _, x, _ in pairs], [y["items"] for _, _, y in pairs], metric=metric)
    c = SC.cut_diff(c, metric)
    cell = {(r["dataset"], r["method"], r["variant"], r["harm"], r["adversary"], r["setting"]): r for r in card}
    unres = any(str(cell.get(k[0] + k[1:], {}).get("reading", "")).startswith("not resolvable") for k in (ka, kb))
    pick = lambda k, i: SC._mode(p[i]["chosen"][k] for p in pairs)  # noqa: E731
    return dict(c, harm=ka[1], adversary=ka[2], setting=SC.channel_base(ka[3]), metric=pick("metric", 1),
                channel_a=pick("artifact", 1), channel_b=pick("artifact", 2), attack_a=pick("attack", 1),
                attack_b=pick("attack", 2), _unresolved=unres, cell_a=ka, cell_b=kb)


def between(res: T.Results, card: list[dict]) -> list[dict]:
    """Rows of comparisons.csv (``FIELDS``): accuracy and every harm x adversary, every two methods of a family, and
    every two channels of a method that sends several (``card``: the scorecard's rows; computed once per Results)."""
    if "between" not in res.cache:
        res.cache["between"] = _between(res, card)
    return res.cache["between"]


def _between(res: T.Results, card: list[dict]) -> list[dict]:
    chosen, acc = SC.selections(res), SC.accuracy_by_run(res)
    out = []
    for ds in dict.fromkeys(g[0] for g in res.groups()):
        gs = [g for g in res.groups() if g[0] == ds]
        cells = sorted({k[1:4] for k in chosen if k[0] in gs and SC.primary(k[3])},
                       key=lambda k: (list(HARMS).index(k[0]), k[2], k[1]))
        for a, b in _pairs(res, gs):
            common = sorted(set(acc.get(a, {})) & set(acc.get(b, {})))
            if common:
                d = S.paired_values(np.array([acc[a][k] for k in common]), np.array([acc[b][k] for k in common]),
                                    np.array([k[0] for k in common]), "target_acc")
                out.append(SC.cut_diff(d, "target_acc") | dict(harm="accuracy", adversary="", setting="",
                                                               metric="target_acc", ga=a, gb=b, cell_a=(a,),
                                                               cell_b=(b,)))
            for harm, role, setting in cells:
                d = _leak(res, card, chosen, (a, harm, role, setting), (b, harm, role, setting))
                if d:
                    out.append(d | dict(ga=a, gb=b))
        for g in gs:   # one method's channels against each other: the same runs and items, paired by run
            for harm, role, setting in cells:
                chans = sorted(k[3] for k in chosen if k[:3] == (g, harm, role) and SC.channel_of(k[3])
                               and SC.channel_base(k[3]) == setting)
                for i, x in enumerate(chans):
                    for y in chans[i + 1:]:
                        d = _leak(res, card, chosen, (g, harm, role, x), (g, harm, role, y))
                        if d:
                            out.append(d | dict(ga=g, gb=g))
    holm_per_harm([c for c in out if not c.get("_unresolved")])
    for c in out:
        if c.get("_unresolved"):
            c |= dict(p_holm=float("nan"), call="not resolvable")
        c |= dict(dataset=c["ga"][0], a=res.label(c["ga"]), b=res.label(c["gb"]), diff=c["mean"],
                  ref=is_reference(res, c["gb"]) and not is_reference(res, c["ga"]))
        c["id"] = comparison_id(c)
    return out


def holm_per_harm(comps: list[dict]) -> None:
    """Adds ``p_holm``, ``call`` and ``family_size`` (its testable comparisons) to each comparison: one Holm family per
    harm (module doc)."""
    for harm in dict.fromkeys(c["harm"] for c in comps):
        family = [c for c in comps if c["harm"] == harm]
        size = sum(np.isfinite(c["p"]) for c in family)
        for c, h in zip(family, S.holm_calls(family)):
            c |= dict(p_holm=h["p_holm"], call=h["call"], family_size=size)


def comparison_id(c: dict) -> str:
    """A comparison's stable id: family, the two cells (method, and channel where two channels of one method are
    compared), harm, adversary and setting, in words joined by dots (no run order in it)."""
    who = lambda g, ch: (g[1] + g[2]) + (f"-{ch}" if c["ga"] == c["gb"] else "")  # noqa: E731
    return SC.stable_id("vs", c["ga"][0], who(c["ga"], c.get("channel_a")) + "-minus-" + who(c["gb"], c.get("channel_b")),
                        c["harm"], c["adversary"], c["setting"])


def csv_rows(comps: list[dict]) -> list[dict]:
    def f(x):
        return "" if x is None or isinstance(x, float) and x != x else f"{x:.6g}" if isinstance(x, float) else x
    return [{k: f(c.get(k, "")) for k in FIELDS} for c in comps]


def between_md(comps: list[dict]) -> list[str]:
    """report.md's section: every leakage comparison between methods (the accuracy ones are listed with the
    verdict)."""
    leak = [c for c in comps if c["harm"] != "accuracy"]
    if not leak:
        return []
    f = lambda x, d=3: "—" if x != x else f"{x:+.{d}f}"  # noqa: E731
    body = [[c["id"], c["dataset"], c["harm"] + (f" [{c['setting']}]" if c["setting"] else ""), c["adversary"], c["metric"], f"{c['a']} ({c['attack_a']} on {c['channel_a']})",
             f"{c['b']} ({c['attack_b']} on {c['channel_b']})", f"{f(c['diff'])} [{f(c['lo'])}, {f(c['hi'])}]",
             c["n"], "—" if c["p_holm"] != c["p_holm"] else f"{c['p_holm']:.3g}", c["call"]] for c in leak]
    return ["## Between methods, whatever the channel", "",
            "Per family, harm and adversary: each method's scorecard cell (the strongest non-oracle attack over every "
            "channel it sends, cross-fitted on halves of the items) minus another method's, paired by target and "
            "seed, 95% Student-t interval; p Holm-adjusted over the comparisons of the same harm (one family per "
            "harm: each harm is its own question). " + S.CALLS_TEXT + " comparisons.csv has these rows.", "",
            md_table(["comparison", "family", "harm", "adversary", "metric", "A (attack on channel)", "B (attack on channel)",
                      "A − B [95% CI]", "n", "p (Holm)", "call"], body), ""]
