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


def tpr_at_fpr(scores, labels, fpr):
    """TPR of the best threshold whose empirical FPR does not exceed `fpr`.

    Walk the empirical ROC (one point per distinct score threshold), keep the points whose FPR is
    at most the target, and report the TPR of the last of them, i.e. the highest TPR reachable
    without going over the target FPR (the convention Privacy Meter uses). No interpolation.

    Resolution rule: if there are fewer than 1/fpr non-members, a single false positive already
    exceeds the target, so the number is not measurable and `nan` is returned (see `resolvable`).
    Pool target models to reach the needed number of non-members.
    """
    s, y = _check(scores, labels)
    if not resolvable(int((y == 0).sum()), fpr):
        return float("nan")
    f, t, _ = roc_curve(y, s, drop_intermediate=False)
    return float(t[f <= fpr + 1e-12].max())


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
    "roc", "auc", "resolvable", "tpr_at_fpr", "balanced_accuracy", "chance",
    "existence_f1", "relative_error",
]
