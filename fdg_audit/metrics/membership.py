"""Membership / attribute inference metrics (docs/attacks.md §1). NumPy in, NumPy or float out.

Convention: `scores` higher = more likely member; `labels` 1 = member, 0 = non-member.
To pool several target models, concatenate their scores and labels before calling.
"""

import warnings

import numpy as np
# sklearn.metrics is imported where it is used: with scipy it costs about a second at import, which every attack
# worker (a fresh interpreter per job under bubblewrap) paid whether it scores membership or not


def _check(scores, labels):
    s, y = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(labels).ravel()
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in length: {s.shape} vs {y.shape}")
    if not np.isin(y, (0, 1)).all() or y.min() == y.max():
        raise ValueError("labels must be 0/1 and contain both members (1) and non-members (0)")
    return s, y.astype(int)


def roc(scores, labels):
    """(fpr, tpr, thresholds) of the score threshold test, every ROC point kept (no point dropping)."""
    from sklearn.metrics import roc_curve
    s, y = _check(scores, labels)
    return roc_curve(y, s, drop_intermediate=False)


def auc(scores, labels):
    """Area under the ROC curve (0.5 = chance)."""
    from sklearn.metrics import roc_auc_score
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
    f, t, _ = roc(s, y)
    return _read(f, t, fpr, ties)


def _read(f, t, fpr, ties):
    """``tpr_at_fpr``'s reading of one empirical ROC (fpr ``f``, tpr ``t``, from (0, 0) up)."""
    if ties == "interpolate" and f[f > 0].min() > fpr + 1e-12:
        return float(np.interp(fpr, f, t))
    return float(t[f <= fpr + 1e-12].max())


