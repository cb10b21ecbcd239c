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
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import fdg_audit.federation as fed
from fdg_audit.data import DataConfig, load_data
from fdg_audit.ledger import Ledger
from fdg_audit.models import ModelConfig, build_model
from methods.fedavg import Params

LR, BATCH = 0.02, 32


def workload(data):
    target = data.domain("rot0")
    sources = [d for d in data.domains if d.name != "rot0"]
    val = fed._cat([d.val for d in sources])
    tgt = fed._cat([target.train, target.val])
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
                       DataConfig(), ModelConfig(), "rot0", engine=kind, threads=torch.get_num_threads(),
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
    data = load_data(DataConfig())
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
    for i in range(args.repeats + 1):   # the first pass (1 round) is a warm-up: imports, Ray start-up
        for k, f in run.items():
            t = f(args.rounds if i else 1)
            torch.set_num_threads(args.threads)
            if i:
                times[k].append(t)
                if k in cpu:
                    cpu[k].append(CPU[k])
                print(f"  rep {i} {k}: {t:.2f} s", flush=True)
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
    for k in ("vmap", "ray", "process"):
        if k in times and "local" in times:
            r = [a / b for a, b in zip(times[k], times["local"])]
            print(f"  ratio {k}/local  {statistics.median(r):6.3f}   (min {min(r):.3f}, max {max(r):.3f})")
    for k in ("local", "vmap"):
        if "flower" in times and k in times:
            r = [a / b for a, b in zip(times["flower"], times[k])]
            print(f"  ratio flower/{k} {statistics.median(r):6.3f}   (min {min(r):.3f}, max {max(r):.3f})  "
                  f"(goal >= 3.5)")


if __name__ == "__main__":
    main()
