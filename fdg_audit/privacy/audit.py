"""Empirical epsilon lower bounds from canary scores (attacks.md §4): what the scorer does with an ``Audit``.

Inputs: one score per canary slot (higher = "inserted"), the truth ``member`` flags (each canary inserted
independently with probability 1/2) and the mechanism's delta. Two bounds, both with confidence 95 %:

* ``eps_lb_one_run`` (Steinke, Nasr, Jagielski 2023): guess IN for the k highest and OUT for the k lowest scores,
  abstain on the rest; ε_lb = the largest ε whose one-run p-value is below beta (``metrics.one_run_eps``). k runs
  over a grid fixed in advance, {m/20, m/10, m/4, m/2} (rounded up, at least 1), with beta = 0.05 / 4 for each
  (Bonferroni), so the reported maximum is a valid bound, not a multiple-testing artefact.
* ``eps_lb_cp`` (Jagielski et al. 2020): the canaries are split in two halves by index; on the first half the
  threshold maximizing the Clopper–Pearson bound is chosen, on the second half the test's false positives and
  negatives give ε_lb (``metrics.eps_lower_bound``, alpha = 0.05). It treats canary slots as independent trials,
  which holds for per-row mechanisms (independent noise per row).

Random guessing gives 0 for both (the ``baseline`` column). ``eps_theory`` is the accountant's ε of the audited
mechanism (from the envelope's accounting event), which a correct mechanism and a valid audit never exceed (up
to the 5 % failure probability).
"""
from __future__ import annotations

import math

import numpy as np

from .. import metrics as M

GRID = (20, 10, 4, 2)
BETA = 0.05


def one_run_bound(scores, member, delta: float, beta: float = BETA) -> float:
    s, b = np.asarray(scores, float), np.asarray(member, bool)
    m = len(s)
    order = np.argsort(-s, kind="stable")
    best = 0.0
    for div in GRID:
        k = min(m // 2, max(1, math.ceil(m / div)))
        if k < 1:
            continue
        v = int(b[order[:k]].sum() + (~b[order[m - k:]]).sum())
        best = max(best, M.one_run_eps(m, 2 * k, v, delta, beta=beta / len(GRID)))
    return best


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
    from ..errors import UserError
    member = np.asarray(record["member"], bool)
    s = np.asarray(out.scores, float)
    if len(s) != len(member):
        raise UserError(f"the audit scored {len(s)} canaries but the run inserted {len(member)} slots: set the audit's "
                        f"canaries = {len(member)} (as in [privacy.audit])")
    row = lambda metric, value, baseline: dict(metric=metric, value=float(value), baseline=float(baseline))  # noqa: E731
    return [row("eps_lb_one_run", one_run_bound(s, member, out.delta), 0.0),
            row("eps_lb_cp", cp_bound(s, member, out.delta), 0.0),
            row("eps_theory", out.epsilon, float("nan")),
            row("audit_auc", M.auc(s, member.astype(int)), 0.5)]
