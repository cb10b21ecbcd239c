"""Attack framework: threat model (AdversaryView + Aux) apart from attack, truth apart from both.

An attack plugin is a class with
  ``name``; ``consumes`` (artifact kinds); ``adversary`` ("server" | "client" | "eavesdropper");
  ``aux`` (subset of "public", "domain_samples", "candidates", "layout"); ``target`` ("reconstruction" |
  "membership" | "attribute" | "label_dist" | "dataset_size"); ``Params`` (dataclass);
  ``run(view, aux) -> list[Output]`` (Reconstruction | Scores | Predictions | Estimate, or Skipped with a
  reason) and ``control() -> list[Control]`` (positive controls that must succeed and negative controls that
  must stay at chance, on data the attack builds itself; any failed control turns the attack's numbers into
  "not measurable").
It sees only the AdversaryView (what that adversary received or sent) and the Aux it declared. Ground truth
never reaches ``run``: the scorer joins outputs with truth using the one metrics module. Membership scores of
several victims are also scored pooled (victim "pooled"), which resolves lower FPRs. The scorer also keeps the
per-item values behind each number (per-image PSNR/SSIM of reconstruction and baseline, per-candidate membership
scores and labels, per-row attribute correctness, per-victim estimates) in items/<attack>/<run>.npz, for the
scorecard's intervals and held-out selection. An attack applies to a run when its adversary observed a kind it
``consumes`` (``applicable``; ``selection`` lists them per run), which is how ``attacks = "all"`` picks attacks.
attacks/README.md is the how-to.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import io
import json
import sys
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from . import metrics as M
from .data import Split
from .errors import UserError
from .ledger import Ledger, atomic_write
from .plugins import available, load_attack
from .api.attack import (ADVERSARIES, AUX, AdversaryView, Attack, AttackParams, Audit, Aux, Control,  # noqa: F401
                         Estimate, Predictions, Reconstruction, Scores, Skipped, federate, sample_victims,
                         view_envelopes)
from .sandbox import AttackFailed, portrait, run_isolated, stop_workers

# ------------------------------------------------------------------------------------------- truth + scoring

class Truth:
    def __init__(self, root: Path, run: dict):
        self.root, self.run, self.data = root, run, run["data"]
        self.pool = {d.name: (torch.cat([d.train.x, d.val.x]), torch.cat([d.train.y, d.val.y]),
                              np.concatenate([d.train.idx, d.val.idx])) for d in self.data.domains}
        self.by_idx = {}
        for name, (x, y, idx) in self.pool.items():
            for i, g in enumerate(idx):
                self.by_idx[int(g)] = (name, i)

    def images(self, idx) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        locs = [self.by_idx[int(g)] for g in idx]
        x = torch.stack([self.pool[d][0][i] for d, i in locs])
        y = torch.stack([self.pool[d][1][i] for d, i in locs])
        return x, y, [d for d, _ in locs]

    def record(self, victim: str, name: str) -> dict:
        if name == "train":
            return {"idx": np.concatenate([self.data.domain(v).train.idx for v in victim.split("+")])}
        f = self.root / "truth" / self.run["run_id"] / victim / f"{name}.npz"
        if not f.exists():
            raise FileNotFoundError(f"no ground truth {f}")
        from .ledger import load_npz
        return load_npz(f)


def build_aux(run: dict, need: tuple, seed: int = 0) -> tuple[Aux, dict]:
    """The attacker's auxiliary data and the membership truth of its candidate pools."""
    data, target = run["data"], run["target"]
    t = data.domain(target)
    aux = Aux(num_classes=data.num_classes, domains=[d.name for d in data.domains if d.name != target])
    members = {}
    if "layout" in need:
        aux.layout = dict(data.layout)
    if "public" in need:
        aux.public = Split(torch.cat([t.train.x, t.val.x]), torch.cat([t.train.y, t.val.y]),
                           np.concatenate([t.train.idx, t.val.idx]))
    rng = np.random.default_rng(seed)
    for d in data.domains:
        if d.name == target:
            continue
        half = len(d.val.y) // 2
        if "domain_samples" in need:
            aux.domain_samples[d.name] = Split(d.val.x[half:], d.val.y[half:], d.val.idx[half:])
        for c in data.clients(d.name):   # one victim per client (the domain itself with one client per domain)
            if c is not d and "domain_samples" in need:
                aux.domain_samples[c.name] = aux.domain_samples[d.name]
            if "candidates" not in need:
                continue
            # non-members come from the first half of the domain's val split (the second half is public); with
            # several clients per domain they are shared: no client of the domain trained on them
            n = min(half, len(c.train.y))
            if n == 0:
                continue
            mi, out = rng.choice(len(c.train.y), n, replace=False), rng.choice(half, n, replace=False)
            x = torch.cat([c.train.x[mi], d.val.x[out]])
            y = torch.cat([c.train.y[mi], d.val.y[out]])
            lab = np.r_[np.ones(n), np.zeros(n)]
            p = rng.permutation(2 * n)
            # ids are positions in the pool: global image ids would reveal the train/val split (membership)
            aux.candidates[c.name] = Split(x[p], y[p], np.arange(2 * n))
            members[c.name] = lab[p]
    return aux, members


