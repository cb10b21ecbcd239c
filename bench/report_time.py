"""The report's wall time on one run folder: this checkout against another commit, interleaved, side by side.

    python bench/report_time.py RUN_FOLDER [--base fa9809b] [--repeats 3]

Checks the base commit out into a temporary git worktree, then renders ``RUN_FOLDER``'s report with each code in
turn (base, this checkout; ``--repeats`` pairs), each in a fresh process writing to its own temporary folder, and
prints every pair's times and the ratio this / base (median and range). Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def render(code: Path, run: str, out: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(code))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fdg_audit", "report", run, "--out", str(out)], cwd=code, env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--base", default="fa9809b")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(base), a.base], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            ratios = []
            for i in range(a.repeats):
                tb = render(base, a.run, Path(tmp) / f"out_base{i}")
                tn = render(ROOT, a.run, Path(tmp) / f"out_this{i}")
                ratios.append(tn / tb)
                print(f"pair {i + 1}: base {tb:.1f} s, this checkout {tn:.1f} s, ratio {tn / tb:.2f}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(f"ratio this / {a.base}: median {statistics.median(ratios):.2f}, range [{min(ratios):.2f}, {max(ratios):.2f}]"
          f" (n = {len(ratios)} interleaved pairs)")


if __name__ == "__main__":
    main()
