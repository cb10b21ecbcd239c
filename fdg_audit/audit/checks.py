"""Data from plugin code, checked before the harness uses it: an attack's self-description, read by a metadata
probe in a throw-away worker (``describe``, so plugin code never runs in the harness), and a job's outputs
(``checked_outputs``). ``make_attack``: the same description of an attack built in this process (``isolate =
False``, debugging only).
"""
from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..attack import ADVERSARIES, AUX, CAPABILITIES, PRIORS, Control, Skipped, load_attack
from ..attack import OUTPUTS as RUN_OUTPUTS
from ..attack import Audit, Estimate, Predictions, Reconstruction, Scores
from ..errors import UserError
from ..params import safe_name
from ..plugins import import_path, resolve
from ..store.runfolder import RunInfo
from .sandbox import close_warm, run_isolated
from .transport import AttackFailed
from ..vocab import SHARED, AttackEntry, AttackParams, attack_params
from .worker import build, portrait

OUTPUTS = {c.__name__: c for c in (*RUN_OUTPUTS, Control)}   # what a worker may send back


# ------------------------------------------------------------------------------------------- attacks as described

@dataclass
class Described:
    """An attack as the harness knows it: what a metadata probe read off the plugin in a throw-away worker
    (``describe``), so that plugin code (its import, ``__init__``) never runs in the harness. ``p``: its
    parameters after ``__init__``, as plain values."""
    name: str
    consumes: tuple
    adversary: str
    aux: tuple
    outputs: dict
    p: Any
    threat: dict = dataclasses.field(default_factory=dict)   # Attack.threat(): priors, budget, knows, rows
    cache: str = ""                                           # Attack.cache: the attack cache its jobs share
    ignores: tuple = ()                                       # Attack.ignores: kinds a consumes = ("*",) leaves out
    cost: dict = dataclasses.field(default_factory=dict)      # Attack.cost(): seconds per victim and per image

    def record(self, entry: str) -> dict:
        """The attack's line in attacks.json."""
        return dict(name=entry, adversary=self.adversary, aux=list(self.aux), consumes=list(self.consumes),
                    ignores=list(self.ignores), outputs=dict(self.outputs), **self.threat)


_DESCRIBED: dict = {}   # probe results of this process, by (attack config, device, import path)


MAX_NAME = 200   # characters of an attack name ("module:Class") or label


def check_name(name, label) -> None:
    """An attack's name and label are short strings (one line before any worker starts)."""
    for what, v in (("name", name), ("label", label)):
        if v is not None and not (isinstance(v, str) and 0 < len(v) <= MAX_NAME and v.isprintable()):
            shown = repr(v)[:60] + ("..." if len(repr(v)) > 60 else "")
            raise UserError(f"attack {what} {shown} is not a printable string of 1 to {MAX_NAME} characters: "
                            "use a registered name or \"module:Class\"")


def describe(entry, device, limits: dict = {}) -> tuple[str, Described, dict]:  # noqa: B006
    """(label, attack, job spec for the worker) of one [[attacks]] entry (an ``AttackEntry``, or its flat form),
    validated. The attack is a ``Described`` read by a probe worker (one per entry and process), whose ``Params``
    are built and checked there (``worker.build``); the name is checked against a run folder's guard
    (``plugins.resolve``) first. The job spec carries the entry's ``params`` as written."""
    e = AttackEntry.of(entry)
    name, label, cfg = e.name, e.label or None, e.params
    check_name(name, label)
    resolve("attack", name)
    key = (json.dumps(cfg, sort_keys=True, default=str), name, str(device), tuple(import_path(name)))
    if key not in _DESCRIBED:
        job = dict(attack=name, label=label, params=cfg, device=str(device), mode="describe", **limits)
        try:
            _DESCRIBED[key] = _checked(run_isolated(job, OUTPUTS)["describe"], label or name)
        except AttackFailed as e:
            raise UserError(f"attack {label or name!r} could not be loaded in its worker ({e}); "
                            f"FDG_AUDIT_SANDBOX=process tells a sandbox problem from a broken plugin") from None
    d = _DESCRIBED[key]
    label = label or d.name or name
    safe_name(label, f"attacks.{label}.label")
    return label, d, dict(attack=name, label=label, params=cfg, device=str(device), **limits)


