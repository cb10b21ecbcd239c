"""Uncertainty for the scorecard: per-item values, a two-stage bootstrap, paired differences, held-out selection.

An ``Items`` holds one attack output's per-item values (images, candidates, rows, or victims for estimates) and
computes its metric on any resample of them, vectorised over bootstrap replicates:
  * ``"mean"``: the mean of per-item values (per-image PSNR / SSIM, success indicators, correct labels);
  * ``"median"``: their median (the scorecard's median PSNR);
  * ``"auc"``: ROC AUC of scores ``x`` against labels ``y`` (rank formula, ties count 1/2; NaN if a class is
    missing from the resample);
  * ``"balanced_acc"``: mean per-class recall of correctness ``x`` (0/1) by true class ``y`` over the classes
    present in the resample.

Intervals across runs (``estimate``, ``paired``, ``compare``): the statistic of a cell is the mean over runs
(targets x seeds) of each run's metric. Each run's metric already carries its items' noise, so the run values are
independent draws whatever mixes item and run variation, and a Student-t interval over them has its nominal
coverage with few runs (the two-stage bootstrap it replaces covered 80-88% at 3 runs; tests/test_scorecard.py).
With strata (held-out targets) the mean is over strata of the stratum means and the variance is pooled within
strata (Welch-Satterthwaite degrees of freedom), so a hard and an easy target do not count as noise. One run has no
across-run interval: its interval is the item bootstrap (percentiles of 2000 replicates), labelled as such by the
caller, and a difference on fewer than ``MIN_RUNS`` runs is "not testable".

Calls (``compare``, ``holm``; ``call``): on the two-sided t-test p-value, Holm-adjusted over the family of
comparisons a report makes (``holm``), a difference is "distinguishable" below ``FIRM`` (0.01) and "borderline" from
``FIRM`` up to ``LOOSE`` (0.1). From ``LOOSE`` on it is "not distinguishable" only when its 95% interval also holds
0 and lies inside ±the metric's margin (fdg_audit.metrics.registry.margin: the smallest difference that matters),
i.e. the data show no difference and rule out one that matters; otherwise it is "inconclusive" (the interval still
reaches a difference that matters, or leaves out 0 before the Holm adjustment, so that another seed set may well
make it distinguishable). "distinguishable" and "not distinguishable" are the firm claims. Why both
rules: a fresh clone on another machine moved adjusted p-values of 0.03 to 0.065 (issue 32), so a call between 0.01
and 0.1 can flip under any perturbation; and a difference of −0.43 [−0.60, −0.25] at Holm p 0.15 (one of 112
comparisons) was called "not distinguishable" in one seed set and "distinguishable" (p 0.003) in another, because a
large p says only that the test had too little power, not that the methods are alike. bench/replicate.py checks that
the firm calls hold. ``signflip_p`` is the exact sign-flip test of the same differences, printed beside it.

Cross-fitted selection (``crossfit``): several candidates (attack x artifact x output variant x round, each over
every victim of a run) measure the same harm in a cell; the maximum over them is biased upwards. Each item is
assigned to half A or B by a hash of its id (the same image / candidate gets the same half in every candidate that
holds it); the candidate strongest on the A items of all the cell's runs scores the B items and the one strongest on
B scores the A items, so the choice is made once per cell on many items, every item counts once, and no item is
scored by a choice it took part in. A baseline follows its candidate on the same items.

Convergence (``late_gain``): the one-standard-error rule can select a round before a run's last 10% on a curve that
still rises slowly, so a run's selected round alone does not show a plateau. Over a group of runs the gains of their
source-validation curves over their last 10% of evaluations are tested with the one-sided sign-flip test: on a
plateau they are noise around 0; a group whose gains are positive together is still rising.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from .registry import margin as margin_of

LEVEL = 0.95
N_BOOT = 2000
MIN_RUNS = 3      # below this many paired runs a difference is "not testable"
FIRM, LOOSE = 0.01, 0.1   # Holm-adjusted p below FIRM: distinguishable; in [FIRM, LOOSE): borderline (module doc)
FIRM_CALLS = ("distinguishable", "not distinguishable")   # the others: borderline, inconclusive, not testable
CALLS_TEXT = ("Calls on the Holm-adjusted p: distinguishable below 0.01; borderline from 0.01 to 0.1 (not a firm "
              "claim); from 0.1 on, not distinguishable when the 95% interval holds 0 and lies inside ± the metric's "
              "margin (the smallest difference that matters: 0.02 of accuracy, 0.1 of a rate, 0.05 of AUC; "
              "fdg_audit/metrics/registry.py), else inconclusive (not a firm claim: the interval still reaches a "
              "difference that matters, or leaves out 0); below 3 paired runs, not testable.")


@dataclass
class Items:
    kind: str                       # "mean" | "median" | "auc" | "balanced_acc"
    x: np.ndarray                   # per-item values / scores / correctness
    y: np.ndarray | None = None     # auc: member 0/1; balanced_acc: true class
    ids: np.ndarray | None = None   # item identity (int64) for the held-out split

    def __len__(self) -> int:
        return len(self.x)

    def sub(self, mask: np.ndarray) -> "Items":
        return Items(self.kind, self.x[mask], None if self.y is None else self.y[mask],
                     None if self.ids is None else self.ids[mask])

    def stat(self, idx: np.ndarray | None = None) -> np.ndarray:
        """The metric on items ``idx`` (..., m) (default: all), one value per leading index."""
        idx = np.arange(len(self.x)) if idx is None else np.asarray(idx)
        x = np.asarray(self.x, float)[idx]
        if not x.shape[-1]:         # no items: NaN, without numpy's empty-slice warning
            return np.full(x.shape[:-1], np.nan)
        if self.kind == "mean":
            return x.mean(-1)
        if self.kind == "median":
            return np.median(x, -1)
        y = np.asarray(self.y)[idx]
        if self.kind == "auc":
            from scipy.stats import rankdata
            r = rankdata(x, axis=-1)
            n1 = y.sum(-1)
            n0 = y.shape[-1] - n1
            with np.errstate(invalid="ignore", divide="ignore"):
                return np.where((n1 > 0) & (n0 > 0), ((r * y).sum(-1) - n1 * (n1 + 1) / 2) / (n1 * n0), np.nan)
        if self.kind == "balanced_acc":
            classes = np.unique(np.asarray(self.y))
            hit = (y[..., None] == classes)                        # (..., m, K)
            n = hit.sum(-2)
            with np.errstate(invalid="ignore", divide="ignore"):
                rec = (hit * x[..., None]).sum(-2) / n
            return np.nanmean(np.where(n > 0, rec, np.nan), -1)
        raise ValueError(f"unknown item kind {self.kind!r}")

    def resample(self, rng: np.random.Generator, b: int) -> np.ndarray:
        """``b`` bootstrap draws of item indices (b, m), stratified by label for "auc"."""
        m = len(self.x)
        if self.kind != "auc" or not m:     # no items (a held-out half left empty): every draw is empty, NaN
            return rng.integers(0, max(m, 1), (b, m))
        parts = [np.flatnonzero(np.asarray(self.y) == c) for c in (0, 1)]
        return np.concatenate([p[rng.integers(0, len(p), (b, len(p)))] for p in parts if len(p)], 1)


def boot(runs: list[Items], b: int = N_BOOT, seed: int = 0) -> np.ndarray:
    """(b,) item-bootstrap replicates of the mean over runs of each run's metric (items redrawn inside every run;
    the runs themselves fixed: the interval of one run, or of these runs' items only)."""
    rng = np.random.default_rng(seed)
    per = np.stack([r.stat(r.resample(rng, b)) for r in runs])
    with warnings.catch_warnings():     # all-NaN runs (a run without items) are NaN here, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(per, 0)


