"""Wall-time ratio of FedAvg through the bus (encode, sha256, ledger + payload store on disk, decode)
versus the same training loop handing state dicts to the parties directly.

    python bench/bus_overhead.py [--rounds 5] [--repeats 3] [--arch cnn_small]

Both variants run the same Server/Client classes, data, seeds and evaluation; only the link differs.
Runs alternate (bus, direct, bus, direct, ...) and the ratio of the medians is printed. Target <= 1.10.
"""
import argparse
import statistics
import tempfile
import time

import fdg_audit.train.federation as fed
from fdg_audit.bus import Payload
from fdg_audit.data import DataConfig, load_data
from fdg_audit.store.ledger import Ledger
from fdg_audit.models import ModelConfig
from methods.fedavg import Params


class DirectLink(fed.LocalLink):
    """Hands the server's dicts to the clients and back, with no encoding and no record."""

    def exchange(self, phase, sender, kind, payloads, same=False):
        out = {}
        for c, pl in payloads.items():
            cl = self.clients[c]
            cl.round = self.bus.round
            cl.reseed()
            r = cl.handle(phase, None if pl is None else Payload(dict(pl[0]), dict(pl[1] or {})))
            out[c] = None if r is None else Payload(r.arrays, r.scalars)
        return out


def once(direct: bool, args, data) -> float:
    spec = fed.RunSpec("bench/fedavg/rot0/s0", "fedavg", Params(rounds=args.rounds, lr=0.02), DataConfig(dataset="digits"),
                       ModelConfig(arch=args.arch), "rot0")
    orig = fed.LocalLink
    fed.LocalLink = DirectLink if direct else orig
    try:
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            fed.run_federation(spec, Ledger(d), data)
            return time.perf_counter() - t
    finally:
        fed.LocalLink = orig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arch", default="cnn_small")
    args = ap.parse_args()
    data = load_data(DataConfig(dataset="digits"))
    once(True, args, data)  # warm-up
    bus, direct = [], []
    for _ in range(args.repeats):
        bus.append(once(False, args, data))
        direct.append(once(True, args, data))
    b, d = statistics.median(bus), statistics.median(direct)
    print(f"FedAvg {args.arch}, {args.rounds} rounds, 5 clients, median of {args.repeats}:")
    print(f"  through the bus  {b:7.2f} s   {[round(x, 2) for x in bus]}")
    print(f"  direct dicts     {d:7.2f} s   {[round(x, 2) for x in direct]}")
    print(f"  ratio bus/direct {b / d:7.3f}   (target <= 1.10)")


if __name__ == "__main__":
    main()
