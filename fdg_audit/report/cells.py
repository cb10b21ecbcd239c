"""The numbers a scorecard cell reports beside its value, from the held-out items of its chosen candidates
(``sel``: {run: dict(items, base, ...)} as ``scorecard._select`` returns them).

* Reconstruction in dB (``psnr_headlines``): the share of held-out images at PSNR ≥ ``SUCCESS_DB`` (docs/attacks.md §1,
  fixed in advance) and the median PSNR, each the mean over runs of its per-run value with the interval of
  ``stats.estimate``, cut to the metric's range (a share to [0, 1], dB to [0, cap]); and the same two numbers of the
  paired baseline.
* Re-identification (``recon_side``): beside the headline, the same chosen attack output's aligned PSNR and its shares
  of images at >= 20 and >= 25 dB, on the same runs, victims and held-out images (each the mean over runs with the
  interval of ``stats.estimate`` cut to the metric's range, and the paired baseline's mean), and the CPU seconds the
  attack spent per victim (leakage.csv's cost rows of the chosen outputs, mean over their victims and the runs). A
  number is left empty unless every run of the cell has it.
* Membership (``pool``): per run, the chosen candidate's held-out scores are calibrated within their target model
  (the run and the victim named in each item's id; ``metrics.membership.calibrate``, label-free quantiles) and pooled
  over the cell's runs (targets x seeds) and victims. The pool's size is reported (members, non-members), with the
  smallest AUC a one-sided test against 0.5 detects at that size (alpha 0.05, power 0.8, Hanley-McNeil variance;
  ``metrics.membership.min_detectable_auc``). Below ``MIN_POOL`` of either the cell is "not resolvable". TPR at 1 % and
  0.1 % FPR are read off the pooled ROC only where the pool holds >= 100 and >= 1000 non-members, each with its 95%
  interval from the cluster bootstrap over target models (``metrics.membership.tpr_interval``). Calibrated
  quantiles of models with few candidates tie across models (6 non-members per model take 6 values), so no threshold
  may reach the FPR: the TPR is then that of random tie-breaking at exactly that FPR (the ROC interpolated), where
  the step rule would read the TPR at FPR 0. Beside the pool, its spread over victims (``spread``): the median and
  range of the per-victim AUCs (each victim's own model and candidates) and how many victims' own 95% DeLong interval
  clears their baseline, so a few leaky clients and all a little can be told apart.
"""
from __future__ import annotations

import numpy as np

from ..metrics import membership as MM
from ..metrics import stats as S
from ..metrics.registry import info

SUCCESS_DB = 25.0
# re-identification's companions: registry metric -> (scorecard column, prefix of its interval columns)
COMPANIONS = {"psnr": ("psnr", "psnr"), "success@20dB": ("success_20dB", "success_20dB"),
              "success@25dB": ("success_25dB", "success"), "legible": ("legible", "legible")}
TPR_AT = (0.01, 0.001)
NAN = float("nan")


def _fmt(x) -> str:
    return "" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.6g}"


def _cut(x: float, lo: float, hi: float) -> float:
    return x if x != x else min(max(x, lo), hi)


def _summary(runs: list, lo: float, hi: float, seed: int) -> tuple:
    m, a, b = S.estimate(runs, seed=seed)
    return _cut(m, lo, hi), _cut(a, lo, hi), _cut(b, lo, hi)


def psnr_headlines(metric: str, sel: dict, seed: int = 0) -> dict:
    """success_25dB, median (with intervals) and their baseline values of a dB cell; {} for other metrics."""
    mi = info(metric)
    its = [s["items"] for s in sel.values()]
    if mi.unit != "dB" or not its or any(i.kind != "mean" for i in its):
        return {}
    ok = lambda i: i is not None and not isinstance(i, float) and i.kind == "mean"  # noqa: E731
    share = lambda i: S.Items("mean", (np.asarray(i.x) >= SUCCESS_DB).astype(float), ids=i.ids)  # noqa: E731
    mid = lambda i: S.Items("median", np.asarray(i.x, float), ids=i.ids)  # noqa: E731
    s, slo, shi = _summary([share(i) for i in its], 0.0, 1.0, seed)
    m, mlo, mhi = _summary([mid(i) for i in its], mi.lo, mi.hi, seed)
    bases = [s["base"] for s in sel.values()]
    b_s = b_m = NAN
    if bases and all(ok(b) for b in bases):
        b_s = float(np.nanmean([share(b).stat() for b in bases]))
        b_m = float(np.nanmean([mid(b).stat() for b in bases]))
    return dict(success_25dB=_fmt(s), success_ci_low=_fmt(slo), success_ci_high=_fmt(shi),
                baseline_success_25dB=_fmt(b_s), median=_fmt(m), median_ci_low=_fmt(mlo), median_ci_high=_fmt(mhi),
                baseline_median=_fmt(b_m))


def side_key(run: str, r: dict, metric: str) -> tuple:
    """The key of one attack output's number (an items-file row, a leakage.csv row or a scorecard candidate)."""
    return run, r["attack"], r["artifact"], r.get("output") or "", int(r["round"]), str(r.get("victim")), metric


def cpu_seconds(leakage: list[dict]) -> dict:
    """{side_key: CPU seconds} of leakage.csv's cost rows."""
    return {side_key(r["run"], r, "cpu_seconds"): r["value"] for r in leakage if r["metric"] == "cpu_seconds"}


