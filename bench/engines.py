"""Engines against a bare PyTorch loop (and Flower's simulation when installed) on the reference FedAvg workload:
5 rotated-digit clients (target rot0), GroupNorm cnn_small, 1 local epoch, 10 rounds, SGD lr 0.02, 2 threads.

    python bench/engines.py [--repeats 5] [--rounds 10] [--variants local,vmap,ray,process,flower]

``vmap`` is the in-process engine with ``cohort = "vmap"`` (the five clients trained as one stacked model; the
same SGD maths, equal to the loop to float32 rounding).

Every variant trains the same clients with the same hyperparameters and evaluates the global model on the pooled
source validation splits and the held-out domain after every round. The engines run the full testbed (bus,
FDG1 codec, sha256, ledger with payloads on disk). Variants run interleaved (bare, local, ray, ... per repetition)
so they see the same machine load; each ratio is printed as the median of the per-repetition ratios with its
min-max spread. Flower (``pip install 'flwr[simulation]'``) is skipped with a message when it is not importable.
"""
import argparse
import os
import statistics
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

import fdg_audit.train.federation as fed
from fdg_audit.data import DataConfig, load_data
from fdg_audit.store.ledger import Ledger
from fdg_audit.models import ModelConfig, build_model
from methods.fedavg import Params

LR, BATCH = 0.02, 32


def workload(data):
    target = data.domain("rot0")
    sources = [d for d in data.domains if d.name != "rot0"]
    val = fed.cat_splits([d.val for d in sources])
    tgt = fed.cat_splits([target.train, target.val])
    return sources, val, tgt


def local_epoch(model, split, gen):
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
    model.train()
    n = len(split.y)
    for j in torch.randperm(n, generator=gen).split(BATCH):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(split.x[j]), split.y[j]).backward()
        opt.step()


CPU = {}   # variant -> driver CPU seconds of its last run (meaningful for the single-process variants)
TREE = {}  # variant -> CPU seconds of the driver and every process it started (Ray, Flower, workers)


