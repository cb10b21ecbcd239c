"""Run a scenario: plan it, train every run into a run folder (fdg_audit.train.runs), attack the finished folder
(fdg_audit.audit.harness) and write its report (fdg_audit.report). The phases meet only in the run folder: the
audit reads the runs' records, the report reads the folder's files. Also ``attack RUN_DIR`` (``run_attacks_cli``).

Outputs (``runs/<name>/<timestamp>/``): the training records (fdg_audit.train.runs), then leakage.csv and report.md
when attacks / the report run.
"""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from .audit.checks import check_attacks
from .audit.coverage import estimate, plan_lines, write_coverage
from .bus import ARTIFACT_KINDS
from .audit.harness import run_attacks
from .errors import UserError
from .plugins import available, from_folder
from .protocol import load_method
from .report import write_report
from .report.traffic import bytes_summary
from .scenario import Scenario, dump_toml, load_raw, new_secrets, parse, plan, with_secrets
from .store.ledger import atomic_write, read_secrets
from .store.safe import read_in
from .store.runfolder import RunFolder
from .vocab import AttackEntry
from .train.runs import train_runs

__all__ = ["plan", "preview_of", "run_attacks_cli", "run_scenario"]


def preview_of(raw: dict) -> dict:
    """The scenario cut to a first answer: its first seed only (every data set, method and attack as they are; an
    attack or data set limited to some seeds gets the first seed). Named ``<name>_preview``."""
    raw = dict(raw, seeds=list(raw.get("seeds", [0]))[:1], name=f"{raw.get('name', 'scenario')}_preview")
    first = raw["seeds"][0]
    if raw.get("attack_seeds"):
        raw["attack_seeds"] = [first]
    for key in ("attacks", "datasets"):   # a data set limited to some seeds trains the first seed too
        if isinstance(raw.get(key), list):
            raw[key] = [dict(a, seeds=[first]) if isinstance(a, dict) and a.get("seeds") else a for a in raw[key]]
    return raw


def run_scenario(path: str, sets: list[str] = (), out: str | None = None, quiet: bool = False,
                 resume: str | None = None, preview: bool = False, yes: bool = False) -> Path:
    """Validate the whole plan (runs and attacks), then run it into a new folder, or into ``resume`` skipping the
    runs that folder already finished (``train_runs``); then attack the folder and report it.
    ``preview``: ``preview_of`` the scenario (one seed), marked as a preview in the manifest."""
    raw = load_raw(path, sets)
    if preview:
        raw = preview_of(raw)
    keys = read_secrets(Path(resume)) if resume else new_secrets(raw)
    runs = [dict(r, secret=str(r["dataset_index"]) if str(r["dataset_index"]) in keys else "")
            for r in plan(with_secrets(raw, keys))]
    sc0 = runs[0]["sc"]
    attack_cfgs = sc0.attacks   # AttackEntry as parsed: carried to the worker unopened (vocab.AttackParams)
    described = check_attacks(attack_cfgs, dict(timeout=sc0.attack_timeout, memory_gb=sc0.attack_memory_gb))
    check_filters(described, runs)
    plan_coverage(runs, described, quiet)
    est = cost_guard(runs, described, sc0.attack_budget_s, yes, quiet)
    # the recorded configuration is without the secret split seeds: those go to truth/
    root, summary, ledger = train_runs(runs, dump_toml(raw), keys, path, sets, out, resume, preview, quiet)
    summary["bytes"] = bytes_summary((asdict(e) for e in ledger.stream()), summary["runs"])
    atomic_write(root / "summary.json", json.dumps(summary, indent=1, default=str))
    try:
        if attack_cfgs:
            run_attacks(root, attack_cfgs, quiet=quiet, parallel=sc0.parallel, threads=sc0.threads,
                        resume=resume is not None, estimates=est)
        write_coverage(root)
        if sc0.report:
            write_report([root], root, quiet=quiet)
    except KeyboardInterrupt:
        again = shlex.join([str(path)] + (["--set", *sets] if sets else []))
        raise UserError(f"interrupted while attacking or reporting: all {len(runs)} runs and every finished attack "
                        f"job are kept in {root}; go on with: python -m fdg_audit scenario {again} --resume "
                        f"{shlex.quote(str(root))}") from None
    if any(r["status"] != "ok" for r in summary["runs"]):
        failed = [r["run"] for r in summary["runs"] if r["status"] != "ok"]
        raise RuntimeError(f"{len(failed)} run(s) failed (see {root / 'summary.json'}): {', '.join(failed)}")
    return root


def plan_coverage(runs: list[dict], described: dict, quiet: bool = False) -> None:
    """Before training: each method's declared kinds are registered (one line if not), and the plan says which kinds
    each method will send and which attacks read them, with a warning for a kind no attack reads (on stderr, even
    when quiet)."""
    methods = {}
    for r in runs:
        m = load_method(r["method"].name)
        bad = [k for k in m.kinds if k not in ARTIFACT_KINDS]
        if not m.kinds or bad:
            raise UserError(f"method {r['method'].label}: " + (f"declares kind {bad[0]!r}, which is not registered: call "
                            f"fdg_audit.api.method.register_kind({bad[0]!r}) in its module" if bad else
                            "declares no kinds: list every artifact kind it sends in its class attribute kinds "
                            "(methods/README.md)"))
        methods[r["method"].label] = tuple(m.kinds)
    lines, warns = plan_lines(methods, {label: (d.consumes, d.ignores) for label, d in described.items()})
    if not quiet:
        print("\n".join(lines))
    for w in warns:
        print(w, file=sys.stderr)


