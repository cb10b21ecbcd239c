"""Membership / attribute inference metrics (attacks.md §1). NumPy in, NumPy or float out.

Convention: `scores` higher = more likely member; `labels` 1 = member, 0 = non-member.
To pool several target models, concatenate their scores and labels before calling.
"""

import warnings

import numpy as np
from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score, roc_curve


def _check(scores, labels):
    s, y = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(labels).ravel()
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in length: {s.shape} vs {y.shape}")
    if not np.isin(y, (0, 1)).all() or y.min() == y.max():
        raise ValueError("labels must be 0/1 and contain both members (1) and non-members (0)")
    return s, y.astype(int)


def roc(scores, labels):
    """(fpr, tpr, thresholds) of the score threshold test, every ROC point kept (no point dropping)."""
    s, y = _check(scores, labels)
    return roc_curve(y, s, drop_intermediate=False)


def auc(scores, labels):
    """Area under the ROC curve (0.5 = chance)."""
    s, y = _check(scores, labels)
    return float(roc_auc_score(y, s))


def resolvable(n_nonmembers, fpr):
    """Whether TPR at this FPR is measurable: it needs at least 1/fpr non-members (n·fpr >= 1).

    fpr == 0 ("no false positive at all") is always computable and is treated as resolvable;
    its meaning still depends on the number of non-members, so report that number with it.
    """
    return fpr == 0 or n_nonmembers * fpr >= 1 - 1e-9


def tpr_at_fpr(scores, labels, fpr, ties: str = "step"):
    """TPR of the best threshold whose empirical FPR does not exceed `fpr`.

    Walk the empirical ROC (one point per distinct score threshold), keep the points whose FPR is
    at most the target, and report the TPR of the last of them, i.e. the highest TPR reachable
    without going over the target FPR (the convention Privacy Meter uses). No interpolation.

    Resolution rule: if there are fewer than 1/fpr non-members, a single false positive already
    exceeds the target, so the number is not measurable and `nan` is returned (see `resolvable`).
    Pool target models to reach the needed number of non-members.

    ``ties = "interpolate"``: where tied scores leave no threshold with an FPR in (0, fpr] (e.g. calibrated
    quantiles of many small models), the TPR of random tie-breaking at exactly `fpr` (the ROC interpolated),
    where the step rule would read the TPR at FPR 0.
    """
    if ties not in ("step", "interpolate"):
        raise ValueError(f"ties = {ties!r}: use \"step\" or \"interpolate\"")
    s, y = _check(scores, labels)
    if not resolvable(int((y == 0).sum()), fpr):
        return float("nan")
    f, t, _ = roc_curve(y, s, drop_intermediate=False)
    if ties == "interpolate" and f[f > 0].min() > fpr + 1e-12:
        return float(np.interp(fpr, f, t))
    return float(t[f <= fpr + 1e-12].max())


MIN_POOL = 500   # members and non-members each: below this a membership cell is "not resolvable"


def hanley_mcneil_se(auc_value, n_members, n_nonmembers):
    """Standard error of an empirical AUC (Hanley & McNeil 1982) with n1 members and n0 non-members:
    Var = [A(1 - A) + (n1 - 1)(Q1 - A^2) + (n0 - 1)(Q2 - A^2)] / (n1 n0), Q1 = A / (2 - A), Q2 = 2 A^2 / (1 + A).
    At A = 0.5 it is sqrt((1/4 + (n1 + n0 - 2)/12) / (n1 n0))."""
    a, n1, n0 = np.asarray(auc_value, float), float(n_members), float(n_nonmembers)
    q1, q2 = a / (2 - a), 2 * a ** 2 / (1 + a)
    return np.sqrt((a * (1 - a) + (n1 - 1) * (q1 - a ** 2) + (n0 - 1) * (q2 - a ** 2)) / (n1 * n0))


def min_detectable_auc(n_members, n_nonmembers, alpha=0.05, power=0.8):
    """The smallest AUC that a one-sided test of AUC = 0.5 at level ``alpha`` detects with probability ``power``
    with this pool: the A in (0.5, 1] with A - 0.5 = z_(1-alpha) SE(0.5) + z_power SE(A), SE by Hanley-McNeil
    (``hanley_mcneil_se``), found by bisection (the left side grows faster than the right). 1.0 when even A = 1
    is not detectable, NaN without both classes. Example: 500 and 500 give about 0.545; 50 and 50 about 0.64."""
    if min(n_members, n_nonmembers) < 1:
        return float("nan")
    from scipy.stats import norm
    za, zb = norm.ppf(1 - alpha), norm.ppf(power)
    gap = lambda a: a - 0.5 - za * hanley_mcneil_se(0.5, n_members, n_nonmembers) \
        - zb * hanley_mcneil_se(a, n_members, n_nonmembers)  # noqa: E731
    lo, hi = 0.5, 1.0
    if gap(hi) < 0:
        return 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if gap(mid) >= 0 else (mid, hi)
    return float(hi)


def calibrate(scores, models):
    """Scores made comparable across target models before pooling: each model's scores (``models``: a key per
    score) replaced by their mid-rank quantile within that model, (rank - 1/2) / n. Label-free (it uses no
    membership), and a model's own ROC is unchanged; each candidate pool is half members, so quantiles of
    different models mean the same."""
    from scipy.stats import rankdata
    s, keys = np.asarray(scores, float).ravel(), np.asarray(models).ravel()
    out = np.empty_like(s)
    for k in np.unique(keys):
        sel = keys == k
        out[sel] = (rankdata(s[sel]) - 0.5) / sel.sum()
    return out


def balanced_accuracy(pred, true, n_classes=None):
    """Mean per-class recall over the classes present in `true` (sklearn's ``balanced_accuracy_score``).

    ``n_classes`` does not change the value (classes absent from `true` have no recall); it is kept for callers."""
    p, t = np.asarray(pred).ravel().astype(int), np.asarray(true).ravel().astype(int)
    with warnings.catch_warnings():   # predicted classes absent from `true` are expected (a guesser's mistakes)
        warnings.simplefilter("ignore", UserWarning)
        return float(balanced_accuracy_score(t, p))


def chance(n_classes):
    """Chance level of balanced accuracy: 1/K for K classes (any guesser that ignores the input)."""
    return 1.0 / n_classes


def existence_f1(pred_counts, true_counts):
    """F1 of "class is present" (count > 0), pooled over all entries (micro-F1 for (N, K) arrays; sklearn's
    ``f1_score``). Returns 1.0 when neither side has any present class.
    """
    p, t = np.asarray(pred_counts).ravel() > 0, np.asarray(true_counts).ravel() > 0
    return float(f1_score(t, p, zero_division=1.0))


def relative_error(est, true):
    """|est - true| / |true|, elementwise (e.g. dataset-size inference)."""
    est, true = np.asarray(est, dtype=np.float64), np.asarray(true, dtype=np.float64)
    return np.abs(est - true) / np.abs(true)


__all__ = [
    "roc", "auc", "resolvable", "tpr_at_fpr", "balanced_accuracy", "chance", "MIN_POOL", "hanley_mcneil_se",
    "min_detectable_auc", "calibrate",
    "existence_f1", "relative_error",
]
