"""The round loop: one federation (one method, one held-out target, one seed) and its evaluation.

A method is a ``MethodPlugin`` (fdg_audit.protocol): ``Params``, ``Server``, ``Client``. The loop builds the
parties on an engine (fdg_audit.train.engines), runs round 0 (``Server.begin``) and rounds 1..R (``Server.step``),
and evaluates the global model every ``eval_every`` rounds.

Many clients: ``data.clients_per_domain = N`` splits each source domain into clients "<domain>/<k>"
(``DomainSet.clients``); ``participation = f`` asks a seeded sample of round(f * K) clients each training round
(``Server.active``; the ledger's envelopes record who was asked). ``cohort = "vmap"`` trains the clients of one
worker that support it (``Client.vmap_phase``) as one stacked model (fdg_audit.train.cohort); ``auto`` only on CUDA.

Public data (``data.public``): the server gets the public domain as ``Server.public`` and the ledger records it
once, in round 0, as a ``public_aux`` envelope from "public" to the server (its size and sha256, no images);
``model.pretrain_epochs = N`` first trains the model N epochs on it (``pretrain_public``), and every model the server
builds starts from that state. A method that declares ``public_data`` is refused without it.

Domain adaptation (``MethodPlugin.adaptation``): one more client, named like the held-out domain, holds its images
with labels -1 (``protocol.unlabeled``); it is never sampled out and never in ``clients``. Its true labels stay with
the harness, for evaluation only: selection is on the pooled source validation splits as for every method.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import seeding
from ..bus import Bus, register_kind
from ..data import DataConfig, DomainSet, Split, load_data
from .engines import LocalLink, ProcessLink, RemoteLink, assign, build_host
from ..errors import UserError
from ..metrics.stats import LATE   # a run selected in its last 10% of rounds has not converged
from ..models import ModelConfig, build_model
from ..params import asked
from ..protocol import accuracy, unlabeled
from ..protocol import load_method
from ..privacy import build_filters
from .ray_engine import RayWorkers
from .settings import check_participation, cohort_on

def cat_splits(splits: list[Split]) -> Split:
    return Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]),
                 np.concatenate([s.idx for s in splits]))


@dataclass
class RunSpec:
    run_id: str
    method: str                 # plugin name or "module:Class"
    params: Any                 # the method's Params instance
    data_cfg: DataConfig
    model_cfg: ModelConfig
    target: str
    seed: int = 0
    device: str = "cpu"
    engine: str = "local"       # local | process | ray
    threads: int = 1
    filters: dict | None = None
    privacy: Any = None         # fdg_audit.privacy.PrivacyConfig: DP-SGD, artifact filters, canaries
    workers: int = 0            # process/ray: number of workers hosting the clients (0: one per CPU, at most K)
    worker_threads: int = 1     # torch threads per worker (the local engine uses ``threads``)
    ray: dict = field(default_factory=dict)   # ray engine: address, num_cpus / num_gpus per worker (ray_engine.py)


PUBLIC_AUX = "public_aux"   # the ledger's record of the server's public data (size and hash)
register_kind(PUBLIC_AUX)
PRETRAIN_LR, PRETRAIN_BATCH = 1e-3, 64


def public_record(pub: Split, name: str) -> dict:
    """What the ledger records of the public data: its domain, size and the sha256 of its images, labels and ids."""
    h = hashlib.sha256()
    for a in (pub.x.cpu().numpy(), pub.y.cpu().numpy(), pub.idx):
        h.update(a.tobytes())
    return {"domain": name, "n": len(pub), "sha256": h.hexdigest()}


def pretrain_public(spec: RunSpec, data: DomainSet) -> dict:
    """``model.pretrain_epochs`` epochs of cross-entropy on the public data by the server before round 0 (Adam, lr
    PRETRAIN_LR, batches of PRETRAIN_BATCH), from the model zoo's initialisation (or ``model.weights``), seeded by the
    run's seed only, so every method of a scenario starts from the same state. Offline: nothing of it is sent."""
    mc, pub = spec.model_cfg, data.public
    torch.manual_seed(seeding.seed_int(spec.seed, "pretrain"))
    gen = seeding.torch_gen(spec.seed, "pretrain", "batches")
    net = build_model(mc, data.channels, data.num_classes, data.size).to(spec.device)
    opt = torch.optim.Adam(net.parameters(), lr=PRETRAIN_LR)
    x, y = pub.x.to(spec.device), pub.y.to(spec.device)
    net.train()
    for _ in range(mc.pretrain_epochs):
        for j in torch.randperm(len(y), generator=gen).split(PRETRAIN_BATCH):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x[j.to(x.device)]), y[j.to(x.device)]).backward()
            opt.step()
    return {k: v.detach().cpu() for k, v in net.state_dict().items()}


