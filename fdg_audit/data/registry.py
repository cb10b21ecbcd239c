"""The data set registry: a data set is a module registered under the entry-point group ``fdg_audit.datasets``
(the built-ins in pyproject.toml, an outside package in its own), found by ``data.dataset``'s name.

The module gives ``load(cfg: DataConfig) -> DomainSet`` and may give ``domain_names(cfg) -> list[str] | None``
(every domain the settings offer, for ``data.public``; None: the loader itself refuses bad settings).
docs/datasets.md is the how-to. Only registered names load: a run folder's recorded ``data.dataset`` never makes
fdg_audit import code that is not installed. Nothing here imports a loader until a data set is asked for.
"""
from __future__ import annotations

import importlib.metadata

from ..errors import UserError

GROUP = "fdg_audit.datasets"


def available() -> dict[str, str]:
    """name -> module of every registered data set (read anew: an install or a test may add one)."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GROUP)}


def dataset(name: str):
    """The registered data set module ``name``, checked to give ``load``."""
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}
    if not eps:   # not even the built-ins: fdg_audit's installed metadata is missing or older than this group
        raise UserError(f"unknown data.dataset {name!r}: no data set is registered, not even the built-ins (the "
                        f"installed metadata of fdg_audit is missing or stale, or a stale egg-info folder of "
                        f"fdg_audit in the working directory hides it): reinstall with pip install -e <fdg_audit's folder>")
    if name not in eps:
        raise UserError(f"unknown data.dataset {name!r}: use one of {', '.join(sorted(eps)) or 'none'} (a data set "
                        f"registers under the entry point group {GROUP}; see docs/datasets.md)")
    try:
        mod = eps[name].load()
    except ImportError as e:
        raise UserError(f"data set {name!r} ({eps[name].value}) cannot be imported ({e}): install its package") from e
    if not callable(getattr(mod, "load", None)):
        raise UserError(f"data set {name!r} ({eps[name].value}) has no load(cfg) function: see docs/datasets.md")
    return mod
