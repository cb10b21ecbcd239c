"""The privacy scorecard: one comparable row per (dataset, method, variant, harm, setting, adversary), plus accuracy
rows.

``scorecard(res) -> list[dict]`` with the columns of ``FIELDS`` (written as scorecard.csv by ``write_report``):
  * harm: accuracy, or a harm of the metric registry (fdg_audit/metrics/registry.py), measured by the metrics
    the registry marks ``card`` for it (class: the balanced accuracy of a class attribute attack, or the accuracy
    of the labels an inversion attack recovers; both have chance 1/K). adversary: server | client | eavesdropper.
    setting: "" for the harm's main row; outputs an attack declares apart (``rows`` in attacks.json, e.g. a weaker
    attacker's variant) form a row of their own with that setting, and never compete for the main row; so do
    artifacts a run with DP mechanisms sends outside all of them ("<artifact> outside DP"), so that each row's ε is
    the one that holds for what its attacks read.
  * value: every measurable output of every attack for that harm and adversary (attack x artifact x output
    variant x round, its victims' items pooled) is a candidate, except outputs with the oracle prior (upper bounds,
    shown labelled in the per-victim table); the candidate strongest on half A of the items of all the cell's runs
    scores half B and the one strongest on B scores A (``selection = "crossfit"``; fdg_audit.metrics.stats.crossfit),
    or one candidate scores all items ("single"). Estimates (label counts, dataset size) have one value per victim,
    so their items are the victims. The value is the mean
    over runs; ci_low/ci_high: the 95% Student-t interval over the runs' values (n_runs of them; one run: the item
    bootstrap; fdg_audit.metrics.stats). Membership: an output's victim-pooled scores (victim "pooled", calibrated
    within each victim's model) replace its per-victim candidates, so a cell pools victims and runs (cells.py).
  * baseline: the chosen candidate's own trivial attack on the same items (the same victim and the same held-out
    half) where it has per-item values (reconstruction: mean / flat images; dataset size: the attacker's own public
    set size; domain: the known-victim guess, fdg_audit.audit.scoring.score), else the constant of leakage.csv (0.5 AUC,
    chance 1/K), whose interval is that constant.
  * reference, diff_ref: value minus the reference method's value (``reference``: its label; the method is
    summary.json's "reference", from the scenario) for the same dataset, variant, harm, setting and adversary, paired
    by held-out target and seed; diff_ref_ci_low/high its interval, diff_n
    the pairs, diff_p_holm and diff_call the Holm-adjusted test. Empty for the reference itself and where it has
    no such cell. For accuracy: the paired difference of held-out accuracy; its interval redraws seeds within each
    target (accuracy has no per-image values in the run folder, so test-set sampling is not in it).
  * accuracy value: mean over runs of held-out accuracy (the round chosen on source validation), interval from
    redrawing seeds within each target; baseline: chance 1/K.
  * reading: "no reconstruction at this budget" (reconstruction) or "not above baseline" (other harms) when the
    value does not beat its own baseline: the value is shown, with no Δ; "vacuous: ..." when the baseline is already
    perfect (a single-domain victim's domain: its name gives it); "not resolvable: ..." for a membership pool below
    500 members or non-members (cells.py). A Δ to the reference is computed only between cells of the same attack,
    prior and budget, both beyond their baselines; a Δ where either pool is not resolvable is printed but never
    tested (diff_call "not resolvable"). Intervals are cut to the metric's range (PSNR: [0, 60 dB]), and a Δ's to
    the range of a difference (``cut_diff``: an AUC or re-identification Δ to [-1, 1], accuracy's too).
  * setting "any channel" (``ANY_CHANNEL``): one more row per (dataset, method, variant, harm, adversary) that repeats
    the harm's main cell (the strongest non-oracle attack over every channel the method sends; column artifact
    names the channel) with, in the diff_ref columns, its Δ to the reference method whatever the attack and
    channel: compare.between's comparison, paired by target and seed, its Holm adjustment over comparisons.csv's
    family (report/compare.py). The scorecard's own Holm family is the same-attack Δ of the other rows.
  * prior, budget ("<iterations>x<restarts>"), capabilities (what the attacker knows, "+"-joined, in the attack
    contract's vocabulary) and assumes (the auxiliary data and output variant in words): what the chosen attacks
    declared of themselves in attacks.json (fdg_audit/report/threat.py; nothing is imported); "" where undeclared.
  * success_25dB, median (with intervals) and the baseline's: dB cells' headlines; a re-identification cell's
    companions (cells.recon_side): the same chosen attack's aligned psnr, success_20dB and success_25dB on the same
    runs, victims and held-out images (with intervals and the baseline's), and cpu_seconds per victim (leakage.csv's
    cost row of the chosen victim, mean over runs); pool_members, pool_nonmembers,
    min_auc, tpr@0.01fpr, tpr@0.001fpr: membership cells' pooled scores; victim_auc_median/min/max and
    victims_clear ("k/n"): their spread over victims (fdg_audit/report/cells.py). runs_clear ("k/n"): the runs
    whose own value beats their own baseline (page one says "k of n" where a claim did not hold in every run).
  * control: passed (every attack behind the chosen candidates passed its controls), failed (the value is "not
    measurable"), none (the attacks have no controls). epsilon: accuracy rows: the largest headline ε any client
    spent by the end of the run (each mechanism's budget against the adversary it is configured for), max over
    the cell's runs; leakage rows: the ε that holds against the row's adversary for the row's artifact (privacy.csv's
    per-adversary rows; "inf" where the artifact is outside every mechanism, and without DP).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from .. import seeding
from ..metrics import stats as S
from ..metrics.registry import HARMS, IN_THE_CLEAR, info
from . import cells as C
from . import tables as T
from . import threat as TH
from .select import (_fmt, _mode, accuracy_by_run, channel_of, per_channel, cut_diff, primary,  # noqa: F401  (the scorecard's
                     reference_group, selections, size_setting)                    # names)

FIELDS = ["id", "dataset", "method", "variant", "epsilon", "harm", "setting", "adversary", "metric", "unit", "value",
          "ci_low", "ci_high", "n_runs", "baseline", "baseline_ci_low", "baseline_ci_high", "baseline_kind", "chance",
          "reading", "comparison", "reference", "diff_ref", "diff_ref_ci_low", "diff_ref_ci_high", "diff_n",
          "diff_p_holm", "diff_call", "attack", "artifact", "prior", "budget", "capabilities", "assumes",
          "legible", "legible_ci_low", "legible_ci_high", "baseline_legible",
          "psnr", "psnr_ci_low", "psnr_ci_high", "baseline_psnr", "success_20dB",
          "success_20dB_ci_low", "success_20dB_ci_high", "baseline_success_20dB", "success_25dB", "success_ci_low",
          "success_ci_high", "baseline_success_25dB", "median", "median_ci_low", "median_ci_high", "baseline_median",
          "cpu_seconds", "pool_members", "pool_nonmembers", "min_auc", "tpr@0.01fpr", "tpr@0.01fpr_ci_low",
          "tpr@0.01fpr_ci_high", "tpr@0.001fpr", "tpr@0.001fpr_ci_low", "tpr@0.001fpr_ci_high",
          "victim_auc_median", "victim_auc_min", "victim_auc_max", "victims_clear", "runs_clear", "control",
          "selection", "n_items", "converged", "bytes", "bytes_vs_ref"]


def _stat_base(bases: list) -> tuple:
    if all(isinstance(b, S.Items) for b in bases):
        return S.estimate(bases)
    v = np.array([b.stat() if isinstance(b, S.Items) else b for b in bases], float)
    v = float(v[np.isfinite(v)].mean()) if np.isfinite(v).any() else float("nan")
    return v, v, v


def scorecard(res: T.Results) -> list[dict]:
    """Rows of scorecard.csv (see the module doc) without their Δ (the results model joins each cell to its one
    comparison, report/model.py), accuracy rows first within each group."""
    eps = {}   # per group: the largest headline ε any party spent in any of its runs (privacy.csv)
    gof = res.group_of()
    for r in res.privacy:
        if r["run"] in gof and r["headline"] and np.isfinite(r["epsilon"]):
            eps[gof[r["run"]]] = max(eps.get(gof[r["run"]], 0.0), r["epsilon"])

    def base_row(g, harm, adversary, metric):
        return dict(dataset=g[0], method=g[1], variant=g[2], harm=harm, adversary=adversary, metric=metric,
                    epsilon=_fmt(eps[g]) if g in eps else "inf")
    rows = _accuracy_rows(res, base_row) + _leakage_rows(res, base_row)
    return [{k: r.get(k, "") for k in FIELDS} | {k: r[k] for k in r if k.startswith("_")} for r in rows]


def _accuracy_rows(res: T.Results, base_row) -> list[dict]:
    acc, rows = accuracy_by_run(res), []
    conv = defaultdict(list)
    for r in res.ok:
        if r.get("converged") not in (None, ""):
            conv[T.gkey(r)].append(str(r["converged"]).lower() in ("true", "1"))
    for g in res.groups():
        if g not in acc:
            continue
        keys = sorted(acc[g])
        v = np.array([acc[g][k] for k in keys])
        m, lo, hi, _ = S.t_interval(v, strata=np.array([k[0] for k in keys]))
        lo, hi = max(lo, 0.0), min(hi, 1.0)          # an accuracy interval stays in [0, 1]
        k = next((r.get("num_classes") for r in res.ok if T.gkey(r) == g), None)
        rows.append(base_row(g, "accuracy", "", "target_acc") | dict(
            value=_fmt(m), ci_low=_fmt(lo), ci_high=_fmt(hi), baseline=_fmt(1 / k if k else np.nan),
            baseline_ci_low=_fmt(1 / k if k else np.nan), baseline_ci_high=_fmt(1 / k if k else np.nan),
            baseline_kind="chance", chance=_fmt(1 / k if k else np.nan),
            control="none", selection="", n_runs=len(keys), n_items="", attack="", artifact="", assumes="",
            converged=f"{sum(conv[g])}/{len(conv[g])}" if conv[g] else ""))
    return rows


def _leakage_rows(res: T.Results, base_row) -> list[dict]:
    """One row per (group, harm, adversary, setting), in the order of the groups and harms."""
    final, chosen = T.final_privacy(res), selections(res)
    order = {g: i for i, g in enumerate(res.groups())}
    return [base_row(key[0], key[1], key[2], _mode(s["chosen"]["metric"] for s in sel.values()))
            | _cell(res, key, sel, final)
            for key, sel in sorted(chosen.items(), key=lambda kv: (order.get(kv[0][0], 0),
                                                                  list(HARMS).index(kv[0][1]), kv[0][2:]))]


def _free_guess(res: T.Results, sel: dict) -> dict:
    """Which baseline a cell's baseline is (leakage.csv's free_guess of the chosen outputs, e.g. "class mean"; else
    "trivial") and the metric's chance where leakage.csv states one."""
    keys = {(run, s["chosen"]["attack"], s["chosen"]["artifact"], s["chosen"]["metric"]) for run, s in sel.items()}
    rows = [r for r in res.leakage if (r["run"], r["attack"], r["artifact"], r["metric"]) in keys]
    chance = [float(r["chance"]) for r in rows if str(r.get("chance", "")).strip() not in ("", "nan")]
    return dict(baseline_kind=_mode(str(r.get("free_guess") or "") for r in rows if r.get("free_guess")) or "trivial",
                chance=_fmt(float(np.mean(chance))) if chance else "")