def tpr_interval(scores, labels, groups, fpr, ties: str = "step", b: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``tpr_at_fpr`` under the cluster bootstrap: ``b`` times, draw as many target models
    (``groups``, one per candidate) with replacement as the pool has, with all their candidates. Candidates of one
    model share its calibration and its training, so they are resampled together; (nan, nan) where the TPR itself is
    not measurable. A replicate that draws no member or no non-member is skipped. The scores are sorted once: a
    replicate is the pool with each candidate counted as often as its model was drawn, so its ROC is read off
    weighted cumulative sums at the distinct scores (the points ``roc_curve`` gives), blocks of replicates at a
    time."""
    s, y = _check(scores, labels)
    if not np.isfinite(tpr_at_fpr(s, y, fpr, ties)):
        return float("nan"), float("nan")
    o = np.argsort(-s, kind="stable")
    s, y, g = s[o], y[o], np.unique(np.asarray(groups)[o], return_inverse=True)[1]
    ends, k = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1], g.max() + 1   # the last candidate of each distinct score
    picks, vals = np.random.default_rng(seed).integers(0, k, (b, k)), []
    for block in np.array_split(picks, max(1, b * len(s) // 2_000_000)):
        drawn = np.bincount((np.arange(len(block))[:, None] * k + block).ravel(), minlength=len(block) * k)
        w = drawn.reshape(len(block), k)[:, g]                              # times each candidate is drawn
        for tp, fp in zip(np.cumsum(w * y, 1)[:, ends], np.cumsum(w * (1 - y), 1)[:, ends]):
            if tp[-1] and fp[-1] and resolvable(int(fp[-1]), fpr):
                vals.append(_read(np.r_[0.0, fp / fp[-1]], np.r_[0.0, tp / tp[-1]], fpr, ties))
    if not vals:
        return float("nan"), float("nan")
    return tuple(float(v) for v in np.quantile(vals, [(1 - level) / 2, (1 + level) / 2]))


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


def auc_ci(scores, labels, level=0.95):
    """(AUC, low, high): the empirical AUC with DeLong's interval (DeLong et al. 1988, by midranks as in Sun & Xu
    2014): Var = Var(V10)/n1 + Var(V01)/n0 over the members' and non-members' placement values (the share of the
    other class each one outranks, ties counted half); the interval is cut to [0, 1]. It degenerates to a point at
    AUC 0 or 1 and is anti-conservative for a handful of items (n1 or n0 below ~20)."""
    from scipy.stats import norm, rankdata
    s, y = _check(scores, labels)
    pos, neg = s[y == 1], s[y == 0]
    n1, n0 = len(pos), len(neg)
    both = rankdata(np.r_[pos, neg])
    v10 = (both[:n1] - rankdata(pos)) / n0          # per member: share of non-members below it
    v01 = 1 - (both[n1:] - rankdata(neg)) / n1      # per non-member: share of members above it
    a = float(v10.mean())
    se = np.sqrt((v10.var(ddof=1) if n1 > 1 else 0.0) / n1 + (v01.var(ddof=1) if n0 > 1 else 0.0) / n0)
    z = norm.ppf(0.5 + level / 2)
    return a, float(max(0.0, a - z * se)), float(min(1.0, a + z * se))


def victim_spread(per_victim: dict, baseline=0.5, level=0.95) -> dict:
    """How a membership attack spreads over victims: ``per_victim`` {victim: (scores, labels)} of one target model
    each; ``baseline`` a number or {victim: number} (e.g. max(0.5, blind AUC)). Returns ``victims`` {victim: (auc,
    low, high)} (``auc_ci``), their ``median``, ``min`` and ``max`` AUC, and ``share_clear``: the share of victims
    whose own interval lies wholly above their baseline."""
    ci = {v: auc_ci(s, y, level) for v, (s, y) in per_victim.items()}
    if not ci:
        raise ValueError("victim_spread needs at least one victim")
    base = baseline if isinstance(baseline, dict) else {v: baseline for v in ci}
    a = np.array([c[0] for c in ci.values()])
    return dict(victims=ci, median=float(np.median(a)), min=float(a.min()), max=float(a.max()),
                share_clear=float(np.mean([c[1] > base[v] for v, c in ci.items()])))


def blind_features(x, y, n_classes=None) -> np.ndarray:
    """What a model-free classifier sees of a candidate: its raw pixels, flattened, and its one-hot class label."""
    x = np.asarray(x, np.float32).reshape(len(x), -1)
    y = np.asarray(y).astype(int).ravel()
    k = max(int(n_classes or 0), int(y.max()) + 1)
    return np.hstack([x, np.eye(k, dtype=np.float32)[y]])


BLIND_CLASSIFIERS = ("logistic", "knn")


def blind_scores(x, y, is_member, seed=0, folds=5, n_classes=None) -> dict:
    """Out-of-fold member scores of each model-free classifier of member vs non-member on the candidates alone
    (``blind_features``; no model): {name: scores}. ``logistic``: L2 logistic regression (C = 0.01) on
    standardised features; ``knn``: share of members among the 15 nearest candidates in Euclidean distance on the
    raw features. Stratified ``folds``-fold cross-validation (fewer folds when a class has fewer candidates): each
    candidate is scored by classifiers that never saw it."""
    import warnings
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    f = blind_features(x, y, n_classes)
    _, m = _check(np.zeros(len(f)), is_member)
    k = min(folds, int(m.sum()), int((1 - m).sum()))
    if k < 2:
        raise ValueError("blind_scores needs at least 2 members and 2 non-members")
    out = {name: np.zeros(len(f)) for name in BLIND_CLASSIFIERS}
    for tr, te in StratifiedKFold(k, shuffle=True, random_state=seed).split(f, m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            lr = make_pipeline(StandardScaler(), LogisticRegression(C=0.01, max_iter=300)).fit(f[tr], m[tr])
        out["logistic"][te] = lr.predict_proba(f[te])[:, 1]
        out["knn"][te] = KNeighborsClassifier(min(15, len(tr))).fit(f[tr], m[tr]).predict_proba(f[te])[:, 1]
    return out


def blind_auc(x, y, is_member, seed=0, folds=5, n_classes=None) -> float:
    """The blind baseline of a membership pool: the best out-of-fold AUC of the model-free classifiers of
    ``blind_scores`` (candidates' images and labels only, no access to any model). Near 0.5 when members and
    non-members are exchangeable; above it when they differ in anything but membership (class balance, domain,
    preprocessing), which an attack would then read without leaking anything. Taking the larger of the two
    AUCs is optimistic (at chance by at most about 0.56 of the AUC's standard error, the expected maximum of two
    independent ones): the baseline errs high, so a cell judged against it errs towards "no leak"."""
    _, m = _check(np.zeros(len(np.asarray(is_member).ravel())), is_member)
    return max(auc(s, m) for s in blind_scores(x, y, m, seed, folds, n_classes).values())


def balanced_accuracy(pred, true, n_classes=None):
    """Mean per-class recall over the classes present in `true` (sklearn's ``balanced_accuracy_score``).

    ``n_classes`` does not change the value (classes absent from `true` have no recall); it is kept for callers."""
    p, t = np.asarray(pred).ravel().astype(int), np.asarray(true).ravel().astype(int)
    with warnings.catch_warnings():   # predicted classes absent from `true` are expected (a guesser's mistakes)
        warnings.simplefilter("ignore", UserWarning)
        from sklearn.metrics import balanced_accuracy_score
        return float(balanced_accuracy_score(t, p))


def chance(n_classes):
    """Chance level of balanced accuracy: 1/K for K classes (any guesser that ignores the input)."""
    return 1.0 / n_classes


def existence_f1(pred_counts, true_counts):
    """F1 of "class is present" (count > 0), pooled over all entries (micro-F1 for (N, K) arrays; sklearn's
    ``f1_score``). Returns 1.0 when neither side has any present class.
    """
    p, t = np.asarray(pred_counts).ravel() > 0, np.asarray(true_counts).ravel() > 0
    from sklearn.metrics import f1_score
    return float(f1_score(t, p, zero_division=1.0))


def relative_error(est, true):
    """|est - true| / |true|, elementwise (e.g. dataset-size inference)."""
    est, true = np.asarray(est, dtype=np.float64), np.asarray(true, dtype=np.float64)
    return np.abs(est - true) / np.abs(true)


__all__ = [
    "roc", "auc", "resolvable", "tpr_at_fpr", "tpr_interval", "balanced_accuracy", "chance", "MIN_POOL",
    "hanley_mcneil_se", "min_detectable_auc", "calibrate", "auc_ci", "victim_spread", "blind_features",
    "blind_scores", "blind_auc",
    "existence_f1", "relative_error",
]