def score(out, truth: Truth, members: dict, aux: Aux) -> list[dict]:
    """Join one attack output with the truth; return (metric, value, baseline) rows."""
    rows = []
    add = lambda metric, value, baseline=float("nan"), items=None, base=None: rows.append(  # noqa: E731
        dict(metric=metric, value=float(value), baseline=float(baseline), items=items, base_items=base))
    I = M.stats.Items
    if isinstance(out, Reconstruction):
        rec = truth.record(out.victim, out.truth)
        idx = rec["idx"] if out.rows is None else rec["idx"][np.asarray(out.rows)]
        x, y, _ = truth.images(idx)
        r = out.images.detach().cpu().float().clamp(0, 1)
        b = out.baseline.cpu().float() if out.baseline is not None else \
            (aux.public.x if aux.public is not None else x).mean(0, keepdim=True).expand_as(r)
        xb, pred = x, None if out.labels is None else np.asarray(out.labels)
        if out.rows is None:  # match each image (baselines on their own) to a distinct true image
            from scipy.optimize import linear_sum_assignment
            ri, ci = linear_sum_assignment(((r[:, None] - x[None]) ** 2).flatten(2).mean(-1).numpy())
            bi, bc = linear_sum_assignment(((b[:, None] - x[None]) ** 2).flatten(2).mean(-1).numpy())
            r, b, xb, x, y = r[ri], b[bi], x[bc], x[ci], y[ci]
            pred = None if pred is None else pred[ri]
        ps = M.aligned_psnr(r, x) if out.aligned else M.psnr(r, x)
        bs = M.aligned_psnr(b, xb) if out.aligned else M.psnr(b, xb)
        ss = M.ssim(M.aligned(r, x) if out.aligned else r, x)
        sb = M.ssim(M.aligned(b, xb) if out.aligned else b, xb)
        ids = _image_ids(idx if out.rows is not None else idx[ci])
        per = lambda v: I("mean", np.asarray(v, float), ids=ids)  # noqa: E731  (per-image values)
        add("psnr", ps.mean(), bs.mean(), per(ps), per(bs))
        add("psnr_max", ps.max(), bs.max())
        add("ssim", ss.mean(), sb.mean(), per(ss), per(sb))
        add("success@25dB", M.success_rate(ps, 25.0), M.success_rate(bs, 25.0), per(ps >= 25.0), per(bs >= 25.0))
        if pred is not None:
            hit = pred == y.numpy()
            add("label_acc", float(hit.mean()), M.chance(aux.num_classes), per(hit))
        out.scored = (x, r, b)
    elif isinstance(out, Scores):
        vs = out.victims or [out.victim]
        lab = np.concatenate([members[v] for v in vs])
        ids = np.concatenate([_image_ids(np.arange(len(members[v])), v) for v in vs])
        add("auc", M.auc(out.scores, lab), 0.5, I("auc", np.asarray(out.scores, float), lab.astype(int), ids))
        for f in (0.01, 0.001, 0.0):
            add(f"tpr@{f:g}fpr", M.tpr_at_fpr(out.scores, lab, f), f)
    elif isinstance(out, Predictions):
        rec = truth.record(out.victim, out.truth)
        idx = rec["idx"] if out.rows is None else rec["idx"][np.asarray(out.rows)]
        _, y, doms = truth.images(idx)
        true = y.numpy() if out.attribute == "class" else np.array([aux.domains.index(d) for d in doms])
        add(f"{out.attribute}_balanced_acc", M.balanced_accuracy(out.pred, true, out.n_classes),
            M.chance(out.n_classes), I("balanced_acc", (np.asarray(out.pred) == true).astype(float), true,
                                       _image_ids(idx)))
    elif isinstance(out, Estimate):
        y = truth.data.domain(out.victim).train.y.numpy()
        one = lambda v: I("mean", np.array([float(v)]), ids=_image_ids([0], out.victim))  # noqa: E731  (item: victim)
        if out.quantity == "n_samples":
            # baseline: guess the size of the attacker's own public set (a domain it holds), when it has one
            e = M.relative_error(float(np.ravel(out.value)[0]), len(y))
            eb = M.relative_error(len(aux.public.y), len(y)) if aux.public is not None else float("nan")
            add("n_samples_rel_error", e, eb, one(e), None if np.isnan(eb) else one(eb))
        else:
            counts = np.bincount(y, minlength=len(out.value))
            prior = np.full(len(counts), len(y) / len(counts))
            acc, accb = M.label_count_accuracy(np.asarray(out.value), counts), M.label_count_accuracy(prior, counts)
            add("label_count_acc", acc, accb, one(acc), one(accb))
            # the distribution alone (1 - total variation): the estimate rescaled to the true total, so an error in
            # the victim's size (scored as dataset_size) does not count twice; the prior is already at that total
            v = np.asarray(out.value, float)
            dist = float(M.label_count_accuracy(v * len(y) / v.sum(), counts)) if v.sum() > 0 else float("nan")
            add("label_dist_acc", dist, accb, one(dist), one(accb))
            add("label_existence_f1", M.existence_f1(np.asarray(out.value), counts),
                M.existence_f1(np.ones(len(counts)), counts))
    elif isinstance(out, Audit):
        from .privacy.audit import audit_rows
        rows += audit_rows(out, truth.record(out.victim, out.truth))
    else:
        raise TypeError(f"attack returned {type(out).__name__}; return Reconstruction, Scores, Predictions, "
                        "Estimate or Audit")
    return rows