def interval(reps: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    reps = reps[np.isfinite(reps)]
    if not len(reps):
        return float("nan"), float("nan")
    a = (1 - level) / 2
    return float(np.quantile(reps, a)), float(np.quantile(reps, 1 - a))


def t_interval(values, conf: float = LEVEL, strata=None) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n) of finite values: the Student-t interval of their mean (see the module doc for strata).
    One value: (v, nan, nan, 1)."""
    m, se, df, n = _mean_se(values, strata)
    if not n or not np.isfinite(se) or df < 1:
        return m, float("nan"), float("nan"), n
    from scipy.stats import t
    h = float(t.ppf(0.5 + conf / 2, df)) * se
    return m, m - h, m + h, n


def _mean_se(values, strata=None) -> tuple[float, float, float, int]:
    """(mean, its standard error, degrees of freedom, n) of the finite values, by strata when given."""
    v = np.asarray(values, float)
    st = np.zeros(len(v), int) if strata is None else np.asarray(strata)
    keep = np.isfinite(v)
    v, st = v[keep], st[keep]
    n = len(v)
    if not n:
        return float("nan"), float("nan"), 0.0, 0
    groups = [v[st == s] for s in dict.fromkeys(st.tolist())]
    if len(groups) > 1 and all(len(g) > 1 for g in groups):      # mean of stratum means, within-stratum variance
        k = len(groups)
        terms = np.array([g.var(ddof=1) / len(g) / k ** 2 for g in groups])
        se2 = terms.sum()
        dfs = np.array([len(g) - 1 for g in groups])
        df = se2 ** 2 / (terms ** 2 / dfs).sum() if se2 > 0 else float(dfs.sum())
        return float(np.mean([g.mean() for g in groups])), float(np.sqrt(se2)), float(df), n
    if n < 2:
        return float(v.mean()), float("nan"), 0.0, n
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(n)), float(n - 1), n


def t_test_p(values, strata=None) -> float:
    """Two-sided p-value of the t-test that the mean (over strata) of the values is 0 (nan with < 2 values)."""
    m, se, df, n = _mean_se(values, strata)
    if n < 2 or df < 1:
        return float("nan")
    if se == 0:
        return 1.0 if m == 0 else 0.0
    from scipy.stats import t
    return float(2 * t.sf(abs(m) / se, df))


def signflip_p(values, alternative: str = "two-sided") -> float:
    """Sign-flip p-value of the mean of paired differences: the share of sign patterns whose |mean| reaches the
    observed one (with ``alternative="greater"``, whose mean reaches it). Exact over all 2^n patterns up to n = 16;
    beyond, 2^16 random patterns and (hits + 1) / (2^16 + 1), which never reads 0."""
    d = np.asarray(values, float)
    d = d[np.isfinite(d)]
    n = len(d)
    if not n:
        return float("nan")
    exact = n <= 16
    signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1) if exact else \
        np.random.default_rng(0).choice([-1, 1], (2 ** 16, n))
    means = (signs * d).mean(1)
    hits = means >= d.mean() - 1e-12 if alternative == "greater" else np.abs(means) >= abs(d.mean()) - 1e-12
    return float(hits.mean()) if exact else float((hits.sum() + 1) / (len(hits) + 1))


LATE = 0.1   # the last 10% of a run's rounds: a run selected in them, or still rising through them, has not converged


def late_gain(curve: dict, late: float = LATE) -> float:
    """How much a training curve ({round: value} at its evaluated rounds) still gains at its end: the mean of its
    last ``late`` share of evaluations (at least one) minus the mean of as many evaluations before them (nan with
    fewer than two evaluations)."""
    v = [curve[t] for t in sorted(curve)]
    w = max(1, math.ceil(late * len(v)))
    return float(np.mean(v[-w:]) - np.mean(v[-2 * w:-w])) if len(v) >= 2 * w else float("nan")


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values (NaN entries stay NaN and do not count in the family)."""
    p = np.asarray(pvalues, float)
    out = np.full(len(p), np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    order = idx[np.argsort(p[idx], kind="stable")]
    m, run = len(order), 0.0
    for k, i in enumerate(order):
        run = max(run, min(1.0, (m - k) * p[i]))
        out[i] = run
    return out.tolist()


def compare(diffs, conf: float = LEVEL, strata=None, metric: str = "") -> dict:
    """A paired difference over runs of ``metric``: mean, Student-t interval, number of runs, t-test and sign-flip
    p-values, and the unadjusted call ("not testable" below MIN_RUNS runs; without a metric, never "not
    distinguishable"). Adjust a family's calls with ``holm_calls``."""
    m, lo, hi, n = t_interval(diffs, conf, strata)
    ps = signflip_p(diffs)
    d = np.asarray(diffs, float)
    # the t-test is undefined on differences without spread (it gives p = 0 at any n): the exact sign-flip then
    p = (ps if np.ptp(d[np.isfinite(d)]) == 0 else t_test_p(diffs, strata)) if n >= MIN_RUNS else float("nan")
    out = dict(mean=m, lo=lo, hi=hi, n=n, p=p, p_signflip=ps, metric=metric)
    return out | dict(call=call(p, n, lo, hi, margin_of(metric)))


def call(p: float, n: int, lo: float = float("nan"), hi: float = float("nan"), margin: float = float("nan")) -> str:
    """The call on an adjusted p-value of n paired runs whose difference has the 95% interval [lo, hi] (module doc):
    "not testable" below MIN_RUNS runs or without a p-value, "distinguishable" below FIRM, "borderline" below LOOSE,
    "not distinguishable" when [lo, hi] holds 0 and lies inside ±margin, else "inconclusive"."""
    if n < MIN_RUNS or not np.isfinite(p):
        return "not testable"
    if p < FIRM:
        return "distinguishable"
    if p < LOOSE:
        return "borderline"
    return "not distinguishable" if -margin < lo <= 0 <= hi < margin else "inconclusive"


def holm_calls(comparisons: list[dict], conf: float = LEVEL) -> list[dict]:
    """The comparisons (``compare``'s dicts, each with its ``metric``) with ``p_holm`` (Holm over the testable ones)
    and their calls made on it."""
    adj = holm([c["p"] for c in comparisons])
    return [c | dict(p_holm=a, call=call(a, c["n"], c["lo"], c["hi"], margin_of(c.get("metric", ""))))
            for c, a in zip(comparisons, adj)]


def estimate(runs: list[Items], seed: int = 0) -> tuple[float, float, float]:
    """(mean over runs, ci_low, ci_high): Student-t over the runs' values; one run: the item bootstrap."""
    if not runs:
        return float("nan"), float("nan"), float("nan")
    vals = np.array([r.stat() for r in runs], float)
    if np.isfinite(vals).sum() >= 2:
        return t_interval(vals)[:3]
    return (float(np.nanmean(vals)) if np.isfinite(vals).any() else float("nan"),) + interval(boot(runs, seed=seed))


def paired(a: list[Items], f: list[Items], seed: int = 0, metric: str = "") -> dict:
    """``compare`` of the per-run differences of a's metric minus f's (paired runs); one pair: the item
    bootstrap interval of the difference, "not testable"."""
    d = np.array([x.stat() - y.stat() for x, y in zip(a, f)], float)
    out = compare(d, metric=metric)
    if out["n"] == 1:
        rng = np.random.default_rng(seed)
        (x, y), = [(x, y) for x, y in zip(a, f) if np.isfinite(x.stat() - y.stat())]
        out["lo"], out["hi"] = interval(x.stat(x.resample(rng, N_BOOT)) - y.stat(y.resample(rng, N_BOOT)))
    return out


def paired_values(a: np.ndarray, f: np.ndarray, strata: np.ndarray | None = None, metric: str = "") -> dict:
    """``compare`` of paired per-unit values (e.g. accuracy per (target, seed)), stratified by ``strata``
    (targets): the mean over targets of the mean difference."""
    return compare(np.asarray(a, float) - np.asarray(f, float), strata=strata, metric=metric)


def half(ids: np.ndarray, salt: int = 0) -> np.ndarray:
    """Half (False = A, True = B) of each item id: a 64-bit mixing hash, so the same id lands in the same half."""
    return (_mix(ids, salt) & np.uint64(1)).astype(bool)


def _mix(ids: np.ndarray, salt: int = 0) -> np.ndarray:
    """A 64-bit mixing hash (splitmix64's finaliser) of each id, salted."""
    with np.errstate(over="ignore"):
        z = np.asarray(ids).astype(np.uint64) + np.uint64(salt) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def concat(parts: list[Items]) -> Items:
    """Several Items of one kind as one (ids and labels kept where every part has them)."""
    ids = None if any(p.ids is None for p in parts) else np.concatenate([p.ids for p in parts])
    y = None if any(p.y is None for p in parts) else np.concatenate([p.y for p in parts])
    return Items(parts[0].kind, np.concatenate([np.asarray(p.x, float) for p in parts]), y, ids)


def merge(parts: list[Items]) -> Items:
    """Items of tied outputs (``crossfit``) as one: per item id the mean of their values, so that an image scored by
    two tied outputs counts once; concatenated where an item has no id, and for "auc" (the scores of different outputs
    are not on one scale)."""
    it = concat(parts)
    if len(parts) == 1 or it.ids is None or it.kind == "auc":
        return it
    ids, first, inv = np.unique(it.ids, return_index=True, return_inverse=True)
    x = np.bincount(inv, weights=np.asarray(it.x, float)) / np.bincount(inv)
    return Items(it.kind, x, None if it.y is None else np.asarray(it.y)[first], ids)


def part(it: Items, salt: int, h: bool | None) -> Items:
    """The items of ``it`` on half ``h`` (False = A, True = B; ``half`` of their ids, positions without ids) salted by
    ``salt``; all of them for None."""
    if h is None:
        return it
    return it.sub(half(it.ids if it.ids is not None else np.arange(len(it)), salt) == h)


def crossfit(runs: dict, higher: bool = True, salts: dict | None = None) -> tuple[dict, str]:
    """Cross-fitted choice among candidates that measure one harm (module doc). ``runs``: {run: {candidate key:
    Items}}, the same keys (attack outputs) in every run; ``salts``: {run: salt} of the split. Every item goes to
    half A or B by a hash of its id salted by its run; the candidate strongest on the A items of all runs pooled
    scores every run's B items, the one strongest on B scores the A items, so every item counts once and no item
    scores the choice it was chosen on. Candidates tied for the strongest on a half (e.g. several outputs that
    re-identify every image of a small half) all score the other half, their values averaged (their items side by
    side), so a tie is not broken by the candidates' order. Returns ({run: [(candidate key, half)]}, how): half None
    and "single" for one candidate (all its items), else the half each key scores (``part``) and "crossfit". A run
    without the chosen candidates uses its first one."""
    keys = list(dict.fromkeys(k for cs in runs.values() for k in cs))
    salts = salts or {}
    if len(keys) == 1:
        return {run: [(keys[0], None)] for run in runs}, "single"
    best = {}
    for h in (False, True):   # the candidates chosen on half h (False = A) score the other half
        vals = []
        for k in keys:
            parts = [part(cs[k], salts.get(run, 0), h) for run, cs in runs.items() if k in cs]
            vals.append(float(concat(parts).stat()) if parts else np.nan)
        v = np.array(vals) * (1 if higher else -1)
        top = np.nanmax(v) if np.isfinite(v).any() else np.nan
        best[h] = [k for k, x in zip(keys, v) if x >= top - 1e-12] or keys[:1]
    return {run: [(k, h) for h in (False, True) for k in ([k for k in best[not h] if k in cs] or [next(iter(cs))])]
            for run, cs in runs.items()}, "crossfit"