def check_public(method, model_cfg: ModelConfig, data: DomainSet) -> None:
    """One-line errors for public-data settings: a method that needs ``data.public``, pretraining without it."""
    if method.public_data and data.public is None:
        raise UserError(f"method {method.name} needs data.public ({method.public_data}): set data.public to a domain "
                        f"of the dataset outside the run, e.g. \"rot15\" when data.domains leaves it out")
    n = model_cfg.pretrain_epochs
    if n < 0 or (n and data.public is None):
        raise UserError(f"model.pretrain_epochs = {n}: use 0, or a positive number of epochs with data.public set to "
                        f"a domain outside the run (the server pretrains on it)")


def participants(seq: np.random.SeedSequence, clients: list[str], fraction: float, t: int) -> list[str]:
    """The round's sample of round(fraction * K) clients (at least one), in client order, from the run's seed
    sequence (its own stream, so the parties' random streams do not depend on the sampling)."""
    if fraction >= 1.0:
        return list(clients)
    m = asked(len(clients), fraction)
    rng = np.random.default_rng(seeding.child(seq, seeding.SAMPLE, t))
    return [clients[i] for i in np.sort(rng.choice(len(clients), m, replace=False))]


def run_federation(spec: RunSpec, ledger, data: DomainSet | None = None, on_round=None, truth_sink=None) -> dict:
    """Run one federation (one method, one held-out target, one seed) and evaluate it.

    Evaluation is the harness's, not a party's: every ``eval_every`` rounds (and after the last) it measures the
    global model on the pooled source validation splits and on the whole held-out domain. The reported round is
    chosen on source validation only (DomainBed's training-domain validation), never on the target: see
    ``select_round``."""
    method = load_method(spec.method)
    if truth_sink is not None:  # truth_sink(run_id, client, name, arrays); a client knows only its own id
        run_sink = truth_sink
        truth_sink = lambda cid, name, arrs: run_sink(spec.run_id, cid, name, arrs)  # noqa: E731
    data = data or load_data(spec.data_cfg)
    target = data.domain(spec.target)
    sources = [d for d in data.domains if d.name != target.name]
    check_public(method, spec.model_cfg, data)
    seq = seeding.run_seq(spec.seed, spec.run_id)
    shape = (data.channels, data.size, data.size, data.num_classes)
    filters = dict(spec.filters or {})
    for k, fs in build_filters(spec.privacy).items():   # fresh per run: accountants live for one run
        filters[k] = filters.get(k, []) + fs
    bus = Bus(ledger, spec.run_id, method.name, filters=filters, declared=method.kinds)
    pub = None
    if data.public is not None:
        bus.send("public", "public", "server", PUBLIC_AUX, {}, public_record(data.public, data.public_name))
        pub = Split(data.public.x.to(spec.device), data.public.y.to(spec.device), data.public.idx)
    base = dict(params=spec.params, device=spec.device, model_cfg=spec.model_cfg, shape=shape, seedseq=seq,
                privacy=spec.privacy, run_id=spec.run_id)
    parts = [c for d in sources for c in data.clients(d.name)]
    cids = [c.name for c in parts]
    base["target"] = tid = target.name if method.adaptation else None   # see MethodPlugin.adaptation
    hosted = parts + ([unlabeled(target)] if tid else [])   # labels are -1 before the target client is built
    fraction, cohort = float(spec.params.participation), cohort_on(spec.params)
    check_participation(method, fraction)
    link = _link(spec, method, bus, base, hosted, cohort, filters, truth_sink)
    try:
        pre = pretrain_public(spec, data) if spec.model_cfg.pretrain_epochs else None
        server = method.Server(dict(base, id="server", party=0, clients=cids, link=link, public=pub, pretrained=pre))
        val, tgt = (Split(s.x.to(spec.device), s.y.to(spec.device), s.idx)   # evaluation data stays on the device
                    for s in (cat_splits([d.val for d in sources]), cat_splits([target.train, target.val])))
        history = _rounds(spec, server, bus, seq, cids, fraction, val, tgt, on_round)
    finally:
        link.close()
    best, converged = select_round(history, len(val), spec.params.rounds)
    return {"history": history, "selected_round": best["round"], "target_acc": best["target_acc"],
            "source_val_acc": best["source_val_acc"], "final_target_acc": history[-1]["target_acc"],
            "converged": converged, "clients": cids, "adaptation": bool(tid),
            "extra": {k: v for k, v in best.items() if k not in ("round", "bytes", "asked", "source_val_acc",
                                                                   "target_acc")}}


