"""Driver memory over many rounds: FedAvg with 100 clients for 50 rounds, in-process, payloads stored on disk.

    python bench/memory.py [--rounds 50] [--clients-per-domain 20] [--warmup 10]

Prints the driver's resident set size (VmRSS, after garbage collection and malloc_trim) and its number of live
Python objects every 5 rounds, their least-squares growth per round after the first ``--warmup`` rounds (allocator
and caches filling), and the ratio of RSS at the last round to RSS at the end of the warm-up. Payload bytes go to
``payloads/`` and envelopes to ``messages.jsonl`` as they are recorded; the ledger keeps only a line count and one
chain head per run, and neither the bus nor the engine keeps an envelope or payload. At the end the envelopes are
read back from the file (``Ledger.stream``) to check that all of them were written.
"""
import argparse
import gc
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import fdg_audit.train.federation as fed
from fdg_audit.data import FASHION_MNIST_ROOT, DataConfig, load_data
from fdg_audit.store.ledger import Ledger
from fdg_audit.models import ModelConfig
from methods.fedavg import Params


def trim() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), so RSS reflects live memory."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(data, cfg, rounds) -> list[tuple[int, float]]:
    spec = fed.RunSpec("bench/fedavg/rot75/s0", "fedavg", Params(rounds=rounds, lr=0.05, batch_size=16, local_steps=1),
                       cfg, ModelConfig(), "rot75")
    trace = []

    def on_round(row):
        if row["round"] % 5 == 0:
            trim()
            trace.append((row["round"], rss_mb(), len(gc.get_objects())))
    with tempfile.TemporaryDirectory() as d:
        led = Ledger(d)
        fed.run_federation(spec, led, data, on_round=on_round)
        led.close()
        n = sum(1 for _ in led.stream())
        assert n == led.count, (n, led.count)
        print(f"    envelopes written and read back from messages.jsonl: {n}")
        stored = sum(f.stat().st_size for f in Path(d, "payloads").rglob("*") if f.is_file())
    print(f"    payload bytes written to disk: {stored / 2 ** 20:.0f} MB")
    return trace


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--clients-per-domain", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fashion = Path(FASHION_MNIST_ROOT).is_dir()
    cfg = DataConfig(dataset="idx" if fashion else "digits", per_domain=1000 if fashion else 0,
                     clients_per_domain=args.clients_per_domain)
    data = load_data(cfg)
    n = args.clients_per_domain * (len(data.domains) - 1)
    print(f"FedAvg, {n} clients ({data.name}), {args.rounds} rounds, 1 local step, payloads on disk; RSS in MB")
    trace = one(data, cfg, args.rounds)
    print("    RSS MB  " + "  ".join(f"r{t}:{m:.1f}" for t, m, _ in trace))
    print("    objects " + "  ".join(f"r{t}:{o}" for t, _, o in trace))
    after = [x for x in trace if x[0] >= args.warmup]
    rounds = [x[0] for x in after]
    slope = np.polyfit(rounds, [x[1] for x in after], 1)[0]
    objs = np.polyfit(rounds, [x[2] for x in after], 1)[0]
    print(f"    growth over rounds {after[0][0]}-{after[-1][0]} (first {args.warmup} rounds are warm-up): RSS "
          f"{slope * 1024:.1f} kB per round ({slope * 1024 / n:.3f} kB per client-round), {objs:.1f} live Python "
          f"objects per round; RSS round {after[-1][0]} / round {after[0][0]} = {after[-1][1] / after[0][1]:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
