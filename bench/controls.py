"""Do an attack's controls clear their thresholds by a margin that survives other seeds and another machine's floats?

    python bench/controls.py mia_lira mia_rmia [--seeds 0 1 2 3 4] [--threads 1 2]

Runs each attack's ``control()`` (its positive and negative controls, fdg_audit.api.attack.Control) once per seed and
torch thread count, each in a fresh process (the thread count set before any work; another thread count sums floats
in another order, as another machine would), and prints every control's value, threshold and margin (value minus
threshold for a positive control, threshold minus value for a negative one), then per control the smallest margin
and the spread of its values. CPU seconds of each process are printed beside it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(name: str, seed: int, threads: int) -> None:
    """In this process: the controls of attack ``name`` with seed ``seed`` on ``threads`` torch threads, as JSON."""
    import resource

    import torch
    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))
    from fdg_audit.attack import load_attack
    cls = load_attack(name)
    atk = cls(cls.Params(seed=seed), device="cpu")
    out = [dict(name=c.name, metric=c.metric, value=float(c.value), threshold=float(c.threshold),
                positive=bool(c.positive)) for c in atk.control()]
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps(dict(controls=out, cpu=cpu.ru_utime + cpu.ru_stime)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("attacks", nargs="+")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        return one(a.attacks[0], a.seeds[0], a.threads[0])
    margins = {}
    for name in a.attacks:
        for seed in a.seeds:
            for t in a.threads:
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, __file__, name, "--seeds", str(seed), "--threads", str(t), "--one"],
                                   capture_output=True, text=True)
                if p.returncode:
                    print(f"{name} seed {seed} threads {t}: failed: {p.stderr.strip().splitlines()[-1:]}")
                    continue
                got = json.loads(p.stdout.strip().splitlines()[-1])
                for c in got["controls"]:
                    m = c["value"] - c["threshold"] if c["positive"] else c["threshold"] - c["value"]
                    margins.setdefault((name, c["name"]), []).append((seed, t, c["value"], m))
                    print(f"{name} seed {seed} threads {t}: {c['name']}: {c['metric']} {c['value']:.4f} vs "
                          f"{'>=' if c['positive'] else '<='} {c['threshold']} (margin {m:+.4f}); "
                          f"{got['cpu']:.0f} CPU s, {time.perf_counter() - t0:.0f} s")
    print()
    for (name, control), ms in margins.items():
        vals = [v for _, _, v, _ in ms]
        worst = min(ms, key=lambda x: x[3])
        print(f"{name}: {control}: values {min(vals):.4f}-{max(vals):.4f} over {len(ms)} runs; smallest margin "
              f"{worst[3]:+.4f} (seed {worst[0]}, {worst[1]} threads)")


if __name__ == "__main__":
    main()
