"""The attack plugin contract, as an attack plugin imports it (with ``fdg_audit.api``): the classes and
vocabulary of fdg_audit/attack.py, whose module docstring is the contract, and ``federate`` (shadow runs,
fdg_audit/audit/shadow.py). attacks/README.md is the how-to."""
from __future__ import annotations

from ..attack import (ADVERSARIES, AUX, CAPABILITIES, IMPLIED, ORACLE, PRIORS, AdversaryView, Attack,  # noqa: F401
                      AttackParams, Audit, Aux, Control, Estimate, Merged, Message, Predictions, Reconstruction,
                      Scores, Skipped, load_attack, merged_states, sample_victims, view_envelopes)


def federate(*args, **kwargs) -> AdversaryView:
    """A shadow run (``fdg_audit.audit.shadow.federate``, same arguments): the training engine it runs on is
    imported on the first call, so an attack that trains no shadow federation does not load it."""
    from ..audit.shadow import federate as shadow_run
    return shadow_run(*args, **kwargs)
