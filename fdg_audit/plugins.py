"""Plugin registry: methods and attacks are found through entry-point groups or explicit "module:Class".

Built-ins register through the same groups (``fdg_audit.methods``, ``fdg_audit.attacks``) a third-party
package would use, in ``pyproject.toml``. A scenario may also name ``"my_pkg.my_mod:MyAttack"`` directly.
"""
from __future__ import annotations

import importlib
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


def _import(path: str, kind: str):
    mod, _, attr = path.partition(":")
    if not attr:
        raise UserError(f"{kind} {path!r} is neither a registered name ({', '.join(sorted(available(kind))) or 'none'})"
                        f" nor a \"module:Class\" path: fix the name, or `pip install -e .` so built-ins register")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise UserError(f"cannot import {kind} module {mod!r} ({e}): check the path or install the package") from e
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise UserError(f"module {mod!r} has no {attr!r}: check the \"module:Class\" name of the {kind}") from None


def load(kind: str, name: str):
    """Resolve a plugin by registered name or by "module:Class"."""
    return _import(available(kind).get(name, name), kind)


def load_method(name: str):
    m = load("method", name)
    missing = [a for a in ("name", "Params", "Server", "Client") if not hasattr(m, a)]
    if missing:
        raise UserError(f"{name!r} is not a method plugin (missing {', '.join(missing)}): see methods/fedavg.py")
    return m


def load_attack(name: str):
    a = load("attack", name)
    if not hasattr(a, "run") or not hasattr(a, "consumes"):
        raise UserError(f"{name!r} is not an attack plugin (needs `consumes` and `run`): see attacks/README.md")
    return a


def describe() -> str:
    """A table of every registered method and attack and where it comes from."""
    lines = []
    for kind in ("method", "attack"):
        lines.append(f"{kind}s ({GROUPS[kind]}):")
        for name, path in sorted(available(kind).items()):
            try:
                obj = _import(path, kind)
                extra = (f"sends {', '.join(getattr(obj, 'kinds', ()))}" if kind == "method" else
                         f"{getattr(obj, 'adversary', '?')} -> {getattr(obj, 'target', '?')} from "
                         f"{', '.join(getattr(obj, 'consumes', ()))}")
            except UserError as e:
                extra = f"BROKEN: {e}"
            lines.append(f"  {name:<26} {path:<36} [{origin(kind, name)}] {extra}")
    return "\n".join(lines)
