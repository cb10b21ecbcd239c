"""The engines: where the clients of one run live and how requests reach them.

``LocalLink`` keeps every client in the driver; ``ProcessLink`` spreads them over spawned worker processes
(``build_host``: each loads only its clients' domains); ``RemoteLink`` talks to workers managed elsewhere
(fdg_audit.train.ray_engine). All of them carry the server's requests and the clients' replies through the bus, so
every engine records the same ledger. ``Host`` answers requests for the clients of one place and trains a cohort
of them as one stacked model where they support it (fdg_audit.train.cohort).
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp

import numpy as np
import torch

from ..bus import Bus, Payload, decode
from ..data import load_data
from ..errors import UserError
from ..protocol import Client, Reply, unlabeled
from ..protocol import load_method
from .cohort import fit_cohort

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
        # each receiver gets its own decoded copy: some methods train received tensors in place (FedADG's generator)
        msgs = {c: None if data is None else decode(data) for c, data in reqs.items()}
        for c, msg in msgs.items():
            if msg is not None:
                self.bus.deliver(c, msg)
        group = [c for c in reqs if self.cohort and msgs[c] is not None and
                 self.clients[c].vmap_phase == phase and self.clients[c].vmap_ok()]
        out = {}
        if len(group) > 1:
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
    """A worker's Host: loads only the domains its clients belong to, then builds those clients (an adaptation
    method's target client with its labels masked first, ``protocol.unlabeled``).
    ``spec``: method, data_cfg, clients {id: party index}, threads, cohort, filters, plus the shared context."""
    torch.set_num_threads(spec["threads"])
    method = load_method(spec["method"])
    ctx = {k: v for k, v in spec.items() if k not in ("method", "data_cfg", "clients", "threads", "cohort")}
    cfg = spec["data_cfg"]
    if not cfg.label_skew:   # skewed splits are seeded by position in the full list: load every domain then
        doms = list(dict.fromkeys(c.rpartition("/")[0] if "/" in c else c for c in spec["clients"]))
        cfg = dataclasses.replace(cfg, domains=doms)
    data = load_data(cfg)
    dom = lambda c: unlabeled(data.domain(c)) if c == ctx.get("target") else data.domain(c)  # noqa: E731
    clients = {c: method.Client(dict(ctx, id=c, party=i, domain=dom(c), truth_sink=truth_sink))
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