def _descendants_cpu() -> dict[int, float]:
    """{pid: CPU seconds} of every process descended from this one, read from /proc."""
    hz, procs = os.sysconf("SC_CLK_TCK"), {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                rest = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            procs[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / hz)
    out, todo = {}, [os.getpid()]
    while todo:
        p = todo.pop()
        for c, (pp, cpu) in procs.items():
            if pp == p and c not in out:
                out[c] = cpu
                todo.append(c)
    return out


class TreeCPU:
    """CPU seconds this process and its descendants spend inside the ``with`` block; descendants are sampled
    every 0.2 s, so one that ends between samples loses at most its last 0.2 s."""

    def __enter__(self):
        self.start, self.last, self.stop = _descendants_cpu(), {}, threading.Event()
        self.c0 = time.process_time()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.stop.wait(0.2):
            self.last.update(_descendants_cpu())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.last.update(_descendants_cpu())
        self.seconds = time.process_time() - self.c0 + sum(v - self.start.get(p, 0.0) for p, v in self.last.items())


def bare(data, rounds) -> float:
    """FedAvg written directly in PyTorch: no bus, no codec, no ledger."""
    sources, val, tgt = workload(data)
    t0, c0 = time.perf_counter(), time.process_time()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    glob = build_model(ModelConfig(), 1, 10, 28)
    local = build_model(ModelConfig(), 1, 10, 28)
    n = torch.tensor([len(d.train.y) for d in sources], dtype=torch.float64)
    w = n / n.sum()
    for _ in range(rounds):
        states = []
        for d in sources:
            local.load_state_dict(glob.state_dict())
            local_epoch(local, d.train, gen)
            states.append({k: v.detach().clone() for k, v in local.state_dict().items()})
        glob.load_state_dict({k: sum(wi * s[k].double() for wi, s in zip(w, states)).float() for k in states[0]})
        fed.accuracy(glob, val, "cpu"), fed.accuracy(glob, tgt, "cpu")
    CPU["bare"] = time.process_time() - c0
    return time.perf_counter() - t0


def engine(data, rounds, name) -> float:
    kind = "local" if name == "vmap" else name
    spec = fed.RunSpec(f"bench/fedavg/rot0/{name}", "fedavg",
                       Params(rounds=rounds, lr=LR, batch_size=BATCH, cohort="vmap" if name == "vmap" else "loop"),
                       DataConfig(dataset="digits"), ModelConfig(), "rot0", engine=kind, threads=torch.get_num_threads(),
                       workers=2, worker_threads=1)
    with tempfile.TemporaryDirectory() as d:
        t0, c0 = time.perf_counter(), time.process_time()
        led = Ledger(d)
        fed.run_federation(spec, led, data if kind == "local" else None)
        led.close()
        CPU[name] = time.process_time() - c0
        return time.perf_counter() - t0


def flower(data, rounds) -> float:
    """The same workload as a Flower simulation (NumPyClient + FedAvg strategy, Ray backend)."""
    import flwr as fl
    import numpy as np
    sources, val, tgt = workload(data)
    model = build_model(ModelConfig(), 1, 10, 28)
    keys = list(model.state_dict())

    def to_np(m):
        return [v.detach().cpu().numpy() for v in m.state_dict().values()]

    def load(m, arrays):
        m.load_state_dict({k: torch.as_tensor(np.asarray(a)) for k, a in zip(keys, arrays)})

    class Client(fl.client.NumPyClient):
        def __init__(self, i):
            self.split, self.gen = sources[i].train, torch.Generator().manual_seed(i)
            self.model = build_model(ModelConfig(), 1, 10, 28)

        def fit(self, parameters, config):
            torch.set_num_threads(1)
            load(self.model, parameters)
            local_epoch(self.model, self.split, self.gen)
            return to_np(self.model), len(self.split.y), {}

    def evaluate(rnd, parameters, config):
        load(model, parameters)
        return 0.0, {"val": fed.accuracy(model, val, "cpu"), "target": fed.accuracy(model, tgt, "cpu")}

    strategy = fl.server.strategy.FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=len(sources),
                                         min_available_clients=len(sources), evaluate_fn=evaluate,
                                         initial_parameters=fl.common.ndarrays_to_parameters(to_np(model)))
    t0 = time.perf_counter()
    fl.simulation.start_simulation(client_fn=lambda cid: Client(int(cid)).to_client(), num_clients=len(sources),
                                   config=fl.server.ServerConfig(num_rounds=rounds), strategy=strategy,
                                   client_resources={"num_cpus": 1}, keep_initialised=True,
                                   ray_init_args={"num_cpus": 2, "include_dashboard": False, "ignore_reinit_error": True,
                                                  "_node_ip_address": "127.0.0.1"})
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="local,ray,process,flower")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = load_data(DataConfig(dataset="digits"))
    variants = [v for v in args.variants.split(",") if v]
    if "ray" in variants:
        try:
            import os
            import ray
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
        except ImportError:
            print("ray: skipped (pip install 'fdg_audit[ray]')")
            variants.remove("ray")
    if "flower" in variants:
        try:
            import flwr  # noqa: F401
        except ImportError:
            print("flower: skipped (pip install 'flwr[simulation]' to compare with Flower's simulation)")
            variants.remove("flower")
    run = {"bare": lambda r: bare(data, r)}
    for v in variants:
        run[v] = (lambda r: flower(data, r)) if v == "flower" else (lambda r, v=v: engine(data, r, v))
    times, cpu = {k: [] for k in run}, {k: [] for k in ("bare", "local", "vmap") if k in run}
    tree = {k: [] for k in run}
    for i in range(args.repeats + 1):   # the first pass (1 round) is a warm-up: imports, Ray start-up
        for k, f in run.items():
            with TreeCPU() as tc:
                t = f(args.rounds if i else 1)
            torch.set_num_threads(args.threads)
            if i:   # single-process variants: their own CPU time (Ray's idle daemons, started by another variant,
                times[k].append(t)      # are descendants too and would be counted against them)
                tree[k].append(CPU[k] if k in ("bare", "local", "vmap") else tc.seconds)
                if k in cpu:
                    cpu[k].append(CPU[k])
                print(f"  rep {i} {k}: {t:.2f} s wall, {tree[k][-1]:.2f} CPU s (all its processes)", flush=True)
    print(f"FedAvg reference workload, {args.rounds} rounds, 5 clients, {args.threads} threads, "
          f"{args.repeats} interleaved repetitions")
    for k, ts in times.items():
        print(f"  {k:8s} median {statistics.median(ts):7.2f} s   {[round(t, 2) for t in ts]}")
    for k in times:
        if k == "bare":
            continue
        r = [a / b for a, b in zip(times[k], times["bare"])]
        print(f"  ratio {k}/bare   {statistics.median(r):6.3f}   (min {min(r):.3f}, max {max(r):.3f})")
    for k in ("local", "vmap"):   # CPU seconds of the one process: robust to other load on a shared machine
        if cpu.get(k):
            r = [a / b for a, b in zip(cpu[k], cpu["bare"])]
            print(f"  CPU-time ratio {k}/bare {statistics.median(r):6.3f}   (min {min(r):.3f}, max {max(r):.3f})  "
                  f"CPU s {k} {[round(x, 1) for x in cpu[k]]} bare {[round(x, 1) for x in cpu['bare']]}")
    for k in tree:   # CPU seconds of every process a variant ran (driver, Ray, workers): the work each needs
        if k != "bare":
            r = [a / b for a, b in zip(tree[k], tree["bare"])]
            print(f"  all-process CPU ratio {k}/bare {statistics.median(r):6.3f}   (min {min(r):.3f}, max {max(r):.3f})  "
                  f"CPU s {[round(x, 1) for x in tree[k]]}")
    for k in ("vmap", "ray", "process"):
        if k in times and "local" in times:
            r = [a / b for a, b in zip(times[k], times["local"])]
            print(f"  ratio {k}/local  {statistics.median(r):6.3f}   (min {min(r):.3f}, max {max(r):.3f})")
    for k in ("local", "vmap"):
        if "flower" in times and k in times:
            r = [a / b for a, b in zip(times["flower"], times[k])]
            rc = [a / b for a, b in zip(tree["flower"], tree[k])]
            print(f"  ratio flower/{k} wall {statistics.median(r):6.3f}   (min {min(r):.3f}, max {max(r):.3f}); "
                  f"all-process CPU {statistics.median(rc):6.3f} (min {min(rc):.3f}, max {max(rc):.3f})  (goal >= 3.5)")


if __name__ == "__main__":
    main()