def _link(spec: RunSpec, method, bus: Bus, base: dict, hosted: list, cohort, filters: dict, truth_sink):
    """The server's link to the clients of ``spec.engine``: in this process ("local"), or in worker processes
    ("process", "ray") that build their own clients (a worker masks the target's labels itself:
    engines.build_host)."""
    if spec.engine in ("process", "ray"):
        blocks = assign([d.name for d in hosted], spec.workers or os.cpu_count() or 1)
        party = {d.name: i + 1 for i, d in enumerate(hosted)}
        specs = [dict(base, method=spec.method, data_cfg=spec.data_cfg, clients={c: party[c] for c in b},
                      threads=spec.worker_threads, cohort=cohort, filters=filters, truth_fn=truth_sink is not None)
                 for b in blocks]
        if spec.engine == "process":
            return ProcessLink(bus, specs, truth_sink)
        return RemoteLink(bus, RayWorkers(specs, truth_sink, spec.ray, build_host))
    if spec.engine == "local":
        clients = {}
        for i, d in enumerate(hosted):
            clients[d.name] = method.Client(dict(base, id=d.name, party=i + 1, domain=d, truth_sink=truth_sink))
        return LocalLink(bus, clients, cohort)
    raise ValueError(f"unknown engine {spec.engine!r}")


def _rounds(spec: RunSpec, server, bus: Bus, seq, cids: list, fraction: float, val: Split, tgt: Split,
            on_round) -> list[dict]:
    """Rounds 0 (``begin``) to ``rounds`` of the server, each a row of the history (evaluated every
    ``eval_every`` rounds and after the last)."""
    history = []
    for t in range(0, spec.params.rounds + 1):
        bus.round = server.round = t
        server.reseed()
        server.active = cids if t == 0 else participants(seq, cids, fraction, t)
        server.begin() if t == 0 else server.step(t)
        row = {"round": t, "bytes": bus.sent.get(t, 0)}
        if fraction < 1.0:
            row["asked"] = len(server.active)
        if t > 0 and (t % max(1, spec.params.eval_every) == 0 or t == spec.params.rounds):
            m = server.global_model()
            row.update(source_val_acc=accuracy(m, val, spec.device), target_acc=accuracy(m, tgt, spec.device))
            row.update({k: float(v) for k, v in server.extra_metrics().items() if k not in row})
        history.append(row)
        if on_round:
            on_round(row)
    return history


def select_round(history: list[dict], n_val: int, rounds: int) -> tuple[dict, bool]:
    """(the selected evaluation row, converged). Training-domain validation with the one-standard-error rule
    (Breiman et al. 1984): the earliest evaluated round whose source-validation accuracy is within one binomial
    standard error, sqrt(a (1 - a) / n_val), of the best one a. On a plateau the validation noise would otherwise
    make the argmax land anywhere on it, the last rounds included; before the plateau the best round is the last
    one either way. converged: the selected round is before the last ``LATE`` share of the rounds."""
    ev = [r for r in history if "source_val_acc" in r]
    a = max(r["source_val_acc"] for r in ev)
    se = math.sqrt(a * (1 - a) / max(1, n_val))
    best = next(r for r in ev if r["source_val_acc"] >= a - se - 1e-12)
    return best, best["round"] <= rounds - max(1, math.ceil(LATE * rounds))
