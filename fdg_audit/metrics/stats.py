"""Uncertainty for the scorecard: per-item values, a two-stage bootstrap, paired differences, held-out selection.

An ``Items`` holds one attack output's per-item values (images, candidates, rows, or victims for estimates) and
computes its metric on any resample of them, vectorised over bootstrap replicates:
  * ``"mean"``: the mean of per-item values (per-image PSNR / SSIM, success indicators, correct labels);
  * ``"auc"``: ROC AUC of scores ``x`` against labels ``y`` (rank formula, ties count 1/2; NaN if a class is
    missing from the resample);
  * ``"balanced_acc"``: mean per-class recall of correctness ``x`` (0/1) by true class ``y`` over the classes
    present in the resample.

Interval (``estimate``, ``paired``): the statistic of a cell is the mean over runs (targets x seeds) of each run's
metric. A replicate redraws the items of every run with replacement (stratified by label for "auc") and
recomputes each run's metric, averages over runs, and adds the runs' own effects redrawn with replacement:
each run's deviation from the mean, shrunk so that its variance is the between-run variance left after removing
the item noise (the sample variance of the run values minus the mean item-bootstrap variance; Davison & Hinkley
1997, §3.8). So with seeds that agree the interval is the item bootstrap, and seeds that disagree widen it. The
95% interval is the 2.5 / 97.5 percentiles of 2000 replicates. With 3 runs the between-run part rests on 3
values: read it as indicative.

Held-out selection (``heldout``): several candidates (victim x round x attack x output) measure the same harm in
one run; the maximum over them is biased upwards. Each item is assigned to half A or B by a hash of its id (the
same image / candidate gets the same half in every candidate that holds it), the strongest candidate on A is
chosen, and its metric on B is reported; a baseline is chosen and scored the same way on its own values.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
N_BOOT = 2000


@dataclass
class Items:
    kind: str                       # "mean" | "auc" | "balanced_acc"
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
        if self.kind == "mean":     # no items: NaN, without numpy's empty-slice warning
            return x.mean(-1) if x.shape[-1] else np.full(x.shape[:-1], np.nan)
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
        if self.kind != "auc":
            return rng.integers(0, m, (b, m))
        parts = [np.flatnonzero(np.asarray(self.y) == c) for c in (0, 1)]
        return np.concatenate([p[rng.integers(0, len(p), (b, len(p)))] for p in parts if len(p)], 1)


def _replicates(per: np.ndarray, point: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(b,) replicates of the mean over runs from each run's item-bootstrap replicates ``per`` (R, b) and its
    point value ``point`` (R,): items are redrawn inside every run, and the runs' own effects (shrunk to the
    between-run variance left after removing the item noise) are redrawn with replacement."""
    R, b = per.shape
    with warnings.catch_warnings():     # all-NaN runs (a run without items) are NaN here, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        reps = np.nanmean(per, 0)
        within = float(np.nanmean(np.nanvar(per, 1))) if R > 1 else 0.0
    if R > 1:
        e = point - point.mean()
        s2 = e.var(ddof=1)
        sb2 = max(0.0, s2 - within)           # between-run variance
        if s2 > 0 and sb2 > 0:
            e = e * np.sqrt(sb2 / s2 * R / (R - 1))
            reps = reps + e[rng.integers(0, R, (b, R))].mean(1)
    return reps


def boot(runs: list[Items], b: int = N_BOOT, seed: int = 0) -> np.ndarray:
    """(b,) bootstrap replicates of the mean over runs of each run's metric (see the module doc)."""
    rng = np.random.default_rng(seed)
    per = np.stack([r.stat(r.resample(rng, b)) for r in runs])
    return _replicates(per, np.array([r.stat() for r in runs], float), rng)


def interval(reps: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    reps = reps[np.isfinite(reps)]
    if not len(reps):
        return float("nan"), float("nan")
    a = (1 - level) / 2
    return float(np.quantile(reps, a)), float(np.quantile(reps, 1 - a))


def estimate(runs: list[Items], seed: int = 0) -> tuple[float, float, float]:
    """(mean over runs, ci_low, ci_high)."""
    if not runs:
        return float("nan"), float("nan"), float("nan")
    return (float(np.nanmean([r.stat() for r in runs])),) + interval(boot(runs, seed=seed))


def paired(a: list[Items], f: list[Items], seed: int = 0) -> tuple[float, float, float]:
    """Mean over paired runs of a's metric minus f's, with its interval (items redrawn in both, the per-run
    differences' own effects redrawn as in ``boot``)."""
    if not a:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    per = np.stack([x.stat(x.resample(rng, N_BOOT)) - y.stat(y.resample(rng, N_BOOT)) for x, y in zip(a, f)])
    point = np.array([x.stat() - y.stat() for x, y in zip(a, f)], float)
    return (float(np.nanmean(point)),) + interval(_replicates(per, point, rng))


def paired_values(a: np.ndarray, f: np.ndarray, strata: np.ndarray | None = None, seed: int = 0
                  ) -> tuple[float, float, float]:
    """Paired difference of per-unit values (e.g. accuracy per (target, seed)): the mean over strata (targets) of
    the mean difference, and a bootstrap interval that redraws units within each stratum (seeds within targets)."""
    d = np.asarray(a, float) - np.asarray(f, float)
    strata = np.zeros(len(d), int) if strata is None else np.asarray(strata)
    groups = [np.flatnonzero(strata == s) for s in dict.fromkeys(strata.tolist())]
    rng = np.random.default_rng(seed)
    reps = np.mean([d[g][rng.integers(0, len(g), (N_BOOT, len(g)))].mean(1) for g in groups], 0)
    return (float(np.mean([d[g].mean() for g in groups])),) + interval(reps)


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


def heldout(cands: list[Items], higher: bool = True, salt: int = 0) -> tuple[int, Items, str]:
    """(index of the chosen candidate, its items on half B, "heldout") for several candidates; the only
    candidate with all its items and "single" for one. The choice is the strongest metric on half A.

    Few items (e.g. estimates, whose items are the victims): when the hash leaves a half empty, the distinct ids
    are ranked by their hash and alternate between the halves ("heldout-ranked"); with a single item no split is
    possible and nothing is chosen on data: the candidates' values are averaged ("mean", per-item "mean" kinds),
    else the first candidate in the harness's order is taken ("first")."""
    if len(cands) == 1:
        return 0, cands[0], "single"
    cands = [c if c.ids is not None else Items(c.kind, c.x, c.y, np.arange(len(c))) for c in cands]
    ids = np.unique(np.concatenate([c.ids for c in cands]))
    inb = half(ids, salt)
    how = "heldout"
    if inb.all() or not inb.any():
        if len(ids) < 2:
            if all(c.kind == "mean" for c in cands):
                return 0, Items("mean", np.array([np.mean([c.stat() for c in cands])]), ids=ids[:1]), "mean"
            return 0, cands[0], "first"
        inb = np.zeros(len(ids), bool)
        inb[np.argsort(_mix(ids, salt), kind="stable")[1::2]] = True
        how = "heldout-ranked"
    split = lambda c: inb[np.searchsorted(ids, c.ids)]  # noqa: E731  (half of each of c's items)
    best, best_v = 0, None
    for i, c in enumerate(cands):
        a = c.sub(~split(c))
        v = a.stat() if len(a) else np.nan
        if np.isfinite(v) and (best_v is None or (v > best_v if higher else v < best_v)):
            best, best_v = i, v
    c = cands[best]
    return best, c.sub(split(c)), how
