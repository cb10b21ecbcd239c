"""Empirical ε lower bounds for DP audits (docs/attacks.md §1 and §4.1). Plain floats in and out."""

import numpy as np
# scipy.stats is imported where it is used: it costs most of a second at import, which every attack worker (a fresh
# interpreter per job under bubblewrap) paid whether it audits DP or not


def clopper_pearson_upper(k, n, alpha):
    """One-sided Clopper–Pearson upper bound on a rate from k events in n trials, confidence 1 - alpha.

    Beta(1 - alpha; k + 1, n - k) quantile; 1.0 when k == n (nothing bounds it below 1).
    """
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    from scipy.stats import beta
    return 1.0 if k == n else float(beta.ppf(1 - alpha, k + 1, n - k))


def eps_lower_bound(fp, n_neg, fn, n_pos, delta=0.0, alpha=0.05):
    """ε lower bound from a binary test's error counts, holding with confidence 1 - alpha.

    fp false positives out of n_neg trials on D⁰, fn false negatives out of n_pos trials on D¹.
    Each rate gets a Clopper–Pearson upper bound at confidence 1 - alpha/2 (union bound), and
    (ε, δ)-DP forces FPR + e^ε·FNR >= 1 - δ and FNR + e^ε·FPR >= 1 - δ, so
    ε_lb = max(ln((1 - δ - FPR_ub)/FNR_ub), ln((1 - δ - FNR_ub)/FPR_ub)), clamped at 0
    (a non-positive numerator also gives 0).
    """
    fpr = clopper_pearson_upper(fp, n_neg, alpha / 2)
    fnr = clopper_pearson_upper(fn, n_pos, alpha / 2)
    best = 0.0
    for num, den in ((1 - delta - fpr, fnr), (1 - delta - fnr, fpr)):
        if num > 0:
            best = max(best, float(np.log(num / den)))
    return best


def one_run_p_value(m, r, v, eps, delta):
    """p-value of >= v correct guesses out of r under (ε, δ)-DP, m canaries (Steinke et al. 2023).

    With q = e^ε/(1 + e^ε), W ~ Binomial(r, q):
    p = P[W >= v] + 2·m·δ·max_{1<=i<=v} P[v - i <= W <= v - 1] / i, capped at 1.
    The first term is the pure ε-DP bound (each guess no better than ε-randomized response); the
    second is the paper's δ correction, which is what Privacy Meter's `p_value_DP_audit` computes.
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    from scipy.special import expit
    from scipy.stats import binom
    q = expit(eps)
    p = binom.sf(v - 1, r, q)
    if delta > 0 and v > 0:
        below = np.cumsum(binom.pmf(np.arange(v - 1, -1, -1), r, q))  # i-th entry: P[v-i <= W <= v-1]
        p += 2 * m * delta * (below / np.arange(1, v + 1)).max()
    return float(min(p, 1.0))


def one_run_eps(m, r, v, delta, beta=0.05, tol=1e-6):
    """Largest ε whose one-run p-value (see `one_run_p_value`) is below beta: the ε lower bound.

    m canaries each included w.p. ½; the auditor makes r guesses (abstaining on the rest) of which
    v are right. The p-value grows with ε, so ε is bracketed by doubling and then bisected to
    `tol`; the returned value is the lower end, i.e. still rejected. Returns 0.0 when even ε = 0
    cannot be rejected. Use δ = the training δ and beta = 0.05 (docs/attacks.md §4.2).
    """
    below = lambda e: one_run_p_value(m, r, v, e, delta) < beta  # noqa: E731
    if not below(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while below(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if below(mid) else (lo, mid)
    return lo




def gaussian_delta(eps, sigma):
    """δ(ε) of the Gaussian mechanism with noise multiplier sigma (sensitivity 1; Balle & Wang 2018, Thm. 8):
    Φ(1/(2σ) - εσ) - e^ε Φ(-1/(2σ) - εσ)."""
    from scipy.stats import norm
    a = 1 / (2 * sigma)
    return float(norm.cdf(a - eps * sigma) - np.exp(eps) * norm.cdf(-a - eps * sigma))


def gaussian_sigma(eps, delta):
    """The smallest noise multiplier whose Gaussian mechanism is (ε, δ)-DP (the inverse of ``gaussian_delta``)."""
    from scipy.optimize import brentq
    lo, hi = 1e-3, 1.0
    while gaussian_delta(eps, hi) > delta:
        hi *= 2
    if gaussian_delta(eps, lo) <= delta:
        return lo
    return float(brentq(lambda s: gaussian_delta(eps, s) - delta, lo, hi, xtol=1e-10))


def one_run_fdp_rejects(m, r, v, eps, delta, beta=0.05):
    """Whether r guesses with v right out of m canaries reject, at level beta, the Gaussian trade-off curve of the
    mechanism that is exactly (ε, δ)-DP (Mahloujifar et al. 2024, "Auditing f-differential privacy in one run",
    the recursion on the guesses with the cap at 1). Every mechanism that is (ε, δ)-DP through a Gaussian
    trade-off is at least as private, so a rejection falsifies the claim ``ε`` for it."""
    from scipy.stats import norm
    mu = 1 / gaussian_sigma(eps, delta)
    back = lambda x: norm.cdf(norm.ppf(x) - mu)  # noqa: E731  (the inverse blow-up of the trade-off)
    right, wrong = beta * v / m, beta * (r - v) / m
    for i in range(v - 1, -1, -1):
        new = max(wrong, back(right))
        if new == wrong:
            break
        right, wrong = min(right + i / (r - i) * (new - wrong), 1.0), new
    return right + wrong - r / m > 0


def one_run_eps_fdp(m, r, v, delta, beta=0.05, tol=1e-4):
    """Largest ε whose Gaussian (ε, δ) claim ``one_run_fdp_rejects`` rejects: the f-DP one-run ε lower bound; 0.0
    when none is rejected. Tighter than ``one_run_eps``, whose δ term caps it near ln(r) for m δ near 1."""
    below = lambda e: one_run_fdp_rejects(m, r, v, e, delta, beta)  # noqa: E731
    if v == 0 or not below(1e-3):
        return 0.0
    lo, hi = 1e-3, 1.0
    while below(hi):
        lo, hi = hi, 2 * hi
        if hi > 200:
            return lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if below(mid) else (lo, mid)
    return lo


__all__ = ["clopper_pearson_upper", "eps_lower_bound", "one_run_p_value", "one_run_eps", "gaussian_delta",
           "gaussian_sigma", "one_run_fdp_rejects", "one_run_eps_fdp"]