def _image_ids(idx, victim: str = "") -> np.ndarray:
    """Item identities for the held-out split: global image ids, or pool positions salted by the victim's name."""
    salt = (zlib.crc32(victim.encode()) & 0x7FFFFFFF) << 32 if victim else 0
    return np.asarray(idx, np.int64) + np.int64(salt)


# ------------------------------------------------------------------------------------------- harness

LEAK_FIELDS = ["run", "dataset", "method", "variant", "target", "seed", "attack", "adversary", "artifact",
               "round", "victim", "output", "metric", "value", "baseline", "status"]


def _runs(root: Path, summary: dict | None = None) -> dict[str, dict]:
    from .ledger import read_secrets, read_summary
    from .scenario import load_raw, plan, with_secrets
    summary = summary or read_summary(root)
    planned = {r["run_id"]: r for r in plan(with_secrets(load_raw(root / "config.resolved.toml"), read_secrets(root)))}
    out = {}
    for s in summary["runs"]:
        if s.get("status") != "ok" or s["run"] not in planned:
            continue
        p = planned[s["run"]]
        d = p["data"]
        out[s["run"]] = dict(s, run_id=s["run"], data=d, model_cfg=p["sc"].model,
                             shape=(d.channels, d.size, d.num_classes), params=s["params"])
    return out


