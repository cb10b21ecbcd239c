"""DP training cost as a ratio to non-DP, measured side by side (interleaved repeats, one process): FedAvg, FedDG and
CSAC with and without client-level DP, and FedDG with example-level DP-SGD (per-example episodic gradients).

    python bench/dp_cost.py [--rounds 3] [--repeats 3] [--threads 1]
"""
import argparse
import tempfile
import time
from pathlib import Path

import torch

from fdg_audit.data import DataConfig, load_data
from fdg_audit.train.federation import RunSpec, run_federation
from fdg_audit.store.ledger import Ledger
from fdg_audit.models import ModelConfig
from fdg_audit.protocol import load_method
from fdg_audit.privacy import check_run, privacy_config

CLIENT = {"client": {"clip": 0.5, "noise_multiplier": 1.0}}
CASES = [("fedavg", {}, {}), ("fedavg", {}, CLIENT), ("feddg", {}, {}), ("feddg", {}, CLIENT),
         ("feddg", {}, {"dp_sgd": True, "noise_multiplier": 1.0}), ("csac", {"acquire_epochs": 1}, {}),
         ("csac", {"acquire_epochs": 1}, CLIENT)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = DataConfig(dataset="digits", family="rotated", domains=["rot0", "rot15", "rot30", "rot45"], per_domain=150)
    data, model = load_data(cfg), ModelConfig()
    specs = []
    for name, extra, priv in CASES:
        m = load_method(name)
        p = m.Params(rounds=a.rounds, lr=0.05, **extra)
        pc = privacy_config(priv)
        check_run(pc, model, data, m, p)
        specs.append((name, "dp_sgd" if priv.get("dp_sgd") else ("client" if priv else "none"), m, p, pc))
    times = {i: [] for i in range(len(specs))}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.repeats + 1):                    # repeat 0 warms up
            for i, (name, mode, m, p, pc) in enumerate(specs):
                led = Ledger(Path(d) / f"{r}_{i}", store="none")
                t = time.perf_counter()
                run_federation(RunSpec(f"b/{name}/{mode}/{r}", name, p, cfg, model, "rot45", privacy=pc), led, data)
                if r:
                    times[i].append(time.perf_counter() - t)
                led.close()
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    print(f"{a.rounds} rounds, 3 clients of 120 images, cnn_small, {a.threads} thread(s), median of {a.repeats}")
    base = {name: med(times[i]) for i, (name, mode, *_) in enumerate(specs) if mode == "none"}
    for i, (name, mode, *_) in enumerate(specs):
        print(f"{name:7s} {mode:7s} {med(times[i]):7.2f} s   ratio to non-DP {med(times[i]) / base[name]:.2f}")


if __name__ == "__main__":
    main()
