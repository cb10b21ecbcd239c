"""Wall-time ratio of the example Flower app (examples/flower_fedavg/) recorded by fdg_audit.flower versus the same
app without the recorder: 30 rounds of FedAvg on Flower's simulation engine, 4 clients of 1, 4, 16 and 64 MNIST digits.

    python bench/flower_overhead.py [--rounds 30] [--repeats 3] [--bank]

"With": the client mod in ClientApp(mods=...), declare() in the client, the recording Grid and finish() (checks and
run-folder files). "Without": the same ClientApp and ServerApp with none of them. Both keep the same central
evaluation every round (the recorder's evaluate_fn). The time is the federation's, in the ServerApp: from the first
call of evaluate_fn (round 0, before round 1) to the end of the last round (with the recorder: the end of finish());
Ray's start and stop are left out (the same for both, seconds per simulation). Runs alternate (with, without,
without, with, ...: each pair's order flips), so a loaded machine slows both alike; each pair's ratio is printed, then their median, range and a 95%
Student-t interval of the mean ratio over pairs. Target: below 1.25.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "flower_fedavg"))
from app import make_apps  # noqa: E402
from run import recorder  # noqa: E402

from fdg_audit.flower import FlowerRecorder  # noqa: E402


class Timed(FlowerRecorder):
    """The example's recorder, stamping the federation's start (round-0 evaluation) and end."""

    def evaluate_fn(self, server_round, arrays):
        out = super().evaluate_fn(server_round, arrays)
        self.stamps = getattr(self, "stamps", [])
        self.stamps.append(time.perf_counter())
        return out

    def finish(self):
        root = super().finish()
        self.stamps.append(time.perf_counter())
        return root


def once(record: bool, args, root: Path) -> float:
    from flwr.simulation import run_simulation
    base = recorder(root, 0, args.bank, args.rounds, 20261128)
    rec = Timed(root, data=base.data, target=base.target, seed=0, settings=dict(rounds=args.rounds, lr=0.05),
                model=base.model, kinds=base.kinds, attacks=[], label=base.run_id.split("/")[1],
                dataset_label="rotated_small")
    server_app, client_app = make_apps(rec, args.bank, record=record)
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}})
    return rec.stamps[-1] - rec.stamps[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bank", action="store_true", help="the strategy whose clients also send an amplitude bank")
    args = ap.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            first = i % 2 == 0   # with first in even pairs, without first in odd ones: neither order is favoured
            t = {r: once(r, args, Path(tmp) / f"{r}{i}") for r in ((True, False) if first else (False, True))}
            w, wo = t[True], t[False]
            ratios.append(w / wo)
            print(f"pair {i + 1}: with the recorder {w:.1f} s, without {wo:.1f} s, ratio {w / wo:.3f}", flush=True)
    n = len(ratios)
    mean = statistics.mean(ratios)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(ratios) / n ** 0.5 if n > 1 else float("nan")
    print(f"{args.rounds} rounds, n = {n} interleaved pairs: ratio median {statistics.median(ratios):.3f}, range "
          f"[{min(ratios):.3f}, {max(ratios):.3f}], mean {mean:.3f} [{mean - half:.3f}, {mean + half:.3f}] (95% "
          f"Student-t); target < 1.25: {'met' if max(ratios) < 1.25 else 'not met by every pair'}")


if __name__ == "__main__":
    main()
