"""The Ray engine (``engine = "ray"``, ``pip install 'fdg_audit[ray]'``): clients live in Ray actors.

The server, the bus and the ledger stay in the driver; an actor is a worker that hosts a block of clients
(``engines.Host``, loading only their domains' data) and answers with the same FDG1 bytes the in-process
engine would produce, so for the same seed on CPU the ledgers are identical. Options (``RunSpec.ray``, or the
environment variables in brackets):

- ``address`` [FDG_RAY_ADDRESS]: an existing cluster (``"auto"`` or ``"ray://host:10001"``); empty starts a
  local Ray on this machine with no dashboard and no usage reporting (Ray maps 127.0.0.1 to the machine's own
  address for its services; nothing leaves the host). A ``ray.init(address=...)`` made before the run is used.
- ``num_cpus`` [FDG_RAY_CPUS], ``num_gpus`` [FDG_RAY_GPUS]: resources per actor (fractions allowed, e.g. 0.25
  GPU so four actors share one device); defaults 1 CPU and 0 GPU.

``RunSpec.workers`` sets the number of actors (0: one per CPU of the local machine, at most one per client).
In a scenario: ``engine = "ray"``, ``workers = 4``, ``worker_threads = 1`` and a ``[ray]`` table with the keys
of ``RayOptions`` (checked by ``ray_options``).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from ..errors import UserError
from ..params import typed


@dataclass
class RayOptions:
    address: str = ""        # "" = start a local Ray; "auto" or "ray://host:10001" = an existing cluster
    num_cpus: float = 1.0    # CPUs reserved per actor (a worker hosting a block of clients)
    num_gpus: float = 0.0    # GPUs per actor; a fraction shares one device between actors


def ray_options(raw: dict, where: str = "ray") -> dict:
    """A scenario's ``[ray]`` table checked (unknown keys, types, negative amounts: one-line errors); only the keys
    given are returned, so the environment variables above still fill the others."""
    o = typed(RayOptions, raw, where)
    for k in ("num_cpus", "num_gpus"):
        if getattr(o, k) < 0:
            raise UserError(f"{where}.{k} = {getattr(o, k)!r}: use a number >= 0 (a fraction shares a CPU or GPU "
                            "between actors)")
    if "num_cpus" in raw and "num_gpus" in raw and o.num_cpus == 0 and o.num_gpus == 0:
        raise UserError(f"{where}: num_cpus = 0 and num_gpus = 0 reserve nothing per actor; give num_cpus > 0")
    return {k: v for k, v in asdict(o).items() if k in raw}

RAY_MISSING = "engine = \"ray\" needs Ray: pip install 'fdg_audit[ray]' (after torch), or use engine = \"local\""


def _ray():
    try:
        import ray
    except ImportError:
        raise UserError(RAY_MISSING) from None
    return ray


def start(opts: dict, workers: int):
    """Connect to the cluster in opts["address"] or start a small local one (loopback only)."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = opts.get("address") or os.environ.get("FDG_RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        need = workers * float(opts.get("num_cpus", os.environ.get("FDG_RAY_CPUS", 1)))
        ray.init(num_cpus=max(1, int(-(-need // 1))), include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    return ray


class _Actor:
    def __init__(self, spec: dict, build_host):
        self.truths = []
        sink = (lambda cid, name, arrs: self.truths.append((cid, name, arrs))) if spec.pop("truth_fn") else None
        self.host = build_host(spec, sink)

    def run_and_truths(self, rnd, phase, reqs):
        out = self.host.run(rnd, phase, reqs)
        truths, self.truths = self.truths, []
        return out, truths


class RayWorkers:
    """The actors of one run; ``engines.RemoteLink`` drives them (``build_host`` builds a worker's clients)."""

    def __init__(self, specs: list[dict], truth_sink, opts: dict | None, build_host):
        opts = dict(opts or {})
        ray = start(opts, len(specs))
        cpus = float(opts.get("num_cpus", os.environ.get("FDG_RAY_CPUS", 1)))
        gpus = float(opts.get("num_gpus", os.environ.get("FDG_RAY_GPUS", 0)))
        actor = ray.remote(_Actor).options(num_cpus=cpus, num_gpus=gpus)
        self.ray, self.truth_sink = ray, truth_sink
        self.actors = [actor.remote(s, build_host) for s in specs]
        self.where = {c: w for w, s in enumerate(specs) for c in s["clients"]}

    def run(self, rnd, phase, reqs):
        busy = {}
        for c, data in reqs.items():
            busy.setdefault(self.where[c], {})[c] = data
        futures = {w: self.actors[w].run_and_truths.remote(rnd, phase, part) for w, part in busy.items()}
        out = {}
        for w, f in futures.items():
            try:
                replies, truths = self.ray.get(f)
            except self.ray.exceptions.RayTaskError as e:
                cause = e.as_instanceof_cause()
                if isinstance(cause, UserError):
                    raise UserError(f"client(s) {', '.join(busy[w])}: {cause}") from None
                raise RuntimeError(f"client(s) {', '.join(busy[w])}: {cause}") from None
            for t in truths:
                self.truth_sink(*t)
            out.update(replies)
        return {c: out[c] for c in reqs}

    def close(self):
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
