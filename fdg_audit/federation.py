"""Parties, the round loop, seeding and the engines (in-process, worker processes, Ray actors in ray_engine.py).

A method is one class with three members: ``Params`` (a dataclass extending ``TrainParams``), ``Server`` and
``Client``. The server drives the protocol; a client answers messages with ``on_<phase>(msg) -> Reply|None``.
Server and clients never hold references to each other: every exchange goes through the Bus, and in the
``process`` and ``ray`` engines clients live in workers (each hosting some clients and loading only their data)
and see only the encoded bytes they are sent.

Many clients: ``data.clients_per_domain = N`` splits each source domain into clients "<domain>/<k>"
(``DomainSet.clients``); ``participation = f`` asks a seeded sample of round(f * K) clients each training round
(``Server.active``; the ledger's envelopes record who was asked). ``cohort = "vmap"`` trains the clients of one
worker that support it (``Client.vmap_phase``) as one stacked model (fdg_audit.cohort); ``auto`` only on CUDA.

Seeding: one ``numpy.random.SeedSequence`` per run (master seed + run id), then one child per
(party, round, call). Before every call the engine reseeds the party's ``rng`` (numpy), ``gen`` (torch CPU
generator) and torch's global RNG from that child, so both engines give identical ledgers on CPU.
"""
from __future__ import annotations

import math

import multiprocessing as mp
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from .bus import Bus, Payload
from .data import DataConfig, Domain, DomainSet, Split, load_data
from .errors import UserError
from .models import ModelConfig, build_model
from .params import TrainParams, asked, make_optimizer, resolve_device  # noqa: F401  (re-exported for methods)


@dataclass
class Reply:
    kind: str
    arrays: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)


def state_arrays(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state (parameters and buffers, e.g. BN running statistics) as named arrays."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def load_arrays(model: torch.nn.Module, arrays: dict[str, torch.Tensor]) -> torch.nn.Module:
    dev = next(model.parameters()).device
    model.load_state_dict({k: v.to(dev) for k, v in arrays.items()})
    return model


def seed_sequence(seed: int, run_id: str) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, zlib.crc32(run_id.encode())])


class Party:
    def __init__(self, ctx: dict):
        self.id: str = ctx["id"]
        self.params = ctx["params"]
        self.device = torch.device(ctx["device"])
        self.model_cfg: ModelConfig = ctx["model_cfg"]
        self.privacy = ctx.get("privacy")     # fdg_audit.privacy.PrivacyConfig or None
        self.shape: tuple[int, int, int, int] = ctx["shape"]   # (channels, size, size, num_classes)
        self.round = 0
        self._seq: np.random.SeedSequence = ctx["seedseq"]
        self._party: int = ctx["party"]
        self._calls: dict[int, int] = {}
        self.reseed()

    def reseed(self) -> None:
        n = self._calls.get(self.round, 0)
        self._calls[self.round] = n + 1
        child = np.random.SeedSequence(self._seq.entropy, spawn_key=(self._party, self.round, n))
        s = int(child.generate_state(1, np.uint64)[0] & 0x7FFF_FFFF_FFFF_FFFF)
        self.rng = np.random.default_rng(child)
        self.gen = torch.Generator().manual_seed(s)
        torch.manual_seed(s)

    def new_model(self) -> torch.nn.Module:
        c, s, _, k = self.shape
        return build_model(self.model_cfg, c, k, s).to(self.device)