OUTPUTS = {c.__name__: c for c in (Reconstruction, Scores, Predictions, Estimate, Audit, Skipped, Control)}


@dataclass
class Described:
    """An attack as the harness knows it: what a metadata probe read off the plugin in a throw-away worker
    (``describe``), so that plugin code (its import, ``__init__``) never runs in the harness. ``p``: its
    parameters after ``__init__``, as plain values."""
    name: str
    consumes: tuple
    adversary: str
    aux: tuple
    target: str
    p: Any


_DESCRIBED: dict = {}   # probe results of this process, by (attack config, device, import path)


def describe(cfg: dict, device) -> tuple[str, Any, dict]:
    """(label, attack, job spec for the worker) of one [[attacks]] entry, validated. The attack is a ``Described``
    read by a probe worker (one per entry and process); the name is checked against a run folder's guard
    (``plugins.resolve``) first."""
    from .params import safe_name
    from .plugins import import_path, resolve
    cfg = dict(cfg)
    name, label = cfg.pop("name"), cfg.pop("label", None) or None
    resolve("attack", name)
    key = (json.dumps(cfg, sort_keys=True, default=str), name, str(device), tuple(import_path(name)))
    if key not in _DESCRIBED:
        job = dict(attack=name, label=label, params=cfg, device=str(device), mode="describe")
        _DESCRIBED[key] = _checked(run_isolated(job, OUTPUTS)["describe"], label or name)
    d = _DESCRIBED[key]
    label = label or d.name or name
    safe_name(label, f"attacks.{label}.label")
    return label, d, dict(attack=name, label=label, params=cfg, device=str(device))


def _checked(d, label: str) -> Described:
    """A probe's answer, checked as data from plugin code: the harness decides with it which runs and views the
    worker gets."""
    strs = lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)  # noqa: E731
    if not (isinstance(d, dict) and isinstance(d.get("name"), str) and strs(d.get("consumes"))
            and strs(d.get("aux")) and isinstance(d.get("params"), dict)):
        raise UserError(f"attack {label}: its class does not describe itself (name, consumes, aux, Params): "
                        "see attacks/README.md")
    if d.get("adversary") not in ADVERSARIES:
        raise UserError(f"attack {label}: adversary {d.get('adversary')!r} is not one of {ADVERSARIES}")
    if set(d["aux"]) - set(AUX):
        raise UserError(f"attack {label}: aux {sorted(set(d['aux']) - set(AUX))} unknown; use a subset of {AUX}")
    p = SimpleNamespace(**d["params"])
    mv = getattr(p, "max_victims", 0)
    if not isinstance(mv, int) or isinstance(mv, bool) or mv < 0:
        raise UserError(f"attacks.{label}.max_victims = {mv!r}: use 0 (every victim) or a positive integer")
    return Described(d["name"], tuple(d["consumes"]), d["adversary"], tuple(d["aux"]), str(d.get("target", "")), p)


def make_attack(cfg: dict, device):
    """(label, attack instance, job spec) built in this process, for ``isolate = False`` (debugging only: plugin
    code then runs in the harness)."""
    from .params import safe_name, typed
    cfg = dict(cfg)
    name, label = cfg.pop("name"), cfg.pop("label", None) or None
    cls = load_attack(name)
    label = label or cls.name or name
    safe_name(label, f"attacks.{label}.label")
    atk = cls(typed(cls.Params, cfg, f"attacks.{label}"), device)
    _checked(portrait(atk), label)
    return label, atk, dict(attack=name, label=label, params=cfg, device=str(device))


def _make(cfg: dict, device, isolate: bool = True):
    return describe(cfg, device) if isolate else make_attack(cfg, device)


def check_attacks(attack_cfgs: list[dict]) -> None:
    """Every attack loads and its parameters are valid (before any training), each probed in a worker."""
    for c in attack_cfgs:
        describe(c, "cpu")


