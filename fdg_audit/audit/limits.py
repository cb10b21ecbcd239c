"""An attack worker's limits, the scenario's ``attack_timeout`` and ``attack_memory_gb``: their defaults and their
check, below the scenario parser (which checks them) and the worker and sandbox (which apply them)."""
from __future__ import annotations

from ..errors import UserError

LIMITS = dict(timeout=3600.0, memory_gb=8.0)   # defaults of the scenario's attack_timeout, attack_memory_gb


def check_limits(timeout, memory_gb, where: str = "scenario") -> tuple[float, float]:
    """``attack_timeout`` (seconds) and ``attack_memory_gb``: positive finite numbers, or a one-line error."""
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")  # noqa: E731
    if not num(timeout) or not num(memory_gb) or memory_gb < 0.25:
        raise UserError(f"{where}: attack_timeout = {timeout!r}, attack_memory_gb = {memory_gb!r}: give seconds > 0 "
                        "and gigabytes >= 0.25 (defaults 3600 and 8)")
    return float(timeout), float(memory_gb)
