"""The attack contract's vocabulary and shared parameters, apart from the contract (fdg_audit/attack.py) so that
what only names them (the report, the scenario parser, the harness's checks) loads nothing else: adversaries, aux
kinds, image priors, capabilities, and ``AttackParams``, the fields every attack takes, with their defaults and
checks in one place. ``attack_params`` builds them from a table, in the harness (the shared fields of a described
attack) and in the attack worker (the plugin's ``Params``) alike; ``AttackEntry`` is an [[attacks]] table as the
scenario parser leaves it and the harness takes it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import seeding
from .errors import UserError
from .params import typed

ADVERSARIES = ("server", "client", "eavesdropper")
AUX = ("public", "domain_samples", "candidates", "layout")
PRIORS = ("none", "layout", "learned", "oracle")   # image priors of a reconstruction, weakest first
ORACLE = PRIORS[-1]
CAPABILITIES = {   # what the attacker knows (the gradient-inversion SoK's threat-model flags, as LeakPro encodes them)
    "architecture": "the model architecture",
    "local_hyperparams": "the clients' local hyper-parameters (optimizer, lr, batch size, local steps)",
    "bn_statistics": "BatchNorm running statistics",
    "public_data": "public (surrogate) data",
    "candidates": "the candidate images (members and non-members)",
    "layout": "the data set's layout (support or frame)",
    "generator": "the data set's own generator",
}
IMPLIED = {"public": "public_data", "domain_samples": "public_data", "candidates": "candidates", "layout": "layout",
           PRIORS[1]: "layout", PRIORS[2]: "public_data", ORACLE: "generator"}   # aux name or prior -> capability
MAX_NAME = 200   # characters of a client name, domain name or data set label an attack may filter on


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _names(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) and len(x) <= MAX_NAME for x in v)


@dataclass
class AttackEntry:
    """One [[attacks]] table: ``name``, ``label`` and ``params`` (the rest of the table, as written: no default
    filled in, nothing checked but by ``attack_params``). The scenario parser makes it and the harness takes it
    unchanged; ``of`` also takes the flat form ``{"name": ..., "label": ..., **params}`` (a caller's own list)."""
    name: str
    label: str = ""
    params: dict = field(default_factory=dict)

    @classmethod
    def of(cls, cfg) -> "AttackEntry":
        if isinstance(cfg, cls):
            return cfg
        cfg = dict(cfg)
        return cls(cfg.pop("name"), cfg.pop("label", "") or "", cfg)


@dataclass
class AttackParams:
    """The fields every attack takes (a plugin's ``Params`` extends it), checked where they are built: the harness
    filters runs, picks the curious client, caps victims and salts the seed with them. A ``Params`` with a
    ``__post_init__`` of its own calls ``super().__post_init__()``.

    Every attack parameter, shared or the plugin's own, takes one path of 4 hops from the scenario to its use, e.g.
    ``attacks.update_inversion.iterations``:

    1. ``fdg_audit/scenario.py:parse``: the [[attacks]] table becomes an ``AttackEntry`` (``params`` as written);
    2. ``fdg_audit/audit/checks.py:describe``: the entry becomes the worker's job spec (``params`` unchanged), the
       same for the probe before any training (``check_attacks``) and for every run (``run_attacks``; a run adds
       only its seed, ``salt``, beside the params);
    3. ``fdg_audit/audit/worker.py:build`` (``attack_params`` below, then the plugin's ``__init__``): the ``Params``
       built and checked, once, in the worker; an out-of-range value is a one-line error from the probe, before
       any run. The harness checks the probe's answer with the same ``attack_params`` (shared fields), and an
       attack built in the harness (``isolate = False``) goes through the same ``build``;
    4. the attack's ``run`` reads ``self.p`` (inside the plugin: ``attacks/inversion.py:UpdateInversion.run`` ->
       ``attack_updates`` -> ``attacks/unroll.py:invert_many``, whose loop runs ``p.iterations`` steps at most).

    Functions between them (``runner.run_scenario``, ``harness.run_attacks``, the sandbox) carry the entry or job
    spec without opening it (before issue 52 the runner flattened the entry and the harness rebuilt the Params: 6
    hops); tests/test_param_path.py fails if a step between reshapes the params or the worker and the harness stop
    building an attack alike."""
    as_client: str = ""           # the curious client for adversary "client" (default: the first client)
    max_victims: int = 0          # 0 = every victim the adversary can see
    targets: list = field(default_factory=list)   # attack only runs holding out these domains ([] = every run)
    seeds: list = field(default_factory=list)     # attack only runs of these seeds ([] = every run)
    datasets: list = field(default_factory=list)  # attack only runs of these [[datasets]] labels ([] = every run)
    seed: int = 0                 # the attack's own randomness (the harness salts it with each run's seed)

    def __post_init__(self):
        checks = dict(as_client=(lambda v: isinstance(v, str) and len(v) <= MAX_NAME, "a client name (\"\" = the first)"),
                      max_victims=(lambda v: _is_int(v) and v >= 0, "0 (every victim) or a positive integer"),
                      targets=(_names, "a list of domain names ([] = every run)"),
                      seeds=(lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of integer seeds"),
                      datasets=(_names, "a list of [[datasets]] labels ([] = every run)"),
                      seed=(lambda v: _is_int(v) and 0 <= v < 2 ** 63, "an integer >= 0"))
        for k, (ok, want) in checks.items():
            if not ok(getattr(self, k)):
                raise UserError(f"{k} = {repr(getattr(self, k))[:80]}: use {want}")


SHARED = tuple(f.name for f in dataclasses.fields(AttackParams))   # the keys every attack takes


def attack_params(cls, table: dict, label: str, salt: int | None = None):
    """``cls`` (``AttackParams`` or a plugin's ``Params``) built from ``table`` (``params.typed``: unknown keys and
    wrong types are one-line errors; then the checks of ``__post_init__``, named ``attacks.<label>.<key>``); with
    ``salt`` (a run's seed), its ``seed`` salted by it, so runs of different seeds draw independent attack randomness."""
    where = f"attacks.{label}"
    try:
        p = typed(cls, table, where)
        return p if salt is None else typed(cls, {**table, "seed": seeding.seed32(p.seed, int(salt))}, where)
    except UserError as e:   # a shared field's check names its key: say where it is set
        raise UserError(f"{where}.{e}" if str(e).startswith(tuple(f"{k} = " for k in SHARED)) else str(e)) from None