def _controls(atk, job: dict, isolate: bool) -> list:
    if not isolate:
        return atk.control()
    try:
        return run_isolated(dict(job, mode="control"), OUTPUTS)["controls"]
    except AttackFailed as e:
        print(f"attack {job['label']}: control() failed: {e.detail or e}", file=sys.stderr)
        return [Control(f"control() failed: {e}", "", float("nan"), float("nan"))]


def _execute(atk, job: dict, ledger, envs: list, run: dict, me: str, aux, device, isolate: bool) -> list:
    """Run one attack on one run: in a worker process that sees only the materialised view (default), or in
    this process (``isolate=False``, debugging only: nothing is enforced there)."""
    if not isolate:
        return atk.run(AdversaryView(ledger, run, atk.adversary, me, device), aux)
    proto = dict(run_id=run["run_id"], plugin=run["plugin"], params=run["params"], shape=list(run["shape"]),
                 model_cfg=dataclasses.asdict(run["model_cfg"]), clients=list(run["clients"]))
    job = dict(job, mode="run", run=proto, adversary=atk.adversary, me=me)
    return run_isolated(job, OUTPUTS, ledger, envs, aux)["outputs"]


def run_attacks(root, attack_cfgs: list[dict], quiet: bool = False, isolate: bool = True, parallel: int = 1,
                threads: int = 0) -> Path:
    """Run attacks on every finished run of a run folder; write leakage.csv, controls and grids.

    ``isolate``: each attack runs in a worker process on a materialised view (fdg_audit.sandbox); False runs
    it in this process, for debugging, with no boundary enforced. ``parallel``: worker processes at once (an
    attack's control and its runs), each on ``threads`` torch threads (0: this process's count split among them);
    rows, items and grids come out in plan order whatever finishes first."""
    from .ledger import open_verified, read_summary
    from .params import resolve_device
    root = Path(root)
    summary = read_summary(root)
    ledger = open_verified(root, summary)
    runs = _runs(root, summary)
    device = torch.device(resolve_device("auto"))
    attacks = [_make(c, device, isolate) for c in attack_cfgs]
    used = {label for labels in _selection(ledger, runs, attacks, device, True).values() for label in labels}
    attacks = [a for a in attacks if a[0] in used]   # no controls for attacks without a run
    parallel = max(1, parallel) if isolate else 1
    threads = threads or (max(1, torch.get_num_threads() // parallel) if parallel > 1 else 0)
    rows, controls, cache = [], [], {}
    pool = ThreadPoolExecutor(parallel) if parallel > 1 else None   # threads that wait on worker processes
    try:
        for label, atk, job in attacks:
            job = dict(job, threads=threads) if threads else job
            rows += attack_runs(root, label, atk, job, ledger, runs, cache, controls, device, isolate, pool, quiet)
    finally:   # an error or Ctrl-C: queued jobs never start, the attack processes still running stop at once
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        stop_workers()
    # re-running some attacks replaces their rows and controls and keeps every other attack's
    labels = {label for label, _, _ in attacks}
    if (root / "leakage.csv").exists():
        with open(root / "leakage.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["attack"] not in labels] + rows
    if (root / "controls.json").exists():
        controls = [c for c in json.loads((root / "controls.json").read_text()) if c["attack"] not in labels] + controls
    _write_rows(root / "leakage.csv", rows, LEAK_FIELDS)
    atomic_write(root / "controls.json", json.dumps(controls, indent=1))
    if not quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    return root / "leakage.csv"


def attack_runs(root: Path, label: str, atk, job: dict, ledger, runs: dict, cache: dict, controls: list, device,
                isolate: bool, pool, quiet: bool) -> list[dict]:
    """One attack: its controls and every run it applies to (in ``pool``'s threads when given); appends to
    ``controls`` and returns the attack's rows (per-item values and grids are saved on the way)."""
    t0 = time.perf_counter()
    jobs, rows = [], []
    for run_id, run in runs.items():
        if not wanted(atk, run):
            continue
        me = observer(atk, run)
        if atk.adversary == "client" and me not in run["clients"]:
            jobs.append((run_id, run, me, None, None))   # a note row: this client is not in the run
            continue
        envs = view_envelopes(ledger, run_id, atk.adversary, me)
        if not applicable(atk, {e.kind for e in envs if ledger.stored(e)}):
            continue
        key = (run_id, tuple(sorted(atk.aux)))   # built once per run (and aux need), shared by the attacks
        if key not in cache:
            cache[key] = build_aux(run, atk.aux, run["seed"])
        jobs.append((run_id, run, me, envs, cache[key]))
    submit = (lambda f, *a: pool.submit(f, *a)) if pool is not None else _Later
    ctl = submit(_controls, atk, job, isolate)
    futs = [submit(_execute, *salted(atk, job, run["seed"]), ledger, envs, run, me, am[0], device, isolate)
            if envs is not None else None for run_id, run, me, envs, am in jobs]
    ok = True   # a failed positive control (attack too weak) or negative control (sees leakage where there is
    for c in ctl.result():   # none) makes every number of this attack "not measurable"
        ok &= c.passed
        controls.append(dict(attack=label, **dataclasses.asdict(c), passed=c.passed))
    status = "ok" if ok else "not measurable (control failed)"
    for (run_id, run, me, envs, am), fut in zip(jobs, futs):
        row = lambda o, victim, r: dict(  # noqa: E731
            {k: run.get(k, "") for k in ("dataset", "method", "variant", "target", "seed")}, run=run_id,
            attack=label, adversary=me, artifact=getattr(o, "artifact", ""), round=getattr(o, "round", ""),
            victim=victim, output=getattr(o, "variant", ""), status=status, **r)
        note = lambda metric, why, o=None, victim="": row(  # noqa: E731  (a row without a number)
            o, victim, dict(metric=metric, value=float("nan"), baseline=float("nan"))) | {"status": why}
        if fut is None:
            rows.append(note("skipped", f"skipped: {me} is not a client of this run"))
            continue
        if not quiet and sys.stderr.isatty():
            sys.stderr.write(f"\rattack {label} on {run_id} ...")
        aux, members = am
        truth = cache[run_id] if run_id in cache else cache.setdefault(run_id, Truth(root, run))
        try:
            outs = fut.result()
        except UserError:
            raise
        except Exception as e:  # keep the other attacks' and runs' numbers; record the failure
            detail = e.detail if isinstance(e, AttackFailed) else traceback.format_exc()
            print(f"attack {label} failed on {run_id}: {detail or e}", file=sys.stderr)
            rows.append(note("failed", f"failed: {e}" if isinstance(e, AttackFailed) else
                             f"failed: {type(e).__name__}: {e}"))
            continue
        start = len(rows)
        for o in outs:
            if isinstance(o, Skipped):
                rows.append(note("skipped", f"skipped: {o.reason}", o, o.victim))
                continue
            try:
                scored = score(o, truth, members, aux)
            except FileNotFoundError as e:   # e.g. a DP audit of a run without canaries
                rows.append(note("skipped", f"skipped: {e}", o, o.victim))
                continue
            rows += [row(o, o.victim, r) for r in scored]
            if isinstance(o, Reconstruction) and hasattr(o, "scored"):
                _save_grid(root, label, run_id, o)
        for o in _pooled(outs):   # membership scores pooled over victims (resolves lower FPRs)
            rows += [row(o, "pooled", r) for r in score(o, truth, members, aux)]
        _save_scores(root, label, run_id, outs, members)
        _save_items(root, label, run_id, rows[start:])
    attacked = sum(f is not None for f in futs)
    if not quiet and not sys.stderr.isatty() and attacked:   # batch jobs: one line per attack
        print(f"attack {label}: {attacked} runs, {time.perf_counter() - t0:.0f} s"
              + ("" if ok else " (a control failed: not measurable)"), file=sys.stderr, flush=True)
    return rows


class _Later:
    """A call made when its ``result()`` is asked for, as a future's (the serial path of ``attack_runs``: the
    control first, then each run in plan order)."""

    def __init__(self, f, *a):
        self.call = lambda: f(*a)

    def result(self):
        return self.call()


def salted(atk, job: dict, run_seed: int) -> tuple:
    """The attack (and its worker job) with its ``seed`` parameter salted by the run's seed, so that runs of
    different seeds draw independent attack randomness (restarts, batches, probes) and the intervals over seeds
    include it; an attack without a ``seed`` parameter is returned as is. Controls keep the unsalted seed."""
    if not hasattr(atk.p, "seed"):
        return atk, job
    seed = zlib.crc32(f"{atk.p.seed}:{int(run_seed)}".encode())
    a = copy.copy(atk)
    a.p = copy.copy(atk.p)
    a.p.seed = seed
    return a, dict(job, params=dict(job["params"], seed=seed))


def observer(atk, run: dict) -> str:
    """The party whose view the attack reads: server, eavesdropper, or the curious client (default the first)."""
    return {"server": "server", "eavesdropper": "eavesdropper"}.get(atk.adversary) or \
        atk.p.as_client or run["clients"][0]


def applicable(atk, kinds) -> bool:
    """Whether an attack applies to a run: its adversary observed an artifact kind the attack consumes."""
    return bool(set(atk.consumes) & set(kinds))


def selection(root, attack_cfgs: list[dict]) -> dict[str, list[str]]:
    """{run: labels of the attacks that apply to it}, as ``run_attacks`` decides, without running them."""
    root = Path(root)
    device = torch.device("cpu")
    return _selection(Ledger.open(root), _runs(root), [_make(c, device) for c in attack_cfgs], device)


def wanted(atk, run: dict) -> bool:
    """The attack's ``targets`` and ``seeds`` filters (empty: every run)."""
    return (not atk.p.targets or run["target"] in atk.p.targets) and \
        (not atk.p.seeds or int(run.get("seed", 0)) in [int(s) for s in atk.p.seeds])


def _selection(ledger, runs: dict, attacks: list, device, absent_client: bool = False) -> dict[str, list[str]]:
    """``absent_client``: also list a curious-client attack whose client is not in the run (it gets a note row)."""
    out = {}
    for run_id, run in runs.items():
        out[run_id] = []
        for label, atk, *_ in attacks:
            me = observer(atk, run)
            if atk.adversary == "client" and me not in run["clients"]:
                if absent_client and wanted(atk, run):
                    out[run_id].append(label)
                continue
            if wanted(atk, run) and \
                    applicable(atk, {e.kind for e in view_envelopes(ledger, run_id, atk.adversary, me)
                                     if ledger.stored(e)}):
                out[run_id].append(label)
    return out


def _pooled(outs: list) -> list:
    """One Scores per (artifact, round, variant) concatenating every victim's, when there are several victims."""
    groups: dict = {}
    for o in outs:
        if isinstance(o, Scores):
            groups.setdefault((o.artifact, o.round, o.variant), []).append(o)
    return [Scores("pooled", a, r, np.concatenate([np.asarray(o.scores) for o in g]), v,
                   victims=[o.victim for o in g]) for (a, r, v), g in groups.items() if len(g) > 1]


def _save_scores(root: Path, label: str, run_id: str, outs: list, members: dict) -> None:
    """Raw membership scores for ROC plots and pooling across runs: ``mia/<attack>/<run>.npz`` with one entry
    per candidate: ``score`` (float64, higher = member), ``member`` (int8 truth), ``victim``, ``variant`` (str),
    ``round`` (int64); select one attack output with ``variant == v`` (and ``victim``)."""
    outs = [o for o in outs if isinstance(o, Scores) and not o.victims]
    if not outs:
        return
    rep = lambda f: np.concatenate([np.repeat(f(o), len(o.scores)) for o in outs])  # noqa: E731
    buf = io.BytesIO()
    np.savez_compressed(buf, score=np.concatenate([np.asarray(o.scores, np.float64) for o in outs]),
                        member=np.concatenate([members[o.victim] for o in outs]).astype(np.int8),
                        victim=rep(lambda o: o.victim), variant=rep(lambda o: o.variant),
                        round=rep(lambda o: o.round).astype(np.int64))
    atomic_write(root / "mia" / label / (run_id.replace("/", "__") + ".npz"), buf.getvalue())


ITEM_KEYS = ("run", "attack", "adversary", "artifact", "round", "victim", "output", "metric", "status")


def _save_items(root: Path, label: str, run_id: str, rows: list) -> None:
    """Per-item values behind each scored row, for intervals and held-out selection (fdg_audit.metrics.stats):
    ``items/<attack>/<run>.npz`` holds ``meta`` (a JSON list, one entry per row: the leakage.csv keys, the item
    kind, and which arrays it has) and arrays ``<j>/<x|y|ids>`` (the attack's values) and ``<j>/b<x|y|ids>`` (its
    baseline's, when the baseline varies per item; else the baseline is the constant in leakage.csv)."""
    meta, arrays = [], {}
    for r in rows:
        if r.get("items") is None:
            continue
        j = len(meta)
        b = r.get("base_items")
        meta.append({k: r.get(k, "") for k in ITEM_KEYS} | {"kind": r["items"].kind, "base": b and b.kind})
        for pre, it in (("", r["items"]), ("b", r.get("base_items"))):
            if it is not None:
                arrays |= {f"{j}/{pre}{f}": np.asarray(getattr(it, f)) for f in ("x", "y", "ids")
                           if getattr(it, f) is not None}
    if not meta:
        return
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array(json.dumps(meta, default=str)), **arrays)
    atomic_write(root / "items" / label / (run_id.replace("/", "__") + ".npz"), buf.getvalue())


def load_items(path) -> list[dict]:
    """The rows of one ``items/<attack>/<run>.npz``: leakage keys plus ``items`` and ``base`` (Items or None)."""
    from .ledger import load_npz
    out, z = [], load_npz(Path(path))
    try:
        meta = json.loads(str(z["meta"]))
        for j, m in enumerate(meta):
            get = lambda pre, f: z.get(f"{j}/{pre}{f}")  # noqa: E731
            it = lambda pre, kind: M.stats.Items(kind, get(pre, "x"), get(pre, "y"), get(pre, "ids"))  # noqa: E731
            out.append(dict(m, items=it("", m["kind"]), base=it("b", m["base"]) if m["base"] else None))
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{path} is not an attack's per-item file ({type(e).__name__}: {e}): the run folder is "
                        "damaged; re-run the attacks") from None
    return out


def _save_grid(root: Path, label: str, run_id: str, o: Reconstruction, n: int = 8) -> None:
    x, r, b = o.scored
    buf = io.BytesIO()
    np.savez_compressed(buf, truth=x[:n].numpy(), recon=r[:n].numpy(), baseline=b[:n].cpu().float().numpy())
    safe, victim = run_id.replace("/", "__"), o.victim.replace("/", "@")     # client ids "rot15/0" -> "rot15@0"
    atomic_write(root / "recon" / label / f"{safe}__{victim}__{o.variant or 'main'}.npz", buf.getvalue())


def _write_rows(path: Path, rows: list[dict], fields: list[str]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def run_attacks_cli(run_dir: str, names: list[str], quiet: bool = False, trust: bool = False,
                    isolate: bool = True) -> str:
    """``attack RUN_DIR``: plugins named by the folder load only if installed (or ``trust``); ``names`` are the
    user's own choice (command line) and load from anywhere."""
    from .ledger import read_summary
    from .plugins import from_folder
    root = Path(run_dir)
    read_summary(root)
    with from_folder(root, allow=names, trust=trust):
        from .scenario import Scenario, load_raw, parse
        cfg = root / "config.resolved.toml"   # its attacks, and its parallel and threads settings
        sc = parse(load_raw(cfg)) if cfg.exists() or not names else Scenario()
        cfgs = [{"name": n} for n in names] if names else \
            [dict(name=a.name, label=a.label, **a.params) for a in sc.attacks] or \
            [{"name": n} for n in sorted(available("attack"))]
        out = run_attacks(root, cfgs, quiet, isolate, sc.parallel, sc.threads)
    return f"leakage: {out}"
