"""The privacy scorecard: one comparable row per (dataset, method, variant, harm, adversary), plus accuracy rows.

``scorecard(res) -> list[dict]`` with the columns of ``FIELDS`` (written as scorecard.csv by ``write_report``):
  * harm: accuracy, or a harm of the metric registry (fdg_audit/metrics/registry.py), measured by the metrics
    the registry marks ``card`` for it (class: the balanced accuracy of a class attribute attack, or the accuracy
    of the labels an inversion attack recovers; both have chance 1/K). adversary: server | client | eavesdropper.
  * value: per run (held-out target x seed), every measurable output of every attack for that harm and
    adversary (attack x artifact x output variant x victim x round) is a candidate; the strongest candidate is
    chosen on half of the items and scored on the other half (``selection = "heldout"``;
    fdg_audit.metrics.stats.heldout), or scored on all items when there is one candidate ("single"); with few items see ``heldout``
    ("heldout-ranked", "mean", "first"). Estimates
    (label counts, dataset size) have one value per victim, so their items are the victims. The value is the mean
    over runs; ci_low/ci_high: the 95% Student-t interval over the runs' values (n_runs of them; one run: the item
    bootstrap; fdg_audit.metrics.stats).
  * baseline: the trivial attack's value, chosen and scored the same way on its own per-item values where it has
    them (reconstruction: mean / flat images; dataset size: the attacker's own public set size), else the constant
    of leakage.csv (0.5 AUC, chance 1/K), whose interval is that constant.
  * reference, diff_ref: value minus the reference method's value (``reference``: its label; the method is
    summary.json's "reference", from the scenario) for the same dataset, variant, harm and adversary, paired by
    held-out target and seed (the same run draws in both bootstraps); diff_ref_ci_low/high its interval, diff_n
    the pairs, diff_p_holm and diff_call the Holm-adjusted test. Empty for the reference itself and where it has
    no such cell. For accuracy: the paired difference of held-out accuracy; its interval redraws seeds within each
    target (accuracy has no per-image values in the run folder, so test-set sampling is not in it).
  * accuracy value: mean over runs of held-out accuracy (the round chosen on source validation), interval from
    redrawing seeds within each target; baseline: chance 1/K.
  * reading: "no reconstruction at this budget" (reconstruction) or "not above baseline" (other harms) when the
    value does not beat its own baseline: the value is shown, with no Δ. A Δ to the reference is computed only between
    cells of the same attack (so the same budget and prior), both beyond their baselines. Intervals are cut to the
    metric's range (PSNR: [0, 60 dB]).
  * assumes: the auxiliary data and output variant of the chosen attacks, in words, from attacks.json (what each
    attack said of itself; nothing is imported).
  * control: passed (every attack behind the chosen candidates passed its controls), failed (the value is "not
    measurable"), none (the attacks have no controls). epsilon: accuracy rows: the largest headline ε any client
    spent by the end of the run (each mechanism's budget against the adversary it is configured for), max over
    the cell's runs; leakage rows: the ε that holds against the row's adversary for the row's artifact (privacy.csv's
    per-adversary rows; "inf" where the artifact is outside every mechanism, and without DP).
"""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from .. import seeding
from ..metrics import stats as S
from ..metrics.registry import HARMS, harm_of, info
from ..runfolder import load_items
from . import tables as T

FIELDS = ["dataset", "method", "variant", "epsilon", "harm", "adversary", "metric", "value", "ci_low", "ci_high",
          "baseline", "baseline_ci_low", "baseline_ci_high", "reference", "diff_ref", "diff_ref_ci_low",
          "diff_ref_ci_high", "diff_n", "diff_p_holm", "diff_call", "reading", "attack", "artifact", "assumes",
          "control", "selection", "n_runs", "n_items", "converged"]
AUX_WORDS = {"public": "public target-domain images", "domain_samples": "public samples of each source domain",
             "candidates": "a pool of the victim's members and non-members",
             "layout": "the dataset's public image layout"}


def role(adversary: str) -> str:
    return adversary if adversary in ("server", "eavesdropper") else "client"