def _checked(d, label: str) -> Described:
    """A probe's answer, checked as data from plugin code: the harness decides with it which runs and views the
    worker gets."""
    strs = lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)  # noqa: E731
    if not (isinstance(d, dict) and isinstance(d.get("name"), str) and strs(d.get("consumes"))
            and strs(d.get("aux")) and isinstance(d.get("params"), dict) and isinstance(d.get("outputs"), dict)):
        raise UserError(f"attack {label}: its class does not describe itself (name, consumes, aux, outputs, Params): "
                        "see attacks/README.md")
    if d.get("adversary") not in ADVERSARIES:
        raise UserError(f"attack {label}: adversary {d.get('adversary')!r} is not one of {ADVERSARIES}")
    if set(d["aux"]) - set(AUX):
        raise UserError(f"attack {label}: aux {sorted(set(d['aux']) - set(AUX))} unknown; use a subset of {AUX}")
    p = attack_params(AttackParams, {k: v for k, v in d["params"].items() if k in SHARED}, label)
    if not all(isinstance(x, str) and 0 < len(x) <= MAX_NAME for x in (d["name"] or "x", *d["consumes"])):
        raise UserError(f"attack {label}: its name and consumes must be strings of 1 to {MAX_NAME} characters")
    cache = d.get("cache") or ""
    if not isinstance(cache, str) or len(cache) > MAX_NAME:
        raise UserError(f"attack {label}: its cache must be a name of at most {MAX_NAME} characters")
    return Described(d["name"], tuple(d["consumes"]), d["adversary"], tuple(d["aux"]),
                     {str(k): str(v) for k, v in d["outputs"].items()}, p, _threat(d.get("threat") or {}, label),
                     cache, tuple(x for x in d.get("ignores") or () if isinstance(x, str)),
                     {str(k): float(v) for k, v in (d.get("cost") or {}).items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9})


def _threat(t, label: str) -> dict:
    """An attack's threat-model declarations (``Attack.threat``), checked against the core's vocabulary."""
    strmap = lambda v: isinstance(v, dict) and all(isinstance(x, str) for kv in v.items() for x in kv)  # noqa: E731
    budget = t.get("budget", {}) if isinstance(t, dict) else None
    if not (isinstance(t, dict) and strmap(t.get("priors", {})) and strmap(t.get("rows", {}))
            and isinstance(budget, dict) and all(isinstance(v, list) and len(v) == 2 and all(
                isinstance(n, int) and n >= 0 for n in v) for v in budget.values())
            and isinstance(t.get("knows", []), list)):
        raise UserError(f"attack {label}: priors, budget, knows and rows do not describe a threat model (see "
                        "fdg_audit/attack.py)")
    bad = sorted(set(t.get("priors", {}).values()) - set(PRIORS)) + sorted(set(t.get("knows", [])) - set(CAPABILITIES))
    if bad:
        raise UserError(f"attack {label}: {bad} not in the priors {PRIORS} or capabilities {sorted(CAPABILITIES)}")
    return dict(priors=dict(t.get("priors", {})), budget=dict(budget), knows=list(t.get("knows", [])),
                rows=dict(t.get("rows", {})))


def make_attack(entry, device):
    """(label, attack instance, job spec) built in this process by the worker's ``build``, for ``isolate = False``
    (debugging only: plugin code then runs in the harness)."""
    e = AttackEntry.of(entry)
    cls = load_attack(e.name)
    label = e.label or cls.name or e.name
    safe_name(label, f"attacks.{label}.label")
    job = dict(attack=e.name, label=label, params=e.params, device=str(device))
    atk = build(job, cls)
    _checked(portrait(atk), label)
    return label, atk, job


def _make(cfg: dict, device, isolate: bool = True, limits: dict = {}):  # noqa: B006
    return describe(cfg, device, limits) if isolate else make_attack(cfg, device)


def check_attacks(entries: list, limits: dict = {}) -> dict:  # noqa: B006
    """Every attack loads and its parameters are valid (before any training), each probed in a worker (within
    ``limits``: timeout, memory_gb; default sandbox.LIMITS). ``entries``: ``AttackEntry``s (or their flat form).
    Returns {label: Described}."""
    out = {label: d for label, d, _ in (describe(c, "cpu", limits) for c in entries)}
    close_warm()   # no sandbox waits through the training
    return out


MAX_TEXT = 2000   # characters of a string field of an output (a skip reason, a variant, a truth name)


