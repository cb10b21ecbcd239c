"""The DP mechanisms a plugin may use (a method that privatises its own artifact, an attack that audits a
mechanism): re-exported from fdg_audit.privacy, the only privacy names plugins import."""
from __future__ import annotations

from ..privacy import ArtifactMechanism, AuditConfig, ClientDP, PrivacyConfig, epsilon, new_accountant, per_sample  # noqa: F401
from ..privacy.artifacts import GaussianRows  # noqa: F401
from ..privacy.audit import one_run_bound  # noqa: F401
from ..privacy.canaries import canary_images  # noqa: F401
from ..privacy.client_dp import UPDATE_KINDS, ClientDPFilter, canary_coins, update_canaries  # noqa: F401
from ..privacy.dpsgd import dp_fit, gradient_canary_coordinates  # noqa: F401
