"""Typed configuration pieces every layer shares: ``typed`` (dataclass from a TOML table, one-line errors),
``TrainParams`` (the hyperparameters every method shares), ``make_optimizer`` and ``resolve_device``.

This module imports nothing else of the core, so the scenario, the federation and privacy can all use it
without importing each other.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from .errors import UserError


def _names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def typed(cls, raw: dict, where: str):
    """Build dataclass ``cls`` from ``raw``; unknown keys and wrong types are one-line errors."""
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a table, got {raw!r}")
    allowed = _names(cls)
    bad = [k for k in raw if k not in allowed]
    if bad:
        raise UserError(f"unknown key {where}.{bad[0]}: allowed keys are {', '.join(allowed)}")
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        v, default = raw[f.name], getattr(cls, f.name, None) if f.default is not dataclasses.MISSING else None
        if f.type in ("Any", Any):
            pass
        elif isinstance(default, bool) and not isinstance(v, bool) or \
                isinstance(default, (int, float)) and not isinstance(default, bool) and \
                (isinstance(v, bool) or not isinstance(v, (int, float))) or \
                isinstance(default, str) and not isinstance(v, str) or \
                type(default) is int and isinstance(v, float):
            raise UserError(f"{where}.{f.name} = {v!r} has the wrong type: expected {type(default).__name__} "
                            f"like the default {default!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{where}.{f.name} = {v!r} is not a finite number: give a finite value like the default "
                            f"{default!r}")
        out[f.name] = float(v) if isinstance(default, float) and not isinstance(v, bool) else v
    try:
        return cls(**out)
    except TypeError as e:
        raise UserError(f"{where}: {e}") from None


@dataclass
class TrainParams:
    """Hyperparameters every method shares; a method's Params dataclass extends this."""
    rounds: int = 10
    local_epochs: int = 1
    local_steps: int = 0          # > 0: this many SGD steps per round instead of local_epochs
    batch_size: int = 32
    lr: float = 0.01
    optimizer: str = "sgd"        # sgd | adam
    momentum: float = 0.9
    weight_decay: float = 5e-4
    participation: float = 1.0    # fraction of clients asked each training round (seeded sample; fdg_audit.train.federation)
    cohort: str = "loop"          # loop | vmap (clients trained as one stacked model, fdg_audit.train.cohort) | auto (vmap on CUDA)
    eval_every: int = 1           # the harness evaluates the global model every k rounds (and after the last)


def make_optimizer(p: TrainParams, params) -> torch.optim.Optimizer:
    if p.optimizer == "adam":
        return torch.optim.Adam(params, lr=p.lr, weight_decay=p.weight_decay)
    return torch.optim.SGD(params, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)


SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+|[A-Za-z0-9_.]+:[A-Za-z0-9_]+")   # labels and names that become path
                                                                          # parts (or a "module:Class" name)
MAX_ROUNDS = 100_000


def safe_name(value, where: str) -> str:
    """``value`` if it is a safe path part (letters, digits, ``_.-``, not ``.`` or ``..``), else a one-line error."""
    if not isinstance(value, str) or len(value) > 200 or not SAFE_NAME.fullmatch(value) or set(value) == {"."} \
            or ".." in value:
        raise UserError(f"{where[:120]} = {repr(value)[:80]}: use 1 to 200 letters, digits and _ . - only (it names "
                        "files and folders)")
    return value


def resolve_device(name: str) -> str:
    if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", name):
        raise UserError(f"device = {name!r}: use \"auto\" (CUDA when present), \"cpu\", \"cuda\" or \"cuda:N\"")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device = {name!r} but CUDA is not available: use device = \"auto\" or \"cpu\"")
    return name


def asked(n_clients: int, participation: float) -> int:
    """The clients the server asks per training round at ``participation`` f: round(f K), at least one
    (``federation.participants`` draws them; central client-level DP scales its noise to them)."""
    return n_clients if participation >= 1.0 else max(1, int(round(participation * n_clients)))
