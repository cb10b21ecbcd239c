"""Driver memory over many rounds: FedAvg with 100 clients for 50 rounds, in-process, payloads stored on disk.

    python bench/memory.py [--rounds 50] [--clients-per-domain 20]

Prints the driver's resident set size (VmRSS, after garbage collection and malloc_trim) and its number of live
Python objects every 5 rounds, and their least-squares growth per round over the second half of the rounds
(warm-up excluded). Two passes run side by side: "as is" (the ledger keeps its in-memory
index of envelopes, ``Ledger.envelopes``: metadata, no payload bytes) and "no index" (that list replaced by one
that keeps nothing), so the growth that is left is the engine's own. Payload bytes go to
``payloads/`` as they are recorded and no envelope or payload is kept by the bus or the engine.
"""
import argparse
import gc
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import fdg_audit.federation as fed
from fdg_audit.data import FASHION_MNIST_ROOT, DataConfig, load_data
from fdg_audit.ledger import Ledger
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


class Forget(list):
    def append(self, _):
        pass


def one(data, cfg, rounds, keep_index) -> list[tuple[int, float]]:
    spec = fed.RunSpec("bench/fedavg/rot75/s0", "fedavg", Params(rounds=rounds, lr=0.05, batch_size=16, local_steps=1),
                       cfg, ModelConfig(), "rot75")
    trace = []

    def on_round(row):
        if row["round"] % 5 == 0:
            trim()
            trace.append((row["round"], rss_mb(), len(gc.get_objects())))
    with tempfile.TemporaryDirectory() as d:
        led = Ledger(d)
        if not keep_index:
            led.envelopes = Forget()
        fed.run_federation(spec, led, data, on_round=on_round)
        led.close()
        stored = sum(f.stat().st_size for f in Path(d, "payloads").rglob("*") if f.is_file())
    print(f"    payload bytes written to disk: {stored / 2 ** 20:.0f} MB")
    return trace


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--clients-per-domain", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fashion = Path(FASHION_MNIST_ROOT).is_dir()
    cfg = DataConfig(dataset="idx" if fashion else "digits", per_domain=1000 if fashion else 0,
                     clients_per_domain=args.clients_per_domain)
    data = load_data(cfg)
    n = args.clients_per_domain * (len(data.domains) - 1)
    print(f"FedAvg, {n} clients ({data.name}), {args.rounds} rounds, 1 local step, payloads on disk; RSS in MB")
    for keep in (True, False):
        print(f"  {'as is (ledger keeps its envelope index)' if keep else 'no envelope index'}:")
        trace = one(data, cfg, args.rounds, keep)
        print("    RSS MB  " + "  ".join(f"r{t}:{m:.0f}" for t, m, _ in trace))
        print("    objects " + "  ".join(f"r{t}:{o}" for t, _, o in trace))
        half = [x for x in trace if x[0] >= args.rounds // 2]
        rounds = [x[0] for x in half]
        slope = np.polyfit(rounds, [x[1] for x in half], 1)[0]
        objs = np.polyfit(rounds, [x[2] for x in half], 1)[0]
        print(f"    growth over rounds {half[0][0]}-{half[-1][0]}: RSS {slope * 1024:.1f} kB per round "
              f"({slope * 1024 / n:.2f} kB per client-round), {objs:.1f} live Python objects per round")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
