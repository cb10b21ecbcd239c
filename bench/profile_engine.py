"""Where the in-process engine's time goes on the reference FedAvg workload (bench/engines.py), by cProfile.

    python bench/profile_engine.py [--rounds 3]

Prints the cumulative time of local training, evaluation, the bus and the ledger as fractions of the run.
"""
import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import engines  # noqa: E402

from fdg_audit.data import DataConfig, load_data  # noqa: E402

PARTS = [("federation.py", "run_federation"), ("protocol.py", "fit"), ("protocol.py", "batches"),
         ("protocol.py", "accuracy"), ("bus.py", "encode_from"), ("bus.py", "record"), ("bus.py", "decode"),
         ("ledger.py", "append"), ("fedavg.py", "aggregate")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = load_data(DataConfig(dataset="digits"))
    engines.engine(data, 1, "local")   # warm-up
    pr = cProfile.Profile()
    pr.enable()
    engines.engine(data, args.rounds, "local")
    pr.disable()
    cum = {(f.split("/")[-1], fn): ct for (f, _, fn), (_, _, _, ct, _) in pstats.Stats(pr).stats.items()}
    total = cum[PARTS[0]]
    for key in PARTS:
        print(f"  {key[0]}:{key[1]:16s} {cum.get(key, 0.0):7.2f} s  {cum.get(key, 0.0) / total:6.1%}")


if __name__ == "__main__":
    main()