def cost_guard(runs: list[dict], described: dict, budget: float, yes: bool = False, quiet: bool = False) -> dict:
    """Before training: each attack's estimated CPU seconds over the plan (``coverage.estimate``, from the attacks'
    own costs per run, victim and image); above ``attack_budget_s`` one line that names the dearest attacks and the
    knobs, unless ``yes``. An attack that declares no cost is named as not estimated (left out of the total, never
    counted as 0). Returns the estimates (None: not estimated)."""
    plan = [dict(kinds=load_method(r["method"].name).kinds, target=r["target"], seed=r["seed"], dataset=r["ds"].label,
                 steps=local_steps(r["params"]),
                 clients={c.name: len(c.train.y) for d in r["data"].domains if d.name != r["target"]
                          for c in r["data"].clients(d.name)}) for r in runs]
    est = estimate(described, plan)
    known = {a: s for a, s in est.items() if s is not None}
    total, top = sum(known.values()), sorted(known.items(), key=lambda kv: -kv[1])[:3]
    none = sorted(a for a, s in est.items() if s is None)
    left = f"; not estimated (not in the total): {', '.join(none)}" if none else ""
    if not quiet and est:
        print(f"attacks: about {total / 60:.1f} CPU min estimated ({', '.join(f'{a} {s:.0f} s' for a, s in top)})" + left)
    if total > budget and not yes:
        raise UserError(f"the attacks are estimated at {total:.0f} CPU s, over attack_budget_s = {budget:g} (dearest: "
                        f"{', '.join(f'{a} {s:.0f} s' for a, s in top)}{left}): lower their iterations/restarts, "
                        f"max_images or max_victims, limit them with targets/seeds/datasets (or exclude them), raise "
                        f"attack_budget_s, or pass --yes")
    return est


def local_steps(params):
    """n -> the local steps of a client of n images under the method's training parameters (one round)."""
    return lambda n: getattr(params, "local_steps", 0) or -(-n // getattr(params, "batch_size", 32)) * \
        getattr(params, "local_epochs", 1)


def check_filters(described: dict, runs: list[dict]) -> None:
    """Each attack's ``targets``, ``seeds`` and ``datasets`` (its ``AttackParams``, built and checked in the probe's
    worker and again on its answer) name held-out domains, seeds and data sets of the plan."""
    held_out, seeds, labels = {r["target"] for r in runs}, runs[0]["sc"].seeds, {r["ds"].label for r in runs}
    for label, d in described.items():
        p, where = d.p, f"attacks.{label}"
        if set(p.targets) - held_out:
            raise UserError(f"{where}.targets = {p.targets!r}: no run holds out {sorted(set(p.targets) - held_out)}; "
                            f"use held-out domains of this scenario ({', '.join(sorted(held_out))}) or []")
        if set(p.seeds) - set(seeds):
            raise UserError(f"{where}.seeds = {p.seeds!r}: give a list of this scenario's seeds ({seeds}) or []")
        if set(p.datasets) - labels:
            raise UserError(f"{where}.datasets = {p.datasets!r}: give a list of this scenario's dataset labels "
                            f"({', '.join(sorted(labels))}) or []")


def run_attacks_cli(run_dir: str, names: list[str], quiet: bool = False, trust: bool = False,
                    isolate: bool = True, resume: bool = False) -> str:
    """``attack RUN_DIR``: plugins named by the folder load only if installed (or ``trust``); ``names`` are the
    user's own choice (command line) and load from anywhere. ``resume``: keep the jobs an interrupted attack of
    the same settings finished (``run_attacks``)."""
    root = Path(run_dir)
    RunFolder(root).summary()
    with from_folder(root, allow=names, trust=trust):
        cfg = root / "config.resolved.toml"   # its attacks, and its parallel and threads settings
        sc = parse(load_raw(cfg)) if read_in(root, cfg) is not None or not names else Scenario()   # data first
        conf = sc.attacks
        # a name on the command line takes the folder's settings of the entry of that label (else of that name)
        pick = lambda n: next((c for c in conf if c.label == n), None) or \
            next((c for c in conf if c.name == n), None) or AttackEntry(n)  # noqa: E731
        cfgs = [pick(n) for n in names] if names else conf or [AttackEntry(n) for n in sorted(available("attack"))]
        out = run_attacks(root, cfgs, quiet, isolate, sc.parallel, sc.threads, resume)
    cov = write_coverage(root)
    return (f"leakage: {out}; coverage: {cov}; report.md not updated: python -m fdg_audit report "
            f"{shlex.quote(str(root))}")
