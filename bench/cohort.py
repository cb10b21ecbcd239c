"""The vmap cohort against the sequential loop: K FedAvg clients of 40 images, one local epoch each (GroupNorm
cnn_small, batch 32, SGD with momentum and weight decay).

    python bench/cohort.py [--clients 16,64,256] [--repeats 3] [--device auto]

Clients come from Rotated Fashion-MNIST (2000 images per domain split into clients; the embedded digits when
Fashion-MNIST is not installed). Per K the loop (``Client.fit`` one client after another) and the cohort
(``fdg_audit.train.cohort.fit_cohort``) run interleaved on fresh copies of the same clients; the ratio loop/vmap is the
median of the per-repetition ratios with its min-max spread (> 1: the cohort is faster). Before timing, the two
are checked to give the same weights (float32, max abs difference printed).
"""
import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from fdg_audit.train.cohort import fit_cohort
from fdg_audit.data import FASHION_MNIST_ROOT, DataConfig, Domain, Split, load_data
from fdg_audit.models import ModelConfig
from fdg_audit.params import resolve_device
from fdg_audit.seeding import run_seq
from methods.fedavg import FedAvg, Params


def make(data, k, device, n=40):
    """K clients of n training images each (two steps at batch 32: one full, one masked short batch)."""
    per = math.ceil(k / len(data.domains))
    doms = [Domain(c.name, Split(c.train.x[:n], c.train.y[:n], c.train.idx[:n]), c.val)
            for d in data.names for c in data.clients(d)[:per]][:k]
    p = Params(lr=0.05, batch_size=32)
    seq = run_seq(0, "bench")
    return [FedAvg.Client(dict(id=d.name, params=p, device=device, model_cfg=ModelConfig(), shape=(1, 28, 28, 10),
                               seedseq=seq, party=i + 1, domain=d)) for i, d in enumerate(doms)]


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def loop(clients, device):
    t = time.perf_counter()
    for c in clients:
        c.reseed()
        c.fit(c.model)
    sync(device)
    return time.perf_counter() - t


def cohort(clients, device):
    t = time.perf_counter()
    for c in clients:
        c.reseed()
    fit_cohort(clients)
    sync(device)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    device = resolve_device(args.device)
    ks = [int(k) for k in args.clients.split(",")]
    fashion = Path(FASHION_MNIST_ROOT).is_dir()
    base = DataConfig(dataset="idx", per_domain=2000) if fashion else DataConfig(dataset="digits")
    print(f"data: {'Rotated Fashion-MNIST' if fashion else 'embedded rotated digits'}, device {device}, "
          f"{torch.get_num_threads()} threads, {args.repeats} interleaved repetitions")
    for k in ks:
        data = load_data(DataConfig(dataset="digits", **{**base.__dict__, "clients_per_domain": math.ceil(k / 6)}))
        a, b = make(data, k, device), make(data, k, device)
        loop(a, device), cohort(b, device)
        err = max((x - y).abs().max().item() for ca, cb in zip(a, b)
                  for x, y in zip(ca.model.parameters(), cb.model.parameters()))
        tl, tv = [], []
        for _ in range(args.repeats):
            tl.append(loop(make(data, k, device), device))
            tv.append(cohort(make(data, k, device), device))
        r = [x / y for x, y in zip(tl, tv)]
        n = sum(len(c.train.y) for c in a)
        print(f"  K={k:4d} ({n} images)  loop {statistics.median(tl):7.2f} s  vmap {statistics.median(tv):7.2f} s  "
              f"loop/vmap {statistics.median(r):5.2f} (min {min(r):.2f}, max {max(r):.2f})  "
              f"max |w_loop - w_vmap| {err:.1e}")


if __name__ == "__main__":
    main()