def recon_side(sel: dict, side: dict, seed: int = 0) -> dict:
    """psnr, success_20dB, success_25dB (with intervals and the baseline's) and cpu_seconds of a re-identification
    cell (module doc; ``side``: {side_key: (items, base)} of the companions, {side_key: seconds} of the costs): per
    run, each chosen candidate's companion on the half it scores (``sel[run]["parts"]``)."""
    out = {}
    for metric, (col, ci) in COMPANIONS.items():
        got = [[(side.get(side_key(run, c, metric)), h) for c, h in s["parts"]] for run, s in sel.items()]
        if not got or any(g is None for ps in got for g, _ in ps):
            continue
        salt = [s["salt"] for s in sel.values()]
        mi = info(metric)
        m, lo, hi = _summary([S.merge([S.part(g[0], t, h) for g, h in ps]) for ps, t in zip(got, salt)],
                             mi.lo, mi.hi, seed)
        b = [S.merge([S.part(g[1], t, h) for g, h in ps]).stat() for ps, t in zip(got, salt)
             if all(g[1] is not None for g, _ in ps)]
        out |= {col: _fmt(m), f"{ci}_ci_low": _fmt(lo), f"{ci}_ci_high": _fmt(hi),
                f"baseline_{col}": _fmt(float(np.nanmean(b)) if len(b) == len(got) else NAN)}
    cost = [[side.get(side_key(run, c, "cpu_seconds")) for c, _ in s["parts"]] for run, s in sel.items()]
    if cost and all(c is not None for cs in cost for c in cs):
        out["cpu_seconds"] = _fmt(float(np.mean([np.mean(cs) for cs in cost])))
    return out


def victims(it) -> np.ndarray:
    """The victim of each membership item: the salt of its id (``scoring._image_ids``); 0 without ids."""
    return np.zeros(len(it), np.int64) if it.ids is None else np.asarray(it.ids, np.int64) >> 32


def pool(sel: dict) -> dict:
    """The membership pool of a cell (module doc): pool_members, pool_nonmembers, min_auc, tpr@<f>fpr, and
    ``_resolvable``; {} when the cell's items are not membership scores."""
    scores, labels, models = [], [], []
    for run, s in sel.items():
        it = s["items"]
        if it.kind != "auc" or it.y is None or not len(it):
            continue
        scores.append(np.asarray(it.x, float))
        labels.append(np.asarray(it.y, int))
        models += [f"{run}#{v}" for v in victims(it)]   # the victim of each candidate: its id's salt (scoring._image_ids)
    if not scores:
        return {}
    y = np.concatenate(labels)
    x = MM.calibrate(np.concatenate(scores), np.array(models))
    n1, n0 = int(y.sum()), int(len(y) - y.sum())
    out = dict(pool_members=n1, pool_nonmembers=n0, min_auc=_fmt(MM.min_detectable_auc(n1, n0)),
               _resolvable=min(n1, n0) >= MM.MIN_POOL)
    for f in TPR_AT:   # ties no threshold splits: random tie-breaking (module doc)
        out[f"tpr@{f:g}fpr"] = _fmt(MM.tpr_at_fpr(x, y, f, ties="interpolate") if n1 and n0 else NAN)
        lo, hi = MM.tpr_interval(x, y, models, f, ties="interpolate") if n1 and n0 else (NAN, NAN)
        out |= {f"tpr@{f:g}fpr_ci_low": _fmt(lo), f"tpr@{f:g}fpr_ci_high": _fmt(hi)}
    return out


def victim_index(leakage: list[dict]) -> dict:
    """{(run, attack, artifact, output, round): [(victim, auc, its 95% low end, baseline)]} of leakage.csv's
    per-victim membership rows (victim "pooled" left out)."""
    rows = {}
    for r in leakage:
        if r["metric"] in ("auc", "auc_ci_low") and str(r.get("victim")) != "pooled":
            k = (r["run"], r["attack"], r["artifact"], r.get("output") or "", int(r["round"]), str(r["victim"]))
            rows.setdefault(k, {})[r["metric"]] = (float(r["value"]), float(r["baseline"]))
    out = {}
    for k, m in rows.items():
        if "auc" in m and "auc_ci_low" in m:
            out.setdefault(k[:5], []).append((k[5], m["auc"][0], m["auc_ci_low"][0], m["auc"][1]))
    return out


def spread(sel: dict, index: dict) -> dict:
    """How a membership cell spreads over its victims (module doc): per victim of every run, the AUC of the outputs
    the cell chose there (``sel[run]["parts"]``: one or two outputs per run, one per half, more on a tie), averaged
    over those outputs so that each victim counts once; victim_auc_median, victim_auc_min, victim_auc_max, and
    victims_clear: "k/n" victims whose own 95% interval lies wholly above their baseline (max(0.5, blind AUC)) for
    every output chosen for them."""
    per = {}
    for run, s in sel.items():
        for c in dict.fromkeys((c["attack"], c["artifact"], c["output"], int(c["round"]))
                               for c, _ in s.get("parts", ())):
            for victim, auc, lo, base in index.get((run,) + c, []):
                per.setdefault((run, victim), []).append((auc, lo > base))
    if not per:
        return {}
    a = np.array([np.mean([x for x, _ in v]) for v in per.values()])
    clear = sum(all(c for _, c in v) for v in per.values())
    return dict(victim_auc_median=_fmt(float(np.median(a))), victim_auc_min=_fmt(float(a.min())),
                victim_auc_max=_fmt(float(a.max())), victims_clear=f"{clear}/{len(per)}")


def unresolved(p: dict) -> str:
    """The reading of a pool below ``MIN_POOL``: "not resolvable" with its size and smallest detectable AUC."""
    a = float(p["min_auc"] or "nan")
    return (f"not resolvable: pool of {p['pool_members']} members and {p['pool_nonmembers']} non-members (below "
            f"{MM.MIN_POOL} each); smallest detectable AUC " + (f"{a:.3f}" if a == a else "none (a class is missing)"))
