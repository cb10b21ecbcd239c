"""Scenario files: TOML -> typed, validated config; ``--set a.b=c`` overrides; sweep expansion; the run plan.

Unknown keys are errors that list the allowed keys. A scenario expands into runs:
sweep variant x dataset x method x held-out target x seed.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import tomllib

import numpy as np
import tomli_w
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .audit.limits import check_limits
from .data import DataConfig, load_data
from .errors import UserError
from .train.settings import check_participation, cohort_on
from .params import MAX_ROUNDS, TrainParams, _names, resolve_device, safe_name, typed  # noqa: F401  (typed re-exported)
from .models import ARCHS, NORMS, ModelConfig
from .plugins import available
from .protocol import load_method
from .privacy import check_run, privacy_config
from .train.ray_engine import ray_options
from .vocab import SHARED, AttackEntry  # noqa: F401  (AttackEntry: the [[attacks]] table)
import secrets


@dataclass
class DatasetEntry(DataConfig):
    label: str = ""
    targets: Any = "all"          # "all" or a list of domain names held out one at a time
    seeds: list = field(default_factory=list)   # the scenario's seeds this data set trains ([] = every seed)


@dataclass
class MethodEntry:
    name: str
    label: str = ""
    privacy: dict = field(default_factory=dict)  # keys replacing the scenario's [privacy] for this method
    params: dict = field(default_factory=dict)   # everything else in the [[methods]] table


@dataclass
class Scenario:
    name: str = "scenario"
    seeds: list = field(default_factory=lambda: [0])
    attack_seeds: list = field(default_factory=list)   # attacks' default seeds ([] = all); others keep no payloads
    seeds_draw_data: bool = True  # each seed draws its own data split (DataConfig.draw); false: one split for all seeds
    device: str = "auto"          # auto (CUDA when present) | cpu | cuda | cuda:N
    engine: str = "local"         # local | process (worker processes) | ray (Ray actors); same ledger
    threads: int = 0              # torch threads per run; 0 = leave torch's default
    parallel: int = 1             # runs trained at once, each in its own worker process (same ledger as 1)
    workers: int = 0              # process/ray: workers (processes or Ray actors) hosting the clients; 0 = one per CPU
    worker_threads: int = 1       # process/ray: torch threads per worker
    ray: dict = field(default_factory=dict)   # engine = "ray": address, num_cpus, num_gpus per actor (ray_engine.py)
    out: str = "runs"
    store: Any = "all"            # payload bytes kept: "all" | "none" | list of artifact kinds
    store_rounds: list = field(default_factory=list)   # keep payloads of these rounds only ([] = every round)
    report: bool = True
    datasets: list = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: dict = field(default_factory=dict)
    methods: list = field(default_factory=list)
    attacks: list = field(default_factory=list)   # [[attacks]] tables, or "all" (every applicable attack)
    sweep: dict = field(default_factory=dict)
    privacy: dict = field(default_factory=dict)   # [privacy]: DP-SGD, artifact mechanisms, canaries (fdg_audit.privacy)
    compare_to: str = "fedavg"    # the method (registered name) every other is compared with: Δ columns
    reference: dict = field(default_factory=dict)  # published numbers the report prints beside the measured ones:
                                                   # source = "...", values = { <method label> = accuracy in [0, 1] }
    see_also: list = field(default_factory=list)   # lines the report prints beside the attacks left out here, e.g.
                                                   # which scenario ran them and where its report is
    attack_timeout: float = 3600.0   # seconds one attack worker (describe, control, one run) may take; then killed
    attack_memory_gb: float = 8.0    # memory (GB of address space beyond its start) of one attack job; beyond it the job fails
    attack_budget_s: float = 5400.0  # the cost guard (the main job: ~4400 CPU s): a plan whose attacks are estimated
                                     # above this many CPU seconds stops before training and names the knobs
                                     # (or runs with --yes)


def parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


LIST_TABLES = ("datasets", "methods", "attacks")


def apply_set(raw: dict, assignment: str) -> None:
    """``a.b.c=value``; list tables (datasets, methods, attacks) are addressed by label, name or position. A list
    table the scenario does not have (e.g. ``datasets.*`` on a ``[data]`` scenario) is an error, not a new table."""
    key, sep, text = assignment.partition("=")
    if not sep:
        raise UserError(f"--set {assignment[:100]!r}: write key=value, e.g. --set train.rounds=3")
    parts, node, i = key.strip().split("."), raw, 0
    if parts[0] == "attacks" and raw.get("attacks") == "all":   # the short form is the table form's shorthand
        raw["attacks"] = [{"name": "all"}]
    if node is raw and parts[0] in LIST_TABLES and len(parts) > 1 and not isinstance(raw.get(parts[0]), list):
        hint = " (this scenario has a [data] table: address it as data.<key>)" if parts[0] == "datasets" and \
            "data" in raw else ""
        raise UserError(f"--set {key[:100]}: the scenario has no [[{parts[0]}]] entries to change{hint}; add the "
                        f"entry to the scenario file")
    while i < len(parts) - 1:
        child = node.get(parts[i])
        if isinstance(child, list):
            pick = parts[i + 1]
            hit = [t for t in child if isinstance(t, dict) and pick in (t.get("label"), t.get("name"))] or \
                ([child[int(pick)]] if pick.isdigit() and int(pick) < len(child) else [])
            if not hit:
                raise UserError(f"--set {key}: no entry {parts[i + 1]!r} in {parts[i]}; have "
                                f"{[t.get('label') or t.get('name') for t in child]}")
            node, i = hit[0], i + 2
            continue
        if child is None:
            child = node[parts[i]] = {}
        if not isinstance(child, dict):
            raise UserError(f"--set {key}: {parts[i]} is not a table")
        node, i = child, i + 1
    if i != len(parts) - 1:
        raise UserError(f"--set {key}: name a key inside the entry, e.g. {key}.lr=0.1")
    node[parts[-1]] = parse_value(text.strip())


def _entries(cls, items, where: str) -> list:
    out = []
    for i, t in enumerate(items):
        if not isinstance(t, dict) or "name" not in t:
            raise UserError(f"{where}[{i}] needs a name: write a table per entry, [[{where}]] with name = \"<registered "
                            f"name>\" (`python -m fdg_audit plugins` lists them)")
        fixed = {k: t[k] for k in _names(cls) if k != "params" and k in t}
        e = cls(**fixed, params={k: v for k, v in t.items() if k not in fixed})
        e.label = e.label or e.name
        safe_name(e.label, f"{where}[{i}].label")
        out.append(e)
    labels = [e.label for e in out]
    if len(set(labels)) != len(labels):
        raise UserError(f"two {where} entries share the label {labels}: give each a distinct label = \"...\"")
    return out


def load_raw(path: str | Path, sets: list[str] = ()) -> dict:
    path = Path(path)
    if not path.exists():
        raise UserError(f"scenario file {path} not found: pass a TOML file, e.g. scenarios/quick.toml")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text: save the scenario as UTF-8 TOML") from None
    if "data" in raw and "datasets" in raw:
        raise UserError(f"{path}: use either [data] or [[datasets]], not both")
    for s in sets:
        if s.startswith("data.") and "datasets" in raw:
            raise UserError(f"--set {s}: this scenario lists [[datasets]]; address one as datasets.<label>.<key>")
        apply_set(raw, s)
    if "data" in raw:  # a single [data] table is shorthand for one [[datasets]] entry
        raw["datasets"] = [raw.pop("data")]
    raw.setdefault("name", path.stem)
    return raw


def parse(raw: dict) -> Scenario:
    raw = copy.deepcopy(raw)
    sc = typed(Scenario, {k: v for k, v in raw.items() if k not in ("model", "datasets", "methods", "attacks")},
               "scenario")
    sc.model = typed(ModelConfig, raw.get("model", {}), "model")
    ds = raw.get("datasets") or [{}]
    where = lambda i: "data" if len(ds) == 1 and "label" not in ds[0] else f"datasets[{i}]"  # noqa: E731  [data]
    sc.datasets = [typed(DatasetEntry, d, where(i)) for i, d in enumerate(ds)]
    for d in sc.datasets:
        d.label = d.label or (d.family if d.dataset in ("mnist", "digits", "idx") else Path(d.root).name or d.dataset)
    safe_name(sc.name, "name")
    for i, d in enumerate(sc.datasets):
        safe_name(d.label, f"datasets[{i}].label")
    labels = [d.label for d in sc.datasets]
    if len(set(labels)) != len(labels):
        raise UserError(f"two [[datasets]] share the label {labels}: give each a distinct label = \"...\"")
    typed(TrainParams, sc.train, "train")
    if "methods" in raw and not isinstance(raw["methods"], list):
        raise UserError(f"methods = {raw['methods']!r}: write [[methods]] tables, e.g. [[methods]] name = \"fedavg\"")
    if raw.get("methods") == []:
        raise UserError("methods = [] names no method: add [[methods]] name = \"fedavg\" (or drop the key for FedAvg)")
    sc.methods = _entries(MethodEntry, raw.get("methods", [{"name": "fedavg"}]), "methods")
    sc.attacks = expand_attacks(_entries(AttackEntry, _attack_list(raw.get("attacks") or []), "attacks"))
    if sc.engine not in ("local", "process", "ray"):
        raise UserError(f"engine = {sc.engine!r}: choose \"local\", \"process\" or \"ray\" (pip install 'fdg_audit[ray]')")
    check_engine(sc)
    if not (isinstance(sc.see_also, list) and all(isinstance(x, str) for x in sc.see_also)):
        raise UserError(f"see_also = {sc.see_also!r}: give a list of strings, e.g. see_also = [\"scenarios/x.toml\"]")
    _seeds(sc)
    resolve_device(sc.device)   # an unknown device, or CUDA on a machine without it, before anything is written
    if sc.store not in ("all", "none") and not (isinstance(sc.store, list) and all(isinstance(k, str) for k in sc.store)):
        raise UserError(f"store = {sc.store!r}: use \"all\", \"none\" or a list of artifact kinds, e.g. [\"weights\"]")
    if not isinstance(sc.store_rounds, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in sc.store_rounds):
        raise UserError(f"store_rounds = {sc.store_rounds!r}: give a list of round numbers >= 0 ([] = every round)")
    rounds = max([typed(TrainParams, sc.train, "train").rounds] + [m.params["rounds"] for m in sc.methods
                                                                    if isinstance(m.params.get("rounds"), int)])
    if sc.store_rounds and max(sc.store_rounds) > rounds:
        raise UserError(f"store_rounds = {sc.store_rounds!r} names rounds beyond the last ({rounds}): list rounds "
                        f"from 0 to {rounds}")
    check_limits(sc.attack_timeout, sc.attack_memory_gb)
    if sc.model.arch not in ARCHS or sc.model.norm not in NORMS:
        raise UserError(f"model.arch = {sc.model.arch!r}, model.norm = {sc.model.norm!r}: use an arch of "
                        f"{', '.join(ARCHS)} and a norm of {', '.join(NORMS)}")
    for i, d in enumerate(sc.datasets):
        t = d.targets
        if t != "all" and (not isinstance(t, list) or not t or not all(isinstance(x, str) for x in t)
                           or len(set(t)) != len(t)):
            hint = f"[{t!r}]" if isinstance(t, str) else '["rot0"]'
            raise UserError(f"{'data' if len(sc.datasets) == 1 else f'datasets[{i}]'}.targets = {t!r}: give \"all\" or a non-empty list of distinct domain "
                            f"names, e.g. targets = {hint}".replace("'", '"'))
    return sc


def check_engine(sc: Scenario) -> None:
    """``workers``, ``worker_threads`` and the ``[ray]`` table: one-line errors before anything runs."""
    if sc.workers < 0:
        raise UserError(f"workers = {sc.workers}: use 0 (one worker per CPU) or a positive number of workers")
    if sc.worker_threads < 1:
        raise UserError(f"worker_threads = {sc.worker_threads}: use an integer >= 1 (torch threads per worker)")
    if sc.threads < 0:
        raise UserError(f"threads = {sc.threads}: use 0 (torch's default) or a positive number of threads")
    ref = sc.reference
    if set(ref) - {"source", "values"} or not isinstance(ref.get("source", ""), str) or \
            not isinstance(ref.get("values", {}), dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
                for v in ref.get("values", {}).values()):
        raise UserError("[reference] takes source = \"...\" and values = { <method label> = accuracy in [0, 1] }: "
                        "fix the table")
    if not 1 <= sc.parallel <= 64:
        raise UserError(f"parallel = {sc.parallel}: use 1 (runs one after another) up to 64 runs at once")
    if sc.parallel > 1 and sc.engine != "local":
        raise UserError(f"parallel = {sc.parallel} with engine = {sc.engine!r}: parallel runs use the local engine; "
                        f"set parallel = 1 or engine = \"local\"")
    sc.ray = ray_options(sc.ray)


def _seeds(sc: Scenario) -> None:
    """``seeds``; ``attack_seeds`` (the default of every attack's own ``seeds`` filter) and each data set's ``seeds``,
    those of them the scenario trains (``--set seeds=[0]`` keeps seed 0 attacked)."""
    if not isinstance(sc.seeds, list) or not sc.seeds or \
            not all(isinstance(s, int) and not isinstance(s, bool) for s in sc.seeds):
        raise UserError(f"seeds = {sc.seeds!r}: give a non-empty list of integers, e.g. seeds = [0, 1, 2]")
    if len(set(sc.seeds)) != len(sc.seeds):
        raise UserError(f"seeds = {sc.seeds!r} repeats a seed (one run id per seed): list each seed once")
    if not all(0 <= s < 2 ** 32 for s in sc.seeds):
        raise UserError(f"seeds = {sc.seeds!r}: seeds are integers from 0 to 2**32 - 1")
    sc.attack_seeds = _some_seeds(sc, "attack_seeds", sc.attack_seeds)
    for a in sc.attacks:
        if sc.attack_seeds and "seeds" not in a.params:
            a.params["seeds"] = list(sc.attack_seeds)
    for i, d in enumerate(sc.datasets):
        d.seeds = _some_seeds(sc, f"{'data' if len(sc.datasets) == 1 else f'datasets[{i}]'}.seeds", d.seeds)


def _some_seeds(sc: Scenario, key: str, v) -> list:
    """The seeds of list ``v`` that the scenario trains ([]: every seed); a list naming none of them is one line."""
    if not isinstance(v, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in v):
        raise UserError(f"{key} = {v!r}: give a list of the scenario's seeds, or [] (every seed)")
    if v and not set(v) & set(sc.seeds):
        raise UserError(f"{key} = {v!r} names none of this scenario's seeds ({sc.seeds}): list some of them, or [] "
                        f"(every seed)")
    return [s for s in sc.seeds if s in v]


def _attack_list(att) -> list:
    if att == "all":
        return [{"name": "all"}]
    if not isinstance(att, list):
        raise UserError(f"attacks = {att!r}: write attacks = \"all\" or [[attacks]] tables")
    return att


SHARED_ATTACK_KEYS = SHARED   # every attack takes them (fdg_audit.vocab.AttackParams)


def expand_attacks(entries: list) -> list:
    """An entry named "all" stands for every registered attack not listed by its own entry; its keys (from
    ``SHARED_ATTACK_KEYS``, plus ``exclude = [names]``) apply to each. Which of them run on a run follows from
    their ``consumes`` and the run's ledger (``fdg_audit.audit.harness.applicable``)."""
    out, named = [], {e.name for e in entries} | {e.label for e in entries}
    for e in entries:
        if e.name != "all":
            out.append(e)
            continue
        shared = dict(e.params)
        exclude = shared.pop("exclude", [])
        bad = [k for k in shared if k not in SHARED_ATTACK_KEYS]
        if bad:
            raise UserError(f"attacks \"all\": {bad[0]!r} is not a setting every attack has "
                            f"({', '.join(SHARED_ATTACK_KEYS)}, exclude); give it its own [[attacks]] entry")
        unknown = [x for x in exclude if x not in available("attack")]
        if unknown:
            raise UserError(f"attacks \"all\": exclude names {unknown[0]!r}, which is not a registered attack "
                            f"({', '.join(sorted(available('attack')))})")
        out += [AttackEntry(n, n, dict(shared)) for n in sorted(available("attack"))
                if n not in named and n not in exclude]
    return out


def method_params(method, entry: MethodEntry, train: dict):
    """The method's Params from [train] defaults overlaid by the [[methods]] entry; shared fields are checked."""
    p = typed(method.Params, {**train, **entry.params}, f"methods.{entry.label}")
    where = f"methods.{entry.label}"
    if p.optimizer not in ("sgd", "adam"):
        raise UserError(f"{where}.optimizer = {p.optimizer!r}: use \"sgd\" or \"adam\"")
    for key in ("rounds", "batch_size", "eval_every"):
        if not 1 <= getattr(p, key) <= MAX_ROUNDS:
            raise UserError(f"{where}.{key} = {getattr(p, key)!r}: use an integer from 1 to {MAX_ROUNDS}")
    if p.weight_decay < 0 or not 0 <= p.momentum < 1:
        raise UserError(f"{where}: weight_decay = {p.weight_decay!r}, momentum = {p.momentum!r}: use weight_decay >= 0 "
                        f"and momentum in [0, 1)")
    if p.local_epochs < 0 or p.local_steps < 0 or (p.local_epochs == 0 and p.local_steps == 0):
        raise UserError(f"{where}: local_epochs = {p.local_epochs}, local_steps = {p.local_steps}: "
                        "set local_epochs >= 1, or local_steps >= 1 (steps replace epochs)")
    if p.lr <= 0:
        raise UserError(f"{where}.lr = {p.lr!r}: use a learning rate > 0")
    check_participation(method, p.participation, f"{where}.participation")
    return p


def variants(raw: dict) -> list[tuple[dict, dict]]:
    """Expand [sweep] into (assignments, raw config) pairs; no sweep gives one variant."""
    sweep = raw.get("sweep") or {}
    for k, v in sweep.items():
        if not isinstance(v, list) or not v:
            raise UserError(f"sweep.{k} must be a non-empty list of values, e.g. [0.01, 0.1]")
    keys = list(sweep)
    out = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        r = copy.deepcopy(raw)
        r.pop("sweep", None)
        for k, v in zip(keys, combo):
            apply_set(r, f"{k}={json.dumps(v)}")
        out.append((dict(zip(keys, combo)), r))
    return out


def plan(raw: dict) -> list[dict]:
    """Every run of a scenario: sweep variant x dataset x method x target x seed (validated up front)."""
    runs = []
    for assign, r in variants(raw):
        sc = parse(r)
        tag = "" if not assign else "[" + ",".join(f"{k.split('.')[-1]}={v}" for k, v in assign.items()) + "]"
        for di, ds in enumerate(sc.datasets):
            data = load_data(ds)
            classes = np.unique(np.concatenate([d.train.y.numpy() for d in data.domains]))
            if len(classes) < 2:
                raise UserError(f"datasets.{ds.label}: the training images hold {len(classes)} class: a classifier "
                                f"needs at least 2 classes (check data.root)")
            targets = data.names if ds.targets == "all" else list(ds.targets)
            for t in targets:
                data.domain(t)
            drawn = {}   # the run seed's own draw of the data (same for every method: comparisons stay paired)
            for seed in ((ds.seeds or sc.seeds) if sc.seeds_draw_data else ()):
                d = dataclasses.replace(ds, draw=seed)
                drawn[seed] = d, load_data(d)
            for m in sc.methods:
                method = load_method(m.name)
                params = method_params(method, m, sc.train)
                cohort_on(params)   # a bad cohort setting is refused before any run trains
                privacy = privacy_config({**sc.privacy, **m.privacy}, f"methods.{m.label}.privacy"
                                         if m.privacy else "privacy")
                check_run(privacy, sc.model, data, method, params, sc.engine)
                for t in targets:
                    for seed in ds.seeds or sc.seeds:
                        ds_s, data_s = drawn[seed] if sc.seeds_draw_data else (ds, data)
                        runs.append(dict(sc=sc, data=data_s, ds=ds_s, method=m, params=params, target=t, seed=seed,
                                         variant=tag, sweep=assign, privacy=privacy, dataset_index=di,
                                         run_id=f"{ds.label}/{m.label}{tag}/{t}/s{seed}"))
    return runs


def with_secrets(raw: dict, secrets: dict) -> dict:
    """``raw`` with each dataset's secret split seed (``secrets``: {dataset index: seed}) where the scenario sets
    none. The split of a domain into clients, members (train) and non-members (validation) then cannot be
    recomputed from the scenario: the seeds live in the run folder's truth/, which attacks never see."""
    raw = copy.deepcopy(raw)
    for i, d in enumerate(raw.get("datasets", [])):
        if str(i) in secrets and "split_seed" not in d:
            d["split_seed"] = secrets[str(i)]
    return raw


def new_secrets(raw: dict) -> dict:
    """A fresh 64-bit split seed for each dataset that sets no ``split_seed``."""
    return {str(i): secrets.randbits(64) for i, d in enumerate(raw.get("datasets", [])) if "split_seed" not in d}


def dump_toml(raw: dict) -> str:
    """The resolved config as TOML (tomli-w)."""
    return tomli_w.dumps(raw)
