"""Plugin registry: methods and attacks are found through entry-point groups or explicit "module:Class"; each kind
is checked beside its contract (``protocol.load_method``, ``attack.load_attack``).

Built-ins register through the same groups (``fdg_audit.methods``, ``fdg_audit.attacks``) a third-party
package would use, in ``pyproject.toml``. A scenario may also name ``"my_pkg.my_mod:MyAttack"`` directly.

Run folders are data: while a command reads plugin names from a run folder (``with from_folder(root)``), only
registered names load, a recorded ``module:Class`` is refused unless the user named it on the command line or
passed ``--trust-plugins``, and the working directory is taken off the import path (``python -m`` puts it there),
so a file shipped inside the folder, or a package beside it, is never imported.
"""
from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager
from functools import lru_cache
from importlib.metadata import entry_points

from .errors import UserError

GROUPS = {"method": "fdg_audit.methods", "attack": "fdg_audit.attacks"}


@lru_cache(maxsize=None)
def available(kind: str) -> dict[str, str]:
    """name -> "module:Class" for every registered plugin of ``kind`` ("method" or "attack")."""
    return {ep.name: ep.value for ep in entry_points(group=GROUPS[kind])}


def origin(kind: str, name: str) -> str:
    """The installed distribution that registered ``name`` (e.g. fdg_audit, or a third-party package)."""
    for ep in entry_points(group=GROUPS[kind]):
        if ep.name == name:
            return ep.dist.name if ep.dist else "?"
    return "explicit module:Class"


_FOLDER: dict = {}     # while plugin names come from a run folder: {"where", "allow", "trust"}


@contextmanager
def from_folder(where, allow=(), trust: bool = False):
    """Plugin names resolved inside this block come from the run folder ``where``: see the module docstring."""
    old = dict(_FOLDER)
    _FOLDER.clear()
    _FOLDER.update(where=str(where), allow=set(allow), trust=trust)
    try:
        yield
    finally:
        _FOLDER.clear()
        _FOLDER.update(old)


def _from_folder(name: str) -> bool:
    """``name`` was read from a run folder (not named by the user, not under --trust-plugins)."""
    return bool(_FOLDER) and not _FOLDER["trust"] and name not in _FOLDER["allow"]


def import_path(name: str = "") -> list[str]:
    """``sys.path`` for importing plugin ``name`` while a run folder is being read: without the working directory
    that ``python -m`` / ``-c`` / tools put before site-packages (an install that points at it stays reachable),
    except for a "module:Class" the user named or trusted; a registered name always resolves to the install."""
    if not _FOLDER or ":" in name and not _from_folder(name):
        return list(sys.path)
    cwd = os.path.realpath(os.getcwd())
    site = next((i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))), len(sys.path))
    return [p for i, p in enumerate(sys.path) if p not in ("", ".") and not (i < site and os.path.realpath(p) == cwd)]


def _import(path: str, kind: str, name: str = ""):
    mod, _, attr = path.partition(":")
    if not attr:
        raise UserError(f"{kind} {path!r} is neither a registered name ({', '.join(sorted(available(kind))) or 'none'})"
                        f" nor a \"module:Class\" path: fix the name; a plugin of your own registers when its package (with its "
                        f"entry point) is installed: pip install -e <its folder>, or name it \"module:Class\"")
    saved = sys.path[:]
    sys.path[:] = import_path(name or path)
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise UserError(f"cannot import {kind} module {mod!r} ({e}): check the path or install the package") from e
    finally:
        sys.path[:] = saved
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise UserError(f"module {mod!r} has no {attr!r}: check the \"module:Class\" name of the {kind}") from None


def resolve(kind: str, name: str) -> str:
    """The "module:Class" of plugin ``name`` (a registered name or the path itself), checked as ``load`` checks it
    (see ``from_folder`` for run folders), without importing anything."""
    path = available(kind).get(name)
    if path is None and _from_folder(name):
        raise UserError(f"run folder {_FOLDER['where']} names {kind} {name!r}, which is not an installed plugin: a run "
                        f"folder cannot make fdg_audit import code; install the plugin (entry point {GROUPS[kind]}), or "
                        "pass --trust-plugins if you trust this folder")
    path = path or name
    if ":" not in path:
        raise UserError(f"{kind} {path!r} is neither a registered name ({', '.join(sorted(available(kind))) or 'none'})"
                        f" nor a \"module:Class\" path: fix the name; a plugin of your own registers when its package (with its "
                        f"entry point) is installed: pip install -e <its folder>, or name it \"module:Class\"")
    return path


def load(kind: str, name: str):
    """Resolve a plugin by registered name or by "module:Class" (see ``from_folder`` for run folders)."""
    return _import(resolve(kind, name), kind, name)