def _cell(res: T.Results, key: tuple, sel: dict, final: dict) -> dict:
    """The columns of one leakage cell after its dataset, method and harm: what was chosen and under which threat
    model, the value, its paired baseline, the reading, and the PSNR headlines or membership pool."""
    g, harm, adv, setting = key
    ch = [s["chosen"] for s in sel.values()]
    ok = any(s["ok"] for s in sel.values())
    has_controls = {c["attack"] for c in res.controls}
    said = lambda f: _mode(v for c in ch if (v := f(res.attacks.get(c["attack"], {}), c["output"])))  # noqa: E731
    row = dict(setting=setting, attack=_mode(c["attack"] for c in ch), artifact=_mode(c["artifact"] for c in ch),
               epsilon=_fmt(T.epsilon_against(final, sel, adv, sorted({c["artifact"] for c in ch}))),
               prior=said(TH.prior), budget=said(TH.budget), capabilities=said(TH.capabilities),
               assumes=" | ".join(dict.fromkeys(a for c in ch if (a := TH.assumes(
                   res.attacks.get(c["attack"], {}), c["output"])))),
               control="failed" if not ok else "passed" if {c["attack"] for c in ch} <= has_controls else "none",
               selection=_mode(s["selection"] for s in sel.values()), n_runs=len(sel),
               n_items=sum(len(s["items"]) for s in sel.values()), _resolvable=True,
               unit=info(_mode(c["metric"] for c in ch).split("|")[0]).unit) | _free_guess(res, sel)
    if not ok:
        return row | dict(value="not measurable")
    seed = seeding.seed32(repr(key[:3]), seeding.SCORE)
    m, lo, hi = S.estimate([s["items"] for s in sel.values()], seed=seed)
    b, blo, bhi = _stat_base([s["base"] for s in sel.values()])
    metric = _mode(c["metric"] for c in ch).split("|")[0]
    mi = info(metric)
    cut = lambda x: x if x != x else min(max(x, mi.lo), mi.hi)  # noqa: E731  (intervals stay in the range)
    above = not (b == b) or (m > b if mi.higher else m < b)
    pool = C.pool(sel)
    if pool:
        if "victims" not in res.cache:
            res.cache["victims"] = C.victim_index(res.leakage)
        pool |= C.spread(sel, res.cache["victims"])
    per = [(s["items"].stat(), s["base"].stat() if isinstance(s["base"], S.Items) else
            float("nan") if s["base"] is None else float(s["base"])) for s in sel.values()]
    won = [v > w if mi.higher else v < w for v, w in per if w == w]
    row["runs_clear"] = f"{sum(won)}/{len(won)}" if won else ""
    row |= dict(value=_fmt(m), ci_low=_fmt(cut(lo)), ci_high=_fmt(cut(hi)), baseline=_fmt(b),
                baseline_ci_low=_fmt(cut(blo)), baseline_ci_high=_fmt(cut(bhi)), _above=above)
    row |= C.psnr_headlines(metric, sel, seed) | pool | dict(_resolvable=pool.get("_resolvable", True))
    if harm == "reconstruction" and mi.unit != "dB":
        row |= C.recon_side(sel, res.cache["side"], seed)
    if row["artifact"] == IN_THE_CLEAR.get(metric):
        row["reading"] = "sent in the clear: the message carries the value itself (no attack needed)"
    elif b == (mi.hi if mi.higher else mi.lo):
        row["reading"] = "vacuous: the trivial baseline is already perfect (what the victim's name gives)"
    elif not row["_resolvable"]:
        row["reading"] = C.unresolved(pool)
    elif not above:
        row["reading"] = "no reconstruction at this budget" if harm == "reconstruction" else "not above baseline"
    return row