def assumes(desc: dict, output: str) -> str:
    """What an attack's chosen output assumes, in words: its auxiliary data (the core's vocabulary) and its output
    variant's own words, from the attack's entry in attacks.json (``desc``; {} when absent: nothing is said)."""
    if not desc:
        return ""
    words = [AUX_WORDS[a] for a in desc.get("aux", ()) if a in AUX_WORDS] or ["no auxiliary data"]
    outs = desc.get("outputs", {})
    words += [outs[o] for o in dict.fromkeys(["" if p == "main" else p for p in output.split("/")]) if outs.get(o)]
    return "; ".join(words)


def _candidates(res: T.Results) -> dict:
    """{(group, harm, role): {run: [candidate]}} with candidate = dict(attack, artifact, output, metric, items,
    base, baseline (constant), ok (control passed))."""
    gof = res.group_of()
    out = defaultdict(lambda: defaultdict(list))
    for f in res.items:
        if f["run"] not in gof:
            continue
        est = defaultdict(list)
        for r in load_items(f["path"]):
            if not info(r["metric"]).card or str(r.get("victim")) == "pooled" and info(r["metric"]).per_victim:
                continue
            c = dict(attack=r["attack"], artifact=r["artifact"], output=r["output"] or "", metric=r["metric"],
                     items=r["items"], base=r["base"], ok=str(r.get("status", "ok")) in ("ok", ""),
                     role=role(str(r["adversary"])), round=r["round"])
            if info(r["metric"]).per_victim:
                est[tuple(c[k] for k in ("attack", "artifact", "output", "metric", "role", "round", "ok"))].append(c)
            else:
                out[(gof[f["run"]], harm_of(r["metric"]), c["role"])][f["run"]].append(c)
        for cs in est.values():   # an estimate's items are the victims
            cat = lambda k: None if any(c[k] is None for c in cs) else S.Items(  # noqa: E731
                "mean", np.concatenate([c[k].x for c in cs]), ids=np.concatenate([c[k].ids for c in cs]))
            c = dict(cs[0], items=cat("items"), base=cat("base"))
            out[(gof[f["run"]], harm_of(c["metric"]), c["role"])][f["run"]].append(c)
    return out


def _constant_baseline(res: T.Results) -> dict:
    """{(run, attack, artifact, output, metric): baseline} from leakage.csv (constants such as chance)."""
    return {(r["run"], r["attack"], r["artifact"], r.get("output", ""), r["metric"]): r["baseline"]
            for r in res.leakage}


def _mode(values) -> str:
    c = Counter(values)
    return "|".join(v for v, _ in c.most_common())


def _fmt(x) -> str:
    return "" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.6g}"


def _select(run: str, cands: list, const: dict) -> dict:
    """The held-out choice in one run: value items, baseline (items or constant), the chosen candidate."""
    cands = [c for c in cands if c["ok"]] or cands
    higher = info(cands[0]["metric"]).higher
    salt = seeding.seed32(run, seeding.SCORE)
    i, items, sel = S.heldout([c["items"] for c in cands], higher, salt)
    chosen = cands[i]
    if all(c["base"] is not None for c in cands):
        j, base, _ = S.heldout([c["base"] for c in cands], higher, salt)
    else:
        base = const.get((run, chosen["attack"], chosen["artifact"], chosen["output"], chosen["metric"]), np.nan)
    return dict(items=items, base=base, chosen=chosen, selection=sel, ok=chosen["ok"])


def _stat_base(bases: list) -> tuple:
    if all(isinstance(b, S.Items) for b in bases):
        return S.estimate(bases)
    v = np.array([b.stat() if isinstance(b, S.Items) else b for b in bases], float)
    v = float(v[np.isfinite(v)].mean()) if np.isfinite(v).any() else float("nan")
    return v, v, v