class Client(Party):
    """A source domain's party. Owns its data split; answers the server with ``on_<phase>`` handlers."""

    def __init__(self, ctx: dict):
        dom: Domain = ctx["domain"]
        self.train = Split(dom.train.x.to(ctx["device"]), dom.train.y.to(ctx["device"]), dom.train.idx)
        self.val = Split(dom.val.x.to(ctx["device"]), dom.val.y.to(ctx["device"]), dom.val.idx)
        self.truth_sink = ctx.get("truth_sink")
        self.run_id: str = ctx.get("run_id", "")
        self.events: list[dict] = []          # accounting events of local mechanisms (DP-SGD), sent with the next reply
        super().__init__(ctx)
        if self.privacy is not None:
            from .privacy import prepare_client
            prepare_client(self)
        self.setup()

    def setup(self) -> None:
        """Build private state (models, optimizers) here."""

    def handle(self, phase: str, msg: Payload | None) -> Reply | None:
        fn = getattr(self, "on_" + phase, None)
        if fn is None:
            raise NotImplementedError(f"{type(self).__name__} has no handler on_{phase}")
        return fn(msg)

    def record_truth(self, name: str, **arrays) -> None:
        """Ground truth for scorers (never for attacks), e.g. which images went into a bank."""
        if self.truth_sink is not None:
            self.truth_sink(self.id, name, {k: np.asarray(v.cpu() if torch.is_tensor(v) else v)
                                             for k, v in arrays.items()})

    def batch_indices(self, epochs: int | None = None, steps: int | None = None, n: int | None = None
                      ) -> Iterator[torch.Tensor]:
        """Shuffled mini-batch row indices (CPU) for ``steps`` steps, else ``epochs`` epochs (params by default)."""
        p = self.params
        n = len(self.train.y) if n is None else n
        b = min(p.batch_size, n)
        steps = steps if steps is not None else (p.local_steps if epochs is None else 0)
        epochs = epochs if epochs is not None else p.local_epochs
        total = steps if steps else epochs * -(-n // b)
        done = 0
        while done < total:
            perm = torch.randperm(n, generator=self.gen)
            for i in range(0, n, b):
                if done == total:
                    return
                yield perm[i:i + b]
                done += 1

    def batches(self, epochs: int | None = None, steps: int | None = None, split: Split | None = None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled mini-batches (on the device) for ``steps`` steps, else ``epochs`` epochs (params by default)."""
        split = split or self.train
        for j in self.batch_indices(epochs, steps, len(split.y)):
            j = j.to(split.x.device)
            yield split.x[j], split.y[j]

    # A client whose ``on_<vmap_phase>`` is "load the message, fit(self.model) with plain SGD/Adam, reply" may be
    # trained in a cohort (fdg_audit.cohort): the engine calls vmap_begin(msg) on each, trains every
    # client's ``model`` together, then vmap_end() on each. ``vmap_ok()`` says whether this instance qualifies.
    vmap_phase: str | None = None

    def vmap_ok(self) -> bool:
        return False

    def fit(self, model: torch.nn.Module, loss_fn=None, opt=None, **kw) -> torch.nn.Module:
        """Local training: ``loss_fn(model, x, y) -> loss`` (default cross-entropy) over ``batches(**kw)``.
        With ``[privacy] dp_sgd`` it is DP-SGD (fdg_audit.privacy.dpsgd) with Poisson batches instead."""
        if self.privacy is not None and self.privacy.dp_sgd:
            from .privacy.dpsgd import dp_fit
            return dp_fit(self, model, loss_fn, opt, **kw)
        loss_fn = loss_fn or (lambda m, x, y: F.cross_entropy(m(x), y))
        opt = opt or make_optimizer(self.params, model.parameters())
        model.train()
        for x, y in self.batches(**kw):
            opt.zero_grad(set_to_none=True)
            loss_fn(model, x, y).backward()
            opt.step()
        return model


class Server(Party):
    """The coordinating party. Holds the global model, owns no data, talks only through ``exchange``."""

    def __init__(self, ctx: dict):
        self.clients: list[str] = ctx["clients"]
        self.active: list[str] = list(self.clients)   # this round's participants (all unless participation < 1)
        self._link = ctx["link"]
        super().__init__(ctx)
        self.model = self.new_model()
        self.setup()

    def setup(self) -> None:
        """Build the global state here (the model is already built from the server's seed)."""

    def begin(self) -> None:
        """Round 0: one-time exchanges (data sizes, banks). Default: nothing."""

    def step(self, t: int) -> None:
        """Round t >= 1 of the protocol."""
        raise NotImplementedError

    def global_model(self) -> torch.nn.Module:
        """The model the harness evaluates (override for ensembles)."""
        return self.model

    def exchange(self, phase: str, kind: str | None = None, payloads: dict[str, tuple] | None = None,
                 to: list[str] | None = None) -> dict[str, Payload | None]:
        """Send ``payloads[c] = (arrays, scalars)`` to each client ``c`` (or nothing, a control signal that
        carries no data and is not recorded), let all clients work, and return their replies."""
        to = list(payloads) if payloads is not None else (to or self.active)
        return self._link.exchange(phase, self.id, kind, {c: payloads[c] if payloads else None for c in to})

    def broadcast(self, phase: str, kind: str, arrays: dict, scalars: dict | None = None,
                  to: list[str] | None = None) -> dict[str, Payload | None]:
        """The same payload to every client: one encoding, one envelope per receiver."""
        return self._link.exchange(phase, self.id, kind, {c: (arrays, scalars) for c in (to or self.active)},
                                   same=True)

    def ask(self, phase: str, to: list[str] | None = None) -> dict[str, Payload | None]:
        return self.exchange(phase, to=to)


# ---------------------------------------------------------------------------------------------- engines

class _Link:
    """Carries server->client messages and client replies through the bus. Subclasses place the clients and run
    ``run(round, phase, {client: bytes|None}) -> {client: (kind, bytes, events)|None}``."""

    def __init__(self, bus: Bus):
        self.bus = bus

    def exchange(self, phase, sender, kind, payloads: dict, same: bool = False) -> dict[str, Payload | None]:
        shared, reqs = None, {}
        for c, pl in payloads.items():
            data, events = None, []
            if pl is not None:
                if shared is None or not same:
                    shared = self.bus.encode_from(sender, kind, pl[0], pl[1])
                data, events = shared
                self.bus.record(phase, sender, c, kind, data, events, deliver=False)
            reqs[c] = data
        out = self.run(self.bus.round, phase, reqs)
        return {c: None if out[c] is None else self.bus.record(phase, c, sender, *out[c]) for c in payloads}


class Host:
    """Some clients of one run, in one place (the driver, a worker process or a Ray actor); answers requests.

    Clients that support it (``vmap_phase``) are trained as one
    cohort when ``cohort`` is on."""

    def __init__(self, clients: dict[str, Client], bus: Bus, cohort: bool = False):
        self.clients, self.bus, self.cohort = clients, bus, cohort

    def run(self, rnd: int, phase: str, reqs: dict[str, bytes | None]) -> dict[str, tuple | None]:
        from .bus import decode
        # each receiver gets its own decoded copy: some methods train received tensors in place (FedADG's generator)
        msgs = {c: None if data is None else decode(data) for c, data in reqs.items()}
        for c, msg in msgs.items():   # client-level DP measures updates from what was received (a copy: see above)
            if msg is not None and self.bus.filters:
                self.bus.received.setdefault(c, {}).update({k: v.clone() for k, v in msg.arrays.items()})
        group = [c for c in reqs if self.cohort and msgs[c] is not None and
                 self.clients[c].vmap_phase == phase and self.clients[c].vmap_ok()]
        out = {}
        if len(group) > 1:
            from .cohort import fit_cohort
            cls = [self.clients[c] for c in group]
            for cl in cls:
                self._enter(cl, rnd)
                cl.vmap_begin(msgs[cl.id])
            fit_cohort(cls)
            for cl in cls:
                out[cl.id] = self._reply(cl, cl.vmap_end())
        for c in reqs:
            if c not in out:
                cl = self.clients[c]
                self._enter(cl, rnd)
                out[c] = self._reply(cl, cl.handle(phase, msgs[c]))
        return {c: out[c] for c in reqs}

    def _enter(self, client: Client, rnd: int) -> None:
        client.round = self.bus.round = rnd
        client.reseed()

    def _reply(self, client: Client, r: Reply | None):
        if r is None:
            return None
        enc, events = self.bus.encode_from(client.id, r.kind, r.arrays, r.scalars)
        events, client.events = client.events + events, []
        return r.kind, enc, events


class LocalLink(_Link):
    def __init__(self, bus, clients: dict[str, Client], cohort: bool = False):
        super().__init__(bus)
        self.clients = clients
        self.host = Host(clients, bus, cohort)

    def run(self, rnd, phase, reqs):
        return self.host.run(rnd, phase, reqs)

    def close(self):
        pass


def build_host(spec: dict, truth_sink=None) -> Host:
    """A worker's Host: loads only the domains its clients belong to, then builds those clients.
    ``spec``: method, data_cfg, clients {id: party index}, threads, cohort, filters, plus the shared context."""
    import dataclasses
    torch.set_num_threads(spec["threads"])
    from .plugins import load_method
    method = load_method(spec["method"])
    ctx = {k: v for k, v in spec.items() if k not in ("method", "data_cfg", "clients", "threads", "cohort")}
    cfg = spec["data_cfg"]
    if not cfg.label_skew:   # skewed splits are seeded by position in the full list: load every domain then
        doms = list(dict.fromkeys(c.rpartition("/")[0] if "/" in c else c for c in spec["clients"]))
        cfg = dataclasses.replace(cfg, domains=doms)
    data = load_data(cfg)
    clients = {c: method.Client(dict(ctx, id=c, party=i, domain=data.domain(c), truth_sink=truth_sink))
               for c, i in spec["clients"].items()}
    return Host(clients, Bus(None, ctx.get("run_id", ""), "", filters=ctx.get("filters")), spec["cohort"])


class RemoteLink(_Link):
    """A link to workers managed elsewhere (``ray_engine.RayWorkers``): anything with ``run`` and ``close``."""

    def __init__(self, bus, workers):
        super().__init__(bus)
        self.workers = workers

    def run(self, rnd, phase, reqs):
        return self.workers.run(rnd, phase, reqs)

    def close(self):
        self.workers.close()


def _worker(conn, spec):
    """Entry point of a worker process: builds its clients, then answers (round, phase, requests)."""
    try:
        sink = (lambda cid, name, arrs: conn.send(("truth", cid, name, arrs))) if spec.pop("truth_fn") else None
        host = build_host(spec, sink)
        failure = None
    except Exception as e:  # reported on the first message, with the worker's clients named by the parent
        failure = f"could not start: {type(e).__name__}: {e}"
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if failure:
            conn.send(("error", failure))
            continue
        try:
            conn.send(("reply", host.run(*msg)))
        except UserError as e:
            conn.send(("usererror", str(e)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


def assign(clients: list[str], workers: int) -> list[list[str]]:
    """Clients in contiguous blocks over at most ``workers`` workers."""
    return [list(b) for b in np.array_split(np.array(clients, dtype=object), min(workers, len(clients)))]


class ProcessLink(_Link):
    def __init__(self, bus, specs: list[dict], truth_sink):
        super().__init__(bus)
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.truth_sink, self.where = [], [], truth_sink, {}
        for w, spec in enumerate(specs):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(b, spec), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
            self.where.update({c: w for c in spec["clients"]})

    def run(self, rnd, phase, reqs):
        busy = {}
        for c, data in reqs.items():
            busy.setdefault(self.where[c], {})[c] = data
        for w, part in busy.items():
            self.conns[w].send((rnd, phase, part))
        out = {}
        for w, part in busy.items():
            while True:
                try:
                    tag, *rest = self.conns[w].recv()
                except (EOFError, OSError):
                    raise RuntimeError(f"worker of client(s) {', '.join(part)} died (out of memory?)") from None
                if tag == "truth":
                    self.truth_sink(*rest)
                    continue
                who = ", ".join(part)
                if tag == "error":
                    raise RuntimeError(f"client(s) {who}: {rest[0]}")
                if tag == "usererror":
                    raise UserError(f"client(s) {who}: {rest[0]}")
                out.update(rest[0])
                break
        return {c: out[c] for c in reqs}

    def close(self):
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------------------------------- harness

@torch.no_grad()
def accuracy(model, split: Split, device, batch: int = 512) -> float:
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)   # one host sync per evaluation, not per batch
    for i in range(0, len(split.y), batch):
        x, y = split.x[i:i + batch].to(device), split.y[i:i + batch].to(device)
        correct += (model(x).argmax(1) == y).sum()
    return correct.item() / max(1, len(split.y))


def _cat(splits: list[Split]) -> Split:
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


def participants(seq: np.random.SeedSequence, clients: list[str], fraction: float, t: int) -> list[str]:
    """The round's sample of round(fraction * K) clients (at least one), in client order, from the run's seed
    sequence (its own stream, so the parties' random streams do not depend on the sampling)."""
    if fraction >= 1.0:
        return list(clients)
    m = asked(len(clients), fraction)
    rng = np.random.default_rng(np.random.SeedSequence(seq.entropy, spawn_key=(2 ** 31, t)))
    return [clients[i] for i in np.sort(rng.choice(len(clients), m, replace=False))]


def check_participation(method, fraction: float, where: str = "participation") -> None:
    """``participation`` in (0, 1], and < 1 only for a method that declares ``partial_participation`` (else its
    ``participation_note`` says why not)."""
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"{where} = {fraction}: use a fraction in (0, 1], e.g. 0.1")
    if fraction < 1.0 and not getattr(method, "partial_participation", False):
        from .plugins import available, load_method
        why = getattr(method, "participation_note", "its server expects every client each round")
        ok = [n for n in sorted(available("method")) if getattr(load_method(n), "partial_participation", False)]
        raise UserError(f"method {method.name} does not support participation < 1 ({why}): set {where} = 1.0, or "
                        f"use a method that does ({', '.join(ok)})")


def cohort_on(params) -> bool:
    mode = getattr(params, "cohort", "loop")
    if mode not in ("loop", "vmap", "auto"):
        raise UserError(f"cohort = {mode!r}: use \"loop\", \"vmap\" or \"auto\" (vmap when CUDA is present)")
    return mode == "vmap" or (mode == "auto" and torch.cuda.is_available())


def run_federation(spec: RunSpec, ledger, data: DomainSet | None = None, on_round=None, truth_sink=None) -> dict:
    """Run one federation (one method, one held-out target, one seed) and evaluate it.

    Evaluation is the harness's, not a party's: every ``eval_every`` rounds (and after the last) it measures the
    global model on the pooled source validation splits and on the whole held-out domain. The reported round is
    chosen on source validation only (DomainBed's training-domain validation), never on the target: see
    ``select_round``."""
    from .plugins import load_method
    method = load_method(spec.method)
    if truth_sink is not None:  # truth_sink(run_id, client, name, arrays); a client knows only its own id
        run_sink = truth_sink
        truth_sink = lambda cid, name, arrs: run_sink(spec.run_id, cid, name, arrs)  # noqa: E731
    data = data or load_data(spec.data_cfg)
    target = data.domain(spec.target)
    sources = [d for d in data.domains if d.name != target.name]
    seq = seed_sequence(spec.seed, spec.run_id)
    shape = (data.channels, data.size, data.size, data.num_classes)
    from .privacy import build_filters
    filters = dict(spec.filters or {})
    for k, fs in build_filters(spec.privacy).items():   # fresh per run: accountants live for one run
        filters[k] = filters.get(k, []) + fs
    bus = Bus(ledger, spec.run_id, method.name, filters=filters)
    base = dict(params=spec.params, device=spec.device, model_cfg=spec.model_cfg, shape=shape, seedseq=seq,
                privacy=spec.privacy, run_id=spec.run_id)
    parts = [c for d in sources for c in data.clients(d.name)]
    cids = [c.name for c in parts]
    fraction, cohort = float(getattr(spec.params, "participation", 1.0)), cohort_on(spec.params)
    check_participation(method, fraction)
    if spec.engine in ("process", "ray"):
        import os
        blocks = assign(cids, spec.workers or os.cpu_count() or 1)
        party = {c: i + 1 for i, c in enumerate(cids)}
        specs = [dict(base, method=spec.method, data_cfg=spec.data_cfg, clients={c: party[c] for c in b},
                      threads=spec.worker_threads, cohort=cohort, filters=filters, truth_fn=truth_sink is not None)
                 for b in blocks]
        if spec.engine == "process":
            link = ProcessLink(bus, specs, truth_sink)
        else:
            from .ray_engine import RayWorkers
            link = RemoteLink(bus, RayWorkers(specs, truth_sink, spec.ray, build_host))
    elif spec.engine == "local":
        clients = {}
        for i, d in enumerate(parts):
            clients[d.name] = method.Client(dict(base, id=d.name, party=i + 1, domain=d, truth_sink=truth_sink))
        link = LocalLink(bus, clients, cohort)
    else:
        raise ValueError(f"unknown engine {spec.engine!r}")
    try:
        server = method.Server(dict(base, id="server", party=0, clients=cids, link=link))
        val, tgt = (Split(s.x.to(spec.device), s.y.to(spec.device), s.idx)   # evaluation data stays on the device
                    for s in (_cat([d.val for d in sources]), _cat([target.train, target.val])))
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
            history.append(row)
            if on_round:
                on_round(row)
    finally:
        link.close()
    best, converged = select_round(history, len(val), spec.params.rounds)
    return {"history": history, "selected_round": best["round"], "target_acc": best["target_acc"],
            "source_val_acc": best["source_val_acc"], "final_target_acc": history[-1]["target_acc"],
            "converged": converged, "clients": cids}


LATE = 0.1   # a run whose selected round is in the last 10% of its rounds has not converged


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
