"""Empirical epsilon lower bounds from canary scores (docs/attacks.md §4): what the scorer does with an ``Audit``.

Inputs: one score per canary slot (higher = "inserted"), the truth ``member`` flags (each canary inserted
independently with probability 1/2) and the mechanism's delta. The bounds, each with confidence 95 %:

* ``eps_lb_one_run`` (Steinke, Nasr, Jagielski 2023): guess IN for the k highest and OUT for the k lowest scores,
  abstain on the rest; ε_lb = the largest ε whose one-run p-value is below beta (``metrics.one_run_eps``). k runs
  over a grid fixed in advance, {m/20, m/10, m/4, m/2} (rounded up, at least 1), with beta = 0.05 / 4 for each
  (Bonferroni), so the reported maximum is a valid bound, not a multiple-testing artefact. Its δ term (2 m δ)
  caps it near ln(r) however many canaries there are (≈ 4 with 256 canaries at δ = 1e-5).
* ``eps_lb_fdp`` (Mahloujifar, Melis, Chaudhuri 2024, "Auditing f-differential privacy in one run"): the same
  guesses, tested against the trade-off curve of the Gaussian mechanism that is exactly (ε, δ)-DP
  (``metrics.one_run_eps_fdp``); valid for mechanisms whose trade-off is Gaussian (every mechanism here adds
  Gaussian noise) and much tighter: 1,000 canaries reach ε ≈ 10 when every guess is right.
* ``eps_lb_ceiling``: the f-DP bound when every guess is right, the most m canaries can certify. A budget above
  it cannot be told from ε = ∞ by this audit: read every bound next to it.
  Neither one-run bound assumes the canaries independent (both allow adaptive composition over the canaries).
* ``eps_lb_cp`` (Jagielski et al. 2020): the canaries are split in two halves by index; on the first half the
  threshold maximizing the Clopper–Pearson bound is chosen, on the second half the test's false positives and
  negatives give ε_lb (``metrics.eps_lower_bound``, alpha = 0.05). It treats canary slots as independent trials,
  which holds for per-row mechanisms (independent noise per row): it is reported only for audits whose output
  says so (``Audit.independent``), not for canaries that share a release (update and gradient canaries).

Random guessing gives 0 for both (the ``baseline`` column). ``eps_theory`` is the accountant's ε of the audited
mechanism (from the envelope's accounting event), which a correct mechanism and a valid audit never exceed (up
to the 5 % failure probability).
"""
from __future__ import annotations

import math

import numpy as np

from .. import metrics as M
from ..errors import UserError

GRID = (20, 10, 4, 2)
BETA = 0.05


def guesses(scores, member) -> list[tuple[int, int, int]]:
    """(m, r, v) per k of the grid: IN for the k highest scores, OUT for the k lowest, r = 2k guesses, v right."""
    s, b = np.asarray(scores, float), np.asarray(member, bool)
    m = len(s)
    order = np.argsort(-s, kind="stable")
    out = []
    for div in GRID:
        k = min(m // 2, max(1, math.ceil(m / div)))
        if m >= 2:
            out.append((m, 2 * k, int(b[order[:k]].sum() + (~b[order[m - k:]]).sum())))
    return out


def one_run_bound(scores, member, delta: float, beta: float = BETA, fdp: bool = False) -> float:
    """The one-run ε lower bound, the largest over the grid (Bonferroni): Steinke et al.'s, or with ``fdp`` the f-DP
    one (Mahloujifar et al. 2024) against Gaussian trade-offs, tighter where the δ term caps Steinke's."""
    bound = M.one_run_eps_fdp if fdp else M.one_run_eps
    return max((bound(m, r, v, delta, beta=beta / len(GRID)) for m, r, v in guesses(scores, member)), default=0.0)


def ceiling(m: int, delta: float, fdp: bool = True) -> float:
    """The largest bound m canaries can give: every guess right (the audit cannot tell budgets above it apart)."""
    member = np.arange(m) % 2 == 0
    return one_run_bound(member.astype(float), member, delta, fdp=fdp)


def cp_bound(scores, member, delta: float, alpha: float = 0.05) -> float:
    s, b = np.asarray(scores, float), np.asarray(member, bool)
    h = len(s) // 2

    def bound(t, s, b):
        pred = s >= t
        return M.eps_lower_bound(int((pred & ~b).sum()), int((~b).sum()), int((~pred & b).sum()), int(b.sum()),
                                 delta, alpha)
    if h < 2 or b[:h].all() or (~b[:h]).all() or b[h:].all() or (~b[h:]).all():
        return 0.0
    ts = np.unique(s[:h])
    t = max(ts, key=lambda t: bound(t, s[:h], b[:h]))
    return bound(t, s[h:], b[h:])


def audit_rows(out, record: dict) -> list[dict]:
    """Scorer rows for an ``fdg_audit.api.attack.Audit`` output given its truth record (``member``)."""
    member = np.asarray(record["member"], bool)
    s = np.asarray(out.scores, float)
    if len(s) != len(member):
        raise UserError(f"the audit scored {len(s)} canaries but the run inserted {len(member)} slots: set the audit's "
                        f"canaries = {len(member)} (as in [privacy.audit])")
    row = lambda metric, value, baseline: dict(metric=metric, value=float(value), baseline=float(baseline))  # noqa: E731
    rows = [row("eps_lb_one_run", one_run_bound(s, member, out.delta), 0.0),
            row("eps_lb_fdp", one_run_bound(s, member, out.delta, fdp=True), 0.0),
            row("eps_lb_ceiling", ceiling(len(s), out.delta), float("nan")),
            row("eps_theory", out.epsilon, float("nan")),
            row("audit_auc", M.auc(s, member.astype(int)), 0.5)]
    if out.independent:   # Clopper-Pearson counts the canaries as independent trials: only where they are
        rows.append(row("eps_lb_cp", cp_bound(s, member, out.delta), 0.0))
    return rows
