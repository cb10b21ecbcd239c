"""Parties, the round loop, seeding and the two engines (in-process and one process per client).

A method is one class with three members: ``Params`` (a dataclass extending ``TrainParams``), ``Server`` and
``Client``. The server drives the protocol; a client answers messages with ``on_<phase>(msg) -> Reply|None``.
Server and clients never hold references to each other: every exchange goes through the Bus, and in the
``process`` engine each client lives in its own process and sees only the encoded bytes it is sent.

Seeding: one ``numpy.random.SeedSequence`` per run (master seed + run id), then one child per
(party, round, call). Before every call the engine reseeds the party's ``rng`` (numpy), ``gen`` (torch CPU
generator) and torch's global RNG from that child, so both engines give identical ledgers on CPU.
"""
from __future__ import annotations

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
from .params import TrainParams, make_optimizer, resolve_device  # noqa: F401  (re-exported for methods)


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

    def batches(self, epochs: int | None = None, steps: int | None = None, split: Split | None = None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled mini-batches (on the device) for ``steps`` steps, else ``epochs`` epochs (params by default)."""
        p, split = self.params, split or self.train
        n, b = len(split.y), min(self.params.batch_size, len(split.y))
        steps = steps if steps is not None else (p.local_steps if epochs is None else 0)
        epochs = epochs if epochs is not None else p.local_epochs
        total = steps if steps else epochs * -(-n // b)
        done = 0
        while done < total:
            perm = torch.randperm(n, generator=self.gen).to(split.x.device)
            for i in range(0, n, b):
                if done == total:
                    return
                j = perm[i:i + b]
                yield split.x[j], split.y[j]
                done += 1

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
        to = list(payloads) if payloads is not None else (to or self.clients)
        return self._link.exchange(phase, self.id, kind, {c: payloads[c] if payloads else None for c in to})

    def broadcast(self, phase: str, kind: str, arrays: dict, scalars: dict | None = None,
                  to: list[str] | None = None) -> dict[str, Payload | None]:
        """The same payload to every client: one encoding, one envelope per receiver."""
        return self._link.exchange(phase, self.id, kind, {c: (arrays, scalars) for c in (to or self.clients)},
                                   same=True)

    def ask(self, phase: str, to: list[str] | None = None) -> dict[str, Payload | None]:
        return self.exchange(phase, to=to)


# ---------------------------------------------------------------------------------------------- engines

class _Link:
    """Carries server->client messages and client replies through the bus. Subclasses place the clients."""

    def __init__(self, bus: Bus):
        self.bus = bus

    def exchange(self, phase, sender, kind, payloads: dict, same: bool = False) -> dict[str, Payload | None]:
        shared = None
        for c, pl in payloads.items():
            data, events = None, []
            if pl is not None:
                if shared is None or not same:
                    shared = self.bus.encode_from(sender, kind, pl[0], pl[1])
                data, events = shared
                self.bus.record(phase, sender, c, kind, data, events)
            self.start(c, self.bus.round, phase, data)
        replies = {}
        for c in payloads:
            r = self.finish(c)
            replies[c] = None if r is None else self.bus.record(phase, c, sender, r[0], r[1], r[2])
        return replies


def _client_reply(client: Client, bus: Bus, rnd: int, phase: str, data: bytes | None):
    from .bus import decode
    client.round = bus.round = rnd
    client.reseed()
    msg = decode(data) if data is not None else None
    if msg is not None and bus.filters:   # client-level DP measures updates from what the client last received
        bus.received.setdefault(client.id, {}).update(msg.arrays)
    r = client.handle(phase, msg)
    if r is None:
        return None
    enc, events = bus.encode_from(client.id, r.kind, r.arrays, r.scalars)
    events, client.events = client.events + events, []
    return r.kind, enc, events


class LocalLink(_Link):
    def __init__(self, bus, clients: dict[str, Client]):
        super().__init__(bus)
        self.clients, self.pending = clients, {}

    def start(self, c, rnd, phase, data):
        self.pending[c] = _client_reply(self.clients[c], self.bus, rnd, phase, data)

    def finish(self, c):
        return self.pending.pop(c)

    def close(self):
        pass


def _worker(conn, spec):
    """Entry point of a client process: builds the client from its spec, then answers messages."""
    try:
        torch.set_num_threads(spec.pop("threads"))
        from .plugins import load_method
        method = load_method(spec.pop("method"))
        ctx = dict(spec)
        ctx["domain"] = load_data(ctx.pop("data_cfg")).domain(ctx.pop("domain_name"))
        sink = ctx.pop("truth_fn")
        ctx["truth_sink"] = (lambda cid, name, arrs: conn.send(("truth", cid, name, arrs))) if sink else None
        client = method.Client(ctx)
        bus = Bus(None, ctx.get("run_id", ""), "", filters=ctx.get("filters"))
        failure = None
    except Exception as e:  # reported on the first message, with the client named by the parent
        failure = f"could not start: {type(e).__name__}: {e}"
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if failure:
            conn.send(("error", failure))
            continue
        try:
            conn.send(("reply", _client_reply(client, bus, *msg)))
        except UserError as e:
            conn.send(("usererror", str(e)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class ProcessLink(_Link):
    def __init__(self, bus, specs: dict[str, dict], truth_sink):
        super().__init__(bus)
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.truth_sink = {}, [], truth_sink
        for c, spec in specs.items():
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(b, spec), daemon=True)
            p.start()
            self.conns[c] = a
            self.procs.append(p)

    def start(self, c, rnd, phase, data):
        self.conns[c].send((rnd, phase, data))

    def finish(self, c):
        while True:
            tag, *rest = self.conns[c].recv()
            if tag == "truth":
                self.truth_sink(*rest)
            elif tag == "error":
                raise RuntimeError(f"client {c}: {rest[0]}")
            elif tag == "usererror":
                raise UserError(f"client {c}: {rest[0]}")
            else:
                return rest[0]

    def close(self):
        for c in self.conns.values():
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
    correct = 0
    for i in range(0, len(split.y), batch):
        x, y = split.x[i:i + batch].to(device), split.y[i:i + batch].to(device)
        correct += (model(x).argmax(1) == y).sum().item()
    return correct / max(1, len(split.y))


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
    engine: str = "local"       # local | process
    threads: int = 1
    filters: dict | None = None
    privacy: Any = None         # fdg_audit.privacy.PrivacyConfig: DP-SGD, artifact filters, canaries


def run_federation(spec: RunSpec, ledger, data: DomainSet | None = None, on_round=None, truth_sink=None) -> dict:
    """Run one federation (one method, one held-out target, one seed) and evaluate it.

    Evaluation is the harness's, not a party's: after every round it measures the global model on the
    pooled source validation splits and on the whole held-out domain. The reported round is the one with
    the best source-validation accuracy (DomainBed's training-domain validation), never the best target."""
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
    cids = [d.name for d in sources]
    if spec.engine == "process":
        specs = {d.name: dict(base, id=d.name, party=i + 1, method=spec.method, data_cfg=spec.data_cfg,
                              domain_name=d.name, threads=spec.threads, filters=filters,
                              truth_fn=truth_sink is not None)
                 for i, d in enumerate(sources)}
        link = ProcessLink(bus, specs, truth_sink)
    elif spec.engine == "local":
        clients = {}
        for i, d in enumerate(sources):
            clients[d.name] = method.Client(dict(base, id=d.name, party=i + 1, domain=d, truth_sink=truth_sink))
        link = LocalLink(bus, clients)
    else:
        raise ValueError(f"unknown engine {spec.engine!r}")
    try:
        server = method.Server(dict(base, id="server", party=0, clients=cids, link=link))
        val, tgt = _cat([d.val for d in sources]), _cat([target.train, target.val])
        history = []
        for t in range(0, spec.params.rounds + 1):
            bus.round = server.round = t
            server.reseed()
            server.begin() if t == 0 else server.step(t)
            row = {"round": t, "bytes": bus.sent.get(t, 0)}
            if t > 0:
                m = server.global_model()
                row.update(source_val_acc=accuracy(m, val, spec.device), target_acc=accuracy(m, tgt, spec.device))
            history.append(row)
            if on_round:
                on_round(row)
    finally:
        link.close()
    best = max((r for r in history if r["round"] > 0), key=lambda r: (r["source_val_acc"], r["round"]))
    return {"history": history, "selected_round": best["round"], "target_acc": best["target_acc"],
            "source_val_acc": best["source_val_acc"], "final_target_acc": history[-1]["target_acc"],
            "clients": cids}
