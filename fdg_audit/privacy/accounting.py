"""Opacus accountants and a memoized epsilon."""
from __future__ import annotations

import math
import warnings
from functools import lru_cache


def new_accountant(name: str):
    from opacus.accountants import create_accountant
    return create_accountant(name)


def epsilon(accountant, delta: float) -> float:
    """The accountant's epsilon at delta; inf when any step had no noise. Memoized on (accountant type, history,
    delta): clients with the same schedule share one computation (PRV takes ~0.4 s)."""
    return _epsilon(accountant.mechanism(), tuple(tuple(h) for h in accountant.history), delta)


@lru_cache(maxsize=4096)
def _epsilon(name: str, history: tuple, delta: float) -> float:
    if any(h[0] == 0 for h in history):
        return math.inf
    if not history:
        return 0.0
    acc = new_accountant(name)
    acc.history = [tuple(h) for h in history]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(acc.get_epsilon(delta))