def scorecard(res: T.Results) -> list[dict]:
    """Rows of scorecard.csv (see the module doc), accuracy rows first within each group."""
    by_run = {r["run"]: r for r in res.ok}
    eps = {}   # per group: the largest headline ε any party spent in any of its runs (privacy.csv)
    gof = res.group_of()
    for r in res.privacy:
        if r["run"] in gof and r["headline"] and np.isfinite(r["epsilon"]):
            eps[gof[r["run"]]] = max(eps.get(gof[r["run"]], 0.0), r["epsilon"])
    final = T.final_privacy(res)
    has_controls = {c["attack"] for c in res.controls}
    const = _constant_baseline(res)
    plugin = {T.gkey(r): (r.get("plugin", r.get("method")), bool(r.get("privacy"))) for r in res.ok}

    def ref(g):   # the reference method's group: same dataset, same variant (else none), without DP first
        if not res.reference:
            return None
        same = sorted((h for h in res.groups() if h[0] == g[0] and plugin[h][0] == res.reference),
                      key=lambda h: plugin[h][1])
        return next((h for h in same if h[2] == g[2]), None) or next((h for h in same if not h[2]), None)

    def base_row(g, harm, adversary, metric):
        return dict(dataset=g[0], method=g[1], variant=g[2], harm=harm, adversary=adversary, metric=metric,
                    epsilon=_fmt(eps[g]) if g in eps else "inf")
    rows = []
    # accuracy
    acc = _accuracy(res)
    conv = defaultdict(list)
    for r in res.ok:
        if r.get("converged") not in (None, ""):
            conv[T.gkey(r)].append(str(r["converged"]).lower() in ("true", "1"))
    for g in res.groups():
        if g not in acc:
            continue
        keys = sorted(acc[g])
        v = np.array([acc[g][k] for k in keys])
        strata = np.array([k[0] for k in keys])
        m, lo, hi, _ = S.t_interval(v, strata=strata)
        lo, hi = max(lo, 0.0), min(hi, 1.0)          # an accuracy interval stays in [0, 1]
        k = next((r.get("num_classes") for r in res.ok if T.gkey(r) == g), None)
        row = base_row(g, "accuracy", "", "target_acc") | dict(
            value=_fmt(m), ci_low=_fmt(lo), ci_high=_fmt(hi), baseline=_fmt(1 / k if k else np.nan),
            baseline_ci_low=_fmt(1 / k if k else np.nan), baseline_ci_high=_fmt(1 / k if k else np.nan),
            control="none", selection="", n_runs=len(keys), n_items="", attack="", artifact="", assumes="",
            converged=f"{sum(conv[g])}/{len(conv[g])}" if conv[g] else "")
        f = ref(g)
        if f is not None and f != g:
            common = [k for k in keys if k in acc[f]]
            if common:
                row["reference"] = res.label(f)
                row["_d"] = S.paired_values(np.array([acc[g][k] for k in common]),
                                            np.array([acc[f][k] for k in common]), np.array([k[0] for k in common]))
        rows.append(row)
    # leakage
    cells = _candidates(res)
    chosen = {}
    for (g, harm, adv), per_run in cells.items():
        sel = {run: _select(run, cs, const) for run, cs in sorted(per_run.items())}
        chosen[(g, harm, adv)] = sel
    order = {g: i for i, g in enumerate(res.groups())}
    cellrow = {}   # (group, harm, adversary) -> its row; "_above": the value is beyond its baseline
    for (g, harm, adv), sel in sorted(chosen.items(), key=lambda kv: (order.get(kv[0][0], 0),
                                                                      list(HARMS).index(kv[0][1]), kv[0][2])):
        ok = any(s["ok"] for s in sel.values())
        attacks = [s["chosen"]["attack"] for s in sel.values()]
        control = "failed" if not ok else "passed" if all(a in has_controls for a in set(attacks)) else "none"
        kinds = sorted({s["chosen"]["artifact"] for s in sel.values()})
        row = base_row(g, harm, adv, _mode(s["chosen"]["metric"] for s in sel.values())) | dict(
            epsilon=_fmt(T.epsilon_against(final, sel, adv, kinds)),
            attack=_mode(attacks), artifact=_mode(s["chosen"]["artifact"] for s in sel.values()),
            assumes=" | ".join(dict.fromkeys(a for s in sel.values() if (a := assumes(
                res.attacks.get(s["chosen"]["attack"], {}), s["chosen"]["output"])))),
            control=control, selection=_mode(s["selection"] for s in sel.values()), n_runs=len(sel),
            n_items=sum(len(s["items"]) for s in sel.values()))
        rows.append(row)
        if not ok:
            row["value"] = "not measurable"
            continue
        m, lo, hi = S.estimate([s["items"] for s in sel.values()], seed=seeding.seed32(repr((g, harm, adv)), seeding.SCORE))
        b, blo, bhi = _stat_base([s["base"] for s in sel.values()])
        mi = info(row["metric"].split("|")[0])
        cut = lambda x: x if x != x else min(max(x, mi.lo), mi.hi)  # noqa: E731  (intervals stay in the range)
        row |= dict(value=_fmt(m), ci_low=_fmt(cut(lo)), ci_high=_fmt(cut(hi)), baseline=_fmt(b),
                    baseline_ci_low=_fmt(cut(blo)), baseline_ci_high=_fmt(cut(bhi)),
                    _above=not (b == b) or (m > b if mi.higher else m < b))
        if not row["_above"]:
            row["reading"] = "no reconstruction at this budget" if harm == "reconstruction" else "not above baseline"
        cellrow[(g, harm, adv)] = row
    for (g, harm, adv), row in cellrow.items():   # Δ: the same attacks (budget, prior), both beyond their baselines
        f = ref(g)
        frow = cellrow.get((f, harm, adv)) if f is not None and f != g else None
        if frow is None or frow["attack"] != row["attack"] or not (frow["_above"] and row["_above"]):
            continue
        sel, fsel = chosen[(g, harm, adv)], chosen[(f, harm, adv)]
        tag = lambda run: (by_run[run]["target"], by_run[run]["seed"])  # noqa: E731
        fr = {tag(r): s for r, s in fsel.items() if fsel[r]["ok"]}
        pairs = [(s["items"], fr[tag(r)]["items"]) for r, s in sel.items() if tag(r) in fr]
        if pairs:
            row["reference"] = res.label(f)
            strata = [tag(r)[0] for r, s in sel.items() if tag(r) in fr]
            d = np.array([a.stat() - b.stat() for a, b in pairs], float)
            row["_d"] = S.compare(d, strata=strata) if len(pairs) > 1 else S.paired(*map(list, zip(*pairs)))
    with_d = [r for r in rows if "_d" in r]
    for r, d in zip(with_d, S.holm_calls([r["_d"] for r in with_d])):   # Holm over every Δ of the scorecard
        r |= dict(diff_ref=_fmt(d["mean"]), diff_ref_ci_low=_fmt(d["lo"]), diff_ref_ci_high=_fmt(d["hi"]),
                  diff_n=d["n"], diff_p_holm=_fmt(d["p_holm"]), diff_call=d["call"])
    return [{k: r.get(k, "") for k in FIELDS} for r in rows]


