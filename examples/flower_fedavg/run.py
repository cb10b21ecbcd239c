"""Record the example Flower app with fdg_audit, attack the recordings and report them.

    python examples/flower_fedavg/run.py --out runs/flower_fedavg              # FedAvg and FedAvg + bank, 3 seeds
    python examples/flower_fedavg/run.py --out runs/x --rounds 2 --seeds 0 --no-attack

Each (strategy, seed) is one Flower simulation (Flower's simulation engine, 4 virtual clients: rot30 split into
clients of 1, 4, 16 and 64 real MNIST digits; rot75 held out), recorded into <out>/<strategy>_s<seed>/; then
``python -m fdg_audit attack`` on each folder and one ``python -m fdg_audit report`` over all of them (<out>/report).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from app import make_apps  # noqa: E402

from fdg_audit.data import DataConfig  # noqa: E402
from fdg_audit.flower import FlowerRecorder  # noqa: E402
from fdg_audit.models import ModelConfig  # noqa: E402

SETTINGS = dict(rounds=30, local_epochs=1, batch_size=32, lr=0.05)   # the main job's [train]
ATTACKS = [   # the attacks that read the weights and the bank, at a budget of minutes per folder on 2 cores (the main
    # job, scenarios/feddg_vs_csac.toml, runs update inversion at 400 iterations and phase retrieval at 8 images)
    dict(name="update_inversion", iterations=200, restarts=1, max_images=4),
    dict(name="amplitude_phase_retrieval", adversary_view="server", hio=300, er=100, restarts=1,
         variants=["box", "support"], max_images=4),
    dict(name="amplitude_fingerprint", adversary_view="server"),
]


def recorder(root, seed: int, bank: bool, rounds: int, split_seed: int) -> FlowerRecorder:
    data = DataConfig(dataset="mnist", family="rotated", domains=["rot30", "rot75"], per_domain=300,
                      client_sizes=[1, 4, 16, 64], split_seed=split_seed, draw=seed)
    return FlowerRecorder(root, data=data, target="rot75", seed=seed, settings=dict(SETTINGS, rounds=rounds),
                          model=ModelConfig(arch="cnn_small"), kinds={"amp": "amplitude_bank"}, attacks=ATTACKS,
                          name="flower_fedavg", label="fedavg_bank" if bank else "fedavg",
                          dataset_label="rotated_small")


def simulate(rec: FlowerRecorder, bank: bool) -> None:
    from flwr.simulation import run_simulation
    server_app, client_app = make_apps(rec, bank)
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}})
    if not (Path(rec.root) / "summary.json").exists():
        raise SystemExit(f"the Flower simulation of {rec.root} did not finish (see Flower's log above)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--split-seed", type=int, default=20261128)
    ap.add_argument("--strategies", nargs="+", choices=["fedavg", "fedavg_bank"], default=["fedavg", "fedavg_bank"])
    ap.add_argument("--no-attack", action="store_true")
    a = ap.parse_args(argv)
    folders = []
    for seed in a.seeds:
        for bank in [s == "fedavg_bank" for s in a.strategies]:
            root = Path(a.out) / f"{'fedavg_bank' if bank else 'fedavg'}_s{seed}"
            simulate(recorder(root, seed, bank, a.rounds, a.split_seed), bank)
            folders.append(str(root))
            if not a.no_attack:
                subprocess.run([sys.executable, "-m", "fdg_audit", "attack", str(root)], check=True)
    if not a.no_attack:
        subprocess.run([sys.executable, "-m", "fdg_audit", "report", *folders, "--out", str(Path(a.out) / "report")],
                       check=True)


if __name__ == "__main__":
    main()
