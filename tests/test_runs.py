"""Runs: parallel runs record what sequential runs record; the selected round and convergence."""
import csv
import hashlib
import json

import pytest

from fdg_audit.train.federation import select_round

from conftest import tiny_scenario

# split_seed: a public split, so two folders can be compared (unset, each folder draws a secret one)
RUNS = dict(name="two", seeds=[0, 1], data=dict(split_seed=0, per_domain=60), train=dict(rounds=2, lr=0.05),
            methods=[dict(name="fedavg"), dict(name="feddg")])
TWO = tiny_scenario(RUNS)


def _digest(root):
    with open(root / "metrics.csv", newline="") as f:
        metrics = [r for r in csv.DictReader(f)]
    runs = [{k: v for k, v in r.items() if k != "seconds"} for r in json.loads((root / "summary.json").read_text())["runs"]]
    return hashlib.sha256((root / "messages.jsonl").read_bytes()).hexdigest(), metrics, runs


def test_parallel_runs_write_the_same_ledger_metrics_and_summary(run_toml):
    """Four runs two at a time in worker processes: messages.jsonl (every hash chain, in plan order), metrics.csv
    and summary.json equal the sequential runs' byte for byte (apart from wall time); no part file is left."""
    seq = run_toml(TWO, "report=false", name="seq")
    par = run_toml(TWO, "report=false", "parallel=2", name="par")
    assert _digest(seq) == _digest(par)
    assert not (par / "parts").exists()
    assert len(json.loads((par / "summary.json").read_text())["runs"]) == 4


def test_parallel_is_validated(run_toml):
    from fdg_audit.errors import UserError
    with pytest.raises(UserError, match="parallel = 0"):
        run_toml(TWO, "parallel=0")


def test_selected_round_is_the_earliest_within_one_standard_error_and_late_means_not_converged():
    """On a plateau the noisy argmax lands anywhere; the one-SE rule takes the plateau's first round. A run still
    improving at its end selects a round in the last 10% and is not converged."""
    plateau = [dict(round=t, source_val_acc=a) for t, a in
               enumerate([0.5, 0.8, 0.9, 0.93, 0.942, 0.935, 0.94, 0.93, 0.945, 0.94, 0.95], 0) if t]
    best, ok = select_round(plateau, n_val=500, rounds=10)
    assert best["round"] == 4 and ok                    # 0.942 >= 0.95 - sqrt(0.95 * 0.05 / 500) = 0.9403
    rising = [dict(round=t, source_val_acc=0.5 + 0.04 * t) for t in range(1, 11)]
    best, ok = select_round(rising, n_val=500, rounds=10)
    assert best["round"] == 10 and not ok
    best, ok = select_round(plateau, n_val=10 ** 9, rounds=10)   # no noise: the argmax, round 10
    assert best["round"] == 10 and not ok


def test_a_parallel_run_error_is_one_line_and_stops_the_other_runs(run_toml):
    """A one-line error inside a worker (here: CUDA asked for on a machine without it) reaches the caller as that
    line; the queued runs never start and no worker is left behind."""
    import time

    import torch

    from fdg_audit.errors import UserError
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    t = time.perf_counter()
    with pytest.raises(UserError, match="CUDA is not available"):
        run_toml(TWO, "parallel=2", 'device="cuda"')
    assert time.perf_counter() - t < 60
    from fdg_audit.train import runs
    assert not runs._POOL


def test_parallel_attacks_write_what_serial_attacks_write(run_toml):
    """The attack phase two worker processes at a time (parallel = 2, one thread each) writes leakage.csv,
    controls.json and every items/*.npz as the same attacks one at a time on one thread do."""
    attacks = tiny_scenario(RUNS, attacks=[dict(name="amplitude_fingerprint"), dict(name="label_distribution"),
                                          dict(name="mia_loss", max_victims=1)])
    seq = run_toml(attacks, "report=false", name="aseq")
    par = run_toml(attacks, "report=false", "parallel=2", name="apar")
    for f in ("leakage.csv", "controls.json"):
        assert (seq / f).read_bytes() == (par / f).read_bytes(), f
    items = sorted(p.relative_to(seq) for p in (seq / "items").rglob("*.npz"))
    assert items and items == sorted(p.relative_to(par) for p in (par / "items").rglob("*.npz"))
    assert all((seq / p).read_bytes() == (par / p).read_bytes() for p in items)


def test_a_batch_job_says_one_line_per_run_and_per_attack(tmp_path):
    """stderr redirected to a file (not a TTY): one line per finished run (name, held-out accuracy, seconds) and
    one per attack, and nothing else but the opening line."""
    import os
    import re
    import subprocess
    import sys
    (tmp_path / "s.toml").write_text(tiny_scenario(RUNS, seeds=[0], attacks=[dict(name="dataset_size")]))
    with open(tmp_path / "err.txt", "w") as err:
        p = subprocess.run([sys.executable, "-m", "fdg_audit", "scenario", str(tmp_path / "s.toml"), "--out",
                            str(tmp_path / "runs")], stderr=err, stdout=subprocess.PIPE, text=True, timeout=600,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [ln for ln in (tmp_path / "err.txt").read_text().splitlines()
             if not ln.startswith("warning: ")]   # the plan's coverage warnings (a kind no attack of it reads)
    assert p.returncode == 0, lines
    runs = [ln for ln in lines if re.match(r"\[\d/2\] ", ln)]
    assert len(runs) == 2 and all(re.search(r": held-out acc 0\.\d{3} .* \d+\.\d s; training \d/2 done, .* left$", ln)
                                  for ln in runs), lines
    assert {ln.split()[1].rstrip(":") for ln in runs} == {"rotated/fedavg/rot0/s0", "rotated/feddg/rot0/s0"}
    assert [ln for ln in lines if ln.startswith("attack ")] == [next(ln for ln in lines if ln.startswith(
        "attack dataset_size: 2 runs"))]
    assert len(lines) == 1 + 2 + 1, lines   # the opening line, the runs, the attack