def _accuracy(res: T.Results) -> dict:
    """{group: {(target, seed): held-out accuracy}} of the finished runs."""
    acc = defaultdict(dict)
    for r in res.ok:
        if r.get("target_acc") is not None:
            acc[T.gkey(r)][(r["target"], r["seed"])] = float(r["target_acc"])
    return acc


def accuracy_differences(res: T.Results) -> list[dict]:
    """Every pair of methods of a dataset (and variant): the paired difference of held-out accuracy by target
    and seed (``stats.paired_values``: mean over targets, Student-t interval stratified by target, n paired runs),
    Holm-adjusted over all the pairs of the report, and its call."""
    acc = _accuracy(res)
    out, gs = [], [g for g in res.groups() if g in acc]
    for i, a in enumerate(gs):
        for b in gs[i + 1:]:
            if a[0] != b[0]:
                continue
            common = sorted(set(acc[a]) & set(acc[b]))
            if not common:
                continue
            d = S.paired_values(np.array([acc[a][k] for k in common]), np.array([acc[b][k] for k in common]),
                                np.array([k[0] for k in common]))
            out.append(dict(d, dataset=a[0], a=res.label(a), b=res.label(b), diff=d["mean"]))
    return S.holm_calls(out)


def per_victim(res: T.Results, metric: str = "psnr") -> list[dict]:
    """Reconstruction per victim domain: for each group, attack and output variant, the mean over runs (and
    rounds) of the per-victim ``metric`` in leakage.csv, and its baseline."""
    gof = res.group_of()
    by = defaultdict(list)
    for r in res.leakage:
        if r["metric"] == metric and r["run"] in gof and r["victim"] != "pooled" and r.get("status") in ("ok", ""):
            by[(gof[r["run"]], r["attack"], r["output"], r["victim"])].append(r)
    return [dict(key=g, attack=a, output=o, victim=v, value=T.stat(r["value"] for r in rs),
                 baseline=T.stat(r["baseline"] for r in rs)) for (g, a, o, v), rs in by.items()]
