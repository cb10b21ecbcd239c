"""Wall-time ratios of a scenario's attacks in each worker kind: bubblewrap sandboxes that serve job after job (a
fresh child of the sandbox's server per job, the sandbox cleaned in between; the default where bubblewrap works),
single-use ones (``bwrap-single``: each sandbox ends after its job and the next job starts a new interpreter, as
before issue 48), a forkserver process (the default without bubblewrap), and inside the harness process
(``isolate=False``, the unenforced debugging mode).

    python bench/attack_isolation.py [--scenario scenarios/feddg_vs_csac.toml] [--rounds 2] [--repeats 2]
                                     [--attacks NAME ...] [--per-domain N] [--keep DIR]

Trains the scenario once, shortened (``--rounds``, only the targets its attacks name, payloads of every round
kept, no attacks, no report), then runs its [[attacks]] on that folder in each mode in turn, ``--repeats`` times,
and prints the median wall times, their ratios, and the number of jobs and bubblewrap sandboxes one pass starts
(so the cost per sandbox can be read off). The first isolated pass also starts the forkserver (timed apart).
"""
import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import tomli_w

import fdg_audit.audit.harness as A
import fdg_audit.audit.checks as C
from fdg_audit.audit import bwrap, sandbox
from fdg_audit.audit.harness import run_attacks
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
    cfgs = [dict(name=e.name, label=e.label, **e.params) for e in parse(raw).attacks   # "all" expanded
            if not a.attacks or e.label in a.attacks]
    raw.pop("attacks", None)
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
        os.environ["FDG_AUDIT_SANDBOX"] = "process"
        run_attacks(root, cfgs[:1], quiet=True, isolate=True)   # starts the forkserver (once per process)
        print(f"first isolated attack incl. forkserver start: {time.perf_counter() - t0:.1f}s", flush=True)
        modes = ["bwrap", "bwrap-single"] * bwrap.bwrap_works() + ["process", "in-process"]
        reset = sandbox.Sandbox.reset
        times, launches = {m: [] for m in modes}, []
        start = sandbox.run_isolated

        def counted(*args, **kw):
            launches.append(1)
            return start(*args, **kw)
        sandbox.run_isolated = A.run_isolated = C.run_isolated = counted
        boxes, box = [], sandbox.Sandbox.__init__
        sandbox.Sandbox.__init__ = lambda self, *args: (boxes.append(1), box(self, *args))[1]
        for _ in range(a.repeats):
            for m in modes:
                os.environ["FDG_AUDIT_SANDBOX"] = m.split("-")[0] if m != "in-process" else "process"
                sandbox.Sandbox.reset = (lambda self: False) if m == "bwrap-single" else reset   # False: it ends
                launches.clear()
                boxes.clear()
                t0 = time.perf_counter()
                run_attacks(root, cfgs, quiet=True, isolate=m != "in-process")
                times[m].append(time.perf_counter() - t0)
                print(f"{m}: {times[m][-1]:.1f}s ({len(launches)} jobs, {len(boxes)} sandboxes)", flush=True)
    med = {m: statistics.median(t) for m, t in times.items()}
    print("medians of %d: " % a.repeats + ", ".join(f"{m} {v:.2f}s" for m, v in med.items()))
    for m in modes[:-1]:
        print(f"{m} / in-process: {med[m] / med['in-process']:.3f}")
    if "bwrap" in med:
        print(f"bwrap / process: {med['bwrap'] / med['process']:.3f}")
        print(f"bwrap (served in turn) / bwrap-single: {med['bwrap'] / med['bwrap-single']:.3f}")


if __name__ == "__main__":
    main()
