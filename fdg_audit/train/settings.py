"""Checks of the training settings a method's Params carry (``participation``, ``cohort``), below the federation
that applies them, so the scenario parser refuses a bad setting before any run without importing the engine."""
from __future__ import annotations

import torch

from ..errors import UserError
from ..plugins import available, load


def check_participation(method, fraction: float, where: str = "participation") -> None:
    """``participation`` in (0, 1], and < 1 only for a method that declares ``partial_participation`` (else its
    ``participation_note`` says why not)."""
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"{where} = {fraction}: use a fraction in (0, 1], e.g. 0.1")
    if fraction < 1.0 and not method.partial_participation:
        ok = [n for n in sorted(available("method")) if getattr(load("method", n), "partial_participation", False)]
        raise UserError(f"method {method.name} does not support participation < 1 ({method.participation_note}): "
                        f"set {where} = 1.0, or "
                        f"use a method that does ({', '.join(ok)})")


def cohort_on(params) -> bool:
    mode = params.cohort
    if mode not in ("loop", "vmap", "auto"):
        raise UserError(f"cohort = {mode!r}: use \"loop\", \"vmap\" or \"auto\" (vmap when CUDA is present)")
    return mode == "vmap" or (mode == "auto" and torch.cuda.is_available())
