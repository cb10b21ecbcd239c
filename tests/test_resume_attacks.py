"""Never lost results: a scenario killed by SIGTERM while attacking keeps every attack job that finished
(RUN/attack_jobs/, written atomically as each job is scored), and ``--resume`` runs only the jobs that had not, to
the same leakage.csv as an uninterrupted attack. No timing window: the test waits for the file that says a job
finished, and the other job waits for a gate file the test opens only after the kill."""
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conftest import public_split, tiny_scenario
from fdg_audit.api.attack import Attack, Estimate
from fdg_audit.vocab import AttackParams

HERE = __name__


@dataclass
class GateParams(AttackParams):
    log: str = ""    # each job appends "start <run>" and "end <run>" here
    gate: str = ""   # the job of a run of seed 1 waits until this file exists


class Gate(Attack):
    """Reads the weights; says n_samples = 7 for every client (a constant: the same rows whoever runs it)."""
    name, consumes, adversary = "gate", ("weights",), "server"
    Params = GateParams

    def run(self, view, aux):
        with open(self.p.log, "a") as f:
            f.write(f"start {view.run_id}\n")
        while view.run_id.endswith("/s1") and not os.path.exists(self.p.gate):
            time.sleep(0.05)
        with open(self.p.log, "a") as f:
            f.write(f"end {view.run_id}\n")
        return [Estimate(c, "weights", 1, "n_samples", np.array([7.0])) for c in view.clients]


def _wait_for(pattern: str, where: Path, proc, limit: float = 600.0) -> Path:
    """The first file matching ``pattern`` under ``where`` (an event, not a delay: ``limit`` only bounds a failure)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        got = sorted(where.glob(pattern))
        if got:
            return got[0]
        assert proc.poll() is None, f"the scenario ended before the file appeared:\n{proc.stderr.read()[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {pattern} under {where} after {limit:.0f} s")


def _count(log: Path, what: str, seed: int) -> int:
    """How often the log says ``what`` ("start" | "end") for the run of ``seed``."""
    return sum(1 for ln in log.read_text().splitlines() if ln.startswith(what + " ") and ln.endswith(f"/s{seed}"))


def test_sigterm_keeps_finished_attack_jobs_and_resume_runs_only_the_rest(tmp_path):
    from fdg_audit.cli import main
    log, gate, out = tmp_path / "log.txt", tmp_path / "gate", tmp_path / "runs"
    f = tmp_path / "s.toml"
    f.write_text(public_split(tiny_scenario(seeds=[0, 1], attacks=[
        {"name": f"{HERE}:Gate", "log": str(log), "gate": str(gate)}])))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "fdg_audit", "scenario", str(f), "--out", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        kept = _wait_for("t/*/attack_jobs/*/*/*s0.json", out, p)   # seed 0's job is scored and kept
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: interrupted while attacking") and "--resume" in last, err[-3000:]
    root = kept.parents[3]
    assert not (root / "leakage.csv").exists()                  # the attack phase did not finish ...
    assert _count(log, "end", 0) == 1 and _count(log, "end", 1) == 0   # s1 not started, or held at the gate
    before = kept.read_bytes()

    gate.touch()   # the interrupted job may finish now
    q = subprocess.run(cmd + ["--resume", str(root)], capture_output=True, text=True, env=env, timeout=600)
    assert q.returncode == 0, q.stderr[-3000:]
    assert f"attack {HERE}:Gate: 2 runs (1 kept from before)" in q.stderr, q.stderr[-3000:]
    assert _count(log, "start", 0) == 1       # the finished job did not run again ...
    assert _count(log, "end", 1) == 1        # ... the interrupted one did
    assert kept.read_bytes() == before

    # the same attack uninterrupted on a copy of the folder (no --resume: every job runs again): the same leakage.csv
    again = tmp_path / "again" / "t" / "copy"
    shutil.copytree(root, again)
    (again / "leakage.csv").unlink()
    assert main(["attack", str(again), "--quiet", "--trust-plugins"]) == 0
    assert _count(log, "start", 0) == 2
    leak = (root / "leakage.csv").read_text()
    assert leak == (again / "leakage.csv").read_text()
    rows = [ln for ln in leak.splitlines() if f",{HERE}:Gate," in ln and ",n_samples_rel_error," in ln]
    assert {ln.split(",")[0][-3:] for ln in rows} == {"/s0", "/s1"}, leak   # both runs' rows, each kept or new
