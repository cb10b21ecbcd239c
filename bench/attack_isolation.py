"""Wall-time ratio of running a scenario's attacks in worker processes on materialised views (the default) versus
inside the harness process (``isolate=False``, the unenforced debugging mode).

    python bench/attack_isolation.py [--scenario scenarios/feddg_vs_csac.toml] [--rounds 2] [--repeats 2]
                                     [--attacks NAME ...] [--per-domain N] [--keep DIR]

Trains the scenario once, shortened (``--rounds``, only the targets its attacks name, payloads of every round
kept, no attacks, no report), then runs its [[attacks]] on that folder alternately isolated and in-process and
prints the median wall times and their ratio. The first isolated pass also starts the forkserver (timed apart).
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import tomli_w

from fdg_audit.attack import run_attacks
from fdg_audit.data import load_data
from fdg_audit.runner import run_scenario
from fdg_audit.scenario import load_raw, parse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="scenarios/feddg_vs_csac.toml")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--attacks", nargs="*", default=[])
    ap.add_argument("--per-domain", type=int, default=0, help="cap images per domain (0 = the scenario's)")
    ap.add_argument("--keep", default="", help="train into this folder, or reuse the run folder trained there")
    a = ap.parse_args()
    raw = load_raw(a.scenario)
    cfgs = [dict(t) for t in raw.pop("attacks", []) if not a.attacks or t.get("label", t["name"]) in a.attacks]
    targets = {t for c in cfgs for t in c.get("targets", [])}
    for d, entry in zip(raw["datasets"], parse(raw).datasets):
        names = load_data(entry).names
        d["targets"] = [t for t in names if t in targets] or names[:1] if targets else d.get("targets", "all")
        if a.per_domain:
            d["per_domain"] = a.per_domain
    raw.setdefault("train", {})["rounds"] = a.rounds
    raw.update(report=False, store_rounds=[], threads=raw.get("threads") or 0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.keep or tmp)
        done = sorted(out.glob("runs/*/*/summary.json"))
        if done:
            root = done[-1].parent
        else:
            f = out / "bench.toml"
            out.mkdir(parents=True, exist_ok=True)
            f.write_text(tomli_w.dumps(raw))
            t0 = time.perf_counter()
            root = run_scenario(str(f), out=str(out / "runs"), quiet=True)
            print(f"trained {a.scenario} ({a.rounds} rounds) in {time.perf_counter() - t0:.1f}s", flush=True)
        print(f"attacks: {', '.join(c.get('label', c['name']) for c in cfgs)} on {root}", flush=True)
        t0 = time.perf_counter()
        run_attacks(root, cfgs[:1], quiet=True, isolate=True)   # starts the forkserver (once per process)
        print(f"first isolated attack incl. forkserver start: {time.perf_counter() - t0:.1f}s", flush=True)
        times = {True: [], False: []}
        for _ in range(a.repeats):
            for isolate in (True, False):
                t0 = time.perf_counter()
                run_attacks(root, cfgs, quiet=True, isolate=isolate)
                times[isolate].append(time.perf_counter() - t0)
                print(f"{'isolated' if isolate else 'in-process'}: {times[isolate][-1]:.1f}s", flush=True)
    iso, inp = statistics.median(times[True]), statistics.median(times[False])
    print(f"isolated {iso:.2f}s  in-process {inp:.2f}s  ratio {iso / inp:.3f}  "
          f"(medians of {a.repeats}, alternating; isolated {times[True]}, in-process {times[False]})")


if __name__ == "__main__":
    main()