def checked_outputs(outs, run: RunInfo, me: str) -> list:
    """A job's outputs, checked as data from plugin code before anything uses them: a list of the output classes,
    every field of its declared kind (strings, integers, numbers, flags, numeric arrays), victims among the run's
    clients ("+"-joined for aggregates; a Skipped may also name the adversary itself), truth names and variants safe
    file-name parts. Array fields typed as tensors come back as tensors. Anything else is ``AttackFailed``."""
    if not isinstance(outs, list):
        raise AttackFailed("run() did not return a list of outputs")
    for o in outs:
        name = type(o).__name__
        if type(o) not in OUTPUTS.values() or isinstance(o, Control):
            raise AttackFailed(f"run() returned a {name}: return "
                               f"{', '.join(c.__name__ for c in RUN_OUTPUTS[:-1])} or {RUN_OUTPUTS[-1].__name__}")
        for f in dataclasses.fields(o):
            v, kind = getattr(o, f.name), str(f.type)
            bad = lambda want: AttackFailed(  # noqa: E731
                f"{name}.{f.name} = {repr(v)[:80]}: {want}")
            if kind == "str":
                if not isinstance(v, str) or len(v) > MAX_TEXT:
                    raise bad(f"give a string of at most {MAX_TEXT} characters")
            elif kind == "int":
                if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)) or abs(v) > 10 ** 9:
                    raise bad("give an integer")
                setattr(o, f.name, int(v))
            elif kind == "float":
                if not isinstance(v, numbers.Real) or isinstance(v, (bool, np.bool_)):
                    raise bad("give a number")
                setattr(o, f.name, float(v))
            elif kind == "bool":
                if not isinstance(v, (bool, np.bool_)):
                    raise bad("give True or False")
                setattr(o, f.name, bool(v))
            elif f.name == "victims":
                if v is not None:
                    raise bad("leave it None (the harness pools victims)")
            elif v is not None or f.default is dataclasses.MISSING:
                try:
                    t = v.detach().cpu() if isinstance(v, torch.Tensor) else None
                    a = np.asarray(v if t is None else (t.float() if t.dtype == torch.bfloat16 else t).numpy())
                except (ValueError, TypeError, RuntimeError):
                    a = np.asarray(object())
                if a.dtype.kind not in "biuf":
                    raise bad("give a numeric array")
                setattr(o, f.name, torch.from_numpy(np.ascontiguousarray(a)) if "Tensor" in kind else a)
        _in_range(o, run)
        parts = o.victim.split("+")
        if not (all(x in run.clients for x in parts) or isinstance(o, Skipped) and o.victim in (me, "")):
            raise AttackFailed(f"{name}.victim = {o.victim[:80]!r} is not a client of run {run.run} "
                               f"({', '.join(run.clients[:8])}{', ...' if len(run.clients) > 8 else ''})")
        for k, extra in (("truth", ""), ("variant", "/@+=:")):   # a variant may say "radial/public" (files: "__")
            v = getattr(o, k, "")
            if v and not (len(v) <= 100 and all(c.isalnum() and c.isascii() or c in "_.-" + extra for c in v)
                          and ".." not in v and set(v) != {"."} and not v.startswith("/")):
                raise AttackFailed(f"{name}.{k} = {v[:80]!r}: use letters, digits and _ . -{' ' + ' '.join(extra) if extra else ''} "
                                   "only")
    return outs


def _in_range(o, run: RunInfo) -> None:
    """An output's values have the shape and range their scorer assumes (refused, never clamped): a
    Reconstruction's images (N, C, H, W) of the run's image shape in [0, 1], predictions among their classes,
    finite scores and non-negative finite estimates."""
    name = type(o).__name__
    if isinstance(o, Reconstruction):
        c, s = run.channels, run.size
        im = o.images
        if im.dim() != 4 or len(im) == 0 or (c and tuple(im.shape[1:]) != (c, s, s)):
            raise AttackFailed(f"Reconstruction.images has shape {tuple(im.shape)}: expected (N, {c}, {s}, {s}), "
                               f"N >= 1, in [0, 1]")
        lo, hi = float(im.min()), float(im.max())
        if not (0.0 <= lo and hi <= 1.0):   # NaN fails both
            raise AttackFailed(f"Reconstruction.images has values in [{lo:.4g}, {hi:.4g}]: expected pixels in [0, 1] "
                               f"(map them there, e.g. x.clamp(0, 1) or (x - min) / (max - min), before returning)")
    elif isinstance(o, Predictions):
        p = np.asarray(o.pred)
        if p.size and (p.min() < 0 or p.max() >= o.n_classes or not np.all(p == np.round(p))):
            raise AttackFailed(f"Predictions.pred holds values in [{p.min()}, {p.max()}]: expected integers in "
                               f"[0, {o.n_classes - 1}] (n_classes = {o.n_classes})")
    elif isinstance(o, (Scores, Audit)):
        if not np.all(np.isfinite(np.asarray(o.scores, float))):
            raise AttackFailed(f"{name}.scores holds NaN or infinite values: expected finite numbers")
    elif isinstance(o, Estimate):
        v = np.asarray(o.value, float)
        if not np.all(np.isfinite(v)) or (v < 0).any():
            raise AttackFailed(f"Estimate.value holds {v.ravel()[:4]}: expected finite numbers >= 0")
