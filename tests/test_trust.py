"""The trust boundary (issue 11): run folders are data, attacks see only their view, damage is detected, bad input
is one line before any work, and an interrupted scenario resumes to the same records."""
import dataclasses
import gc
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import fdg_audit.runner as runner
import fdg_audit.train.runs as runs
from fdg_audit.api.attack import Attack, AttackParams, Skipped, Scores
from fdg_audit.audit.harness import run_attacks
from fdg_audit.cli import main

HERE = __name__
from conftest import public_split  # noqa: E402
from test_attack_framework import SCENARIO  # noqa: E402  (4 rotated-digit domains, 40 images each, 2 rounds)
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    out = tmp_path_factory.mktemp("trust")
    (out / "s.toml").write_text(public_split(SCENARIO.replace('name = "fw"', 'name = "tr"')))
    return runner.run_scenario(str(out / "s.toml"), out=str(out / "runs"), quiet=True)


@pytest.fixture
def copy(root, tmp_path):
    dst = tmp_path / "runs" / "tr" / "copy"
    shutil.copytree(root, dst)
    return dst


def one_line_error(capsys, argv, needle: str) -> str:
    assert main(argv) == 2
    err = "".join(ln for ln in capsys.readouterr().err.splitlines(True)
                  if not ln.startswith("warning: "))   # the plan's coverage warnings come before the work
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert needle in err, err
    return err.strip()


# ------------------------------------------------------------------------------------------ 1. folders are data

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")
from fdg_audit.api.attack import Attack
class Evil(Attack):
    name = "evil"
    consumes = ("weights",)
    def run(self, view, aux):
        return []
"""


def _craft(copy: Path, module: str, marker: Path) -> None:
    (copy / "evil.py").write_text(EVIL.format(marker=str(marker)))
    (copy / "methods").mkdir()                     # a package that would shadow the installed methods
    (copy / "methods" / "__init__.py").write_text(f"open({str(marker) + '.methods'!r}, 'w').write('x')\n")
    with open(copy / "config.resolved.toml", "a") as f:
        f.write(f'\n[[attacks]]\nname = "{module}"\n')


@pytest.mark.parametrize("cwd_is", ["folder", "project"])
def test_a_crafted_run_folder_runs_no_code(copy, tmp_path, cwd_is):
    marker = tmp_path / "imported"
    if cwd_is == "folder":        # `cd RUN_DIR && python -m fdg_audit attack .`: evil.py is on sys.path[0]
        module, cwd, arg = "evil:Evil", copy, "."
    else:                         # from the project root the folder is a dotted package path
        module, cwd, arg = "runs.tr.copy.evil:Evil", tmp_path, str(copy)
    _craft(copy, module, marker)
    p = subprocess.run([sys.executable, "-m", "fdg_audit", "attack", arg, "--quiet"], cwd=cwd, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"names attack '{module}', which is not an installed plugin" in p.stderr and "--trust-plugins" in p.stderr
    assert not marker.exists() and not Path(str(marker) + ".methods").exists()
    if cwd_is == "folder":        # the user may allow it explicitly; the shadow `methods` package stays unused
        p = subprocess.run([sys.executable, "-m", "fdg_audit", "attack", arg, "--quiet", "--trust-plugins"],
                           cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert marker.read_text() == "imported" and not Path(str(marker) + ".methods").exists()


def test_a_folder_naming_an_unknown_method_is_refused(copy, capsys):
    s = json.loads((copy / "summary.json").read_text())   # the run records name the method the views rebuild
    s["runs"][0]["plugin"] = "evil:Evil"
    (copy / "summary.json").write_text(json.dumps(s))
    one_line_error(capsys, ["attack", str(copy), "--attacks", f"{HERE}:Probe"], "names method 'evil:Evil'")


# ------------------------------------------------------------------------------------------ 2. only the view

class Probe(Attack):
    """A malicious curious client: reports every route to other parties' data it finds (as a Skipped reason)."""
    name = "probe"
    consumes = ("weights",)
    adversary = "client"
    aux = ("candidates",)

    def run(self, view, aux):
        from fdg_audit.audit.scoring import Truth
        from fdg_audit.data import DomainSet
        from fdg_audit.store.ledger import Ledger
        found = []
        others = [c for c in view.clients if c != view.me]
        found += [f"message {m.sender}->{m.receiver}" for m in view.messages() if view.me not in (m.sender, m.receiver)]
        for m in view.messages()[:1]:
            led = m._ledger                                    # the ledger behind the messages
            found += [f"ledger envelope {e.sender}->{e.receiver}" for e in led.envelopes
                      if view.me not in (e.sender, e.receiver)]
            found += [f"file {p.name}" for p in Path(led.root).rglob("*") if p.name in ("truth", "summary.json")]
            found += ["run folder" for p in (Path(led.root), *Path(led.root).parents) if (p / "summary.json").exists()]
        for o in gc.get_objects():                             # the process's memory
            if type(o) in (Truth, DomainSet) or type(o) is Ledger and len(o.envelopes) > len(view.messages()):
                found.append(f"object {type(o).__name__}")
        roots = os.environ.get("PROBE_RUN_DIR", "")
        found += ["run folder in memory" for o in gc.get_objects() if type(o) is str and roots and roots in o
                  and o != roots]
        outs = [Scores(v, "weights", 1, np.zeros(len(aux.candidates[v]))) for v in others]
        return outs + [Skipped(view.me, "weights", 1, json.dumps(sorted(set(found))))]


def _probe(root, isolate: bool) -> list:
    os.environ["PROBE_RUN_DIR"] = str(Path(root).resolve())
    try:
        run_attacks(root, [{"name": f"{HERE}:Probe"}], quiet=True, isolate=isolate)
    finally:
        del os.environ["PROBE_RUN_DIR"]
    from conftest import leakage_rows
    (r,) = leakage_rows(root, attack="probe", metric="skipped")
    return json.loads(r["status"].removeprefix("skipped: "))


def test_a_malicious_attack_reaches_nothing_outside_its_view(copy):
    assert _probe(copy, isolate=True) == []
    found = _probe(copy, isolate=False)    # the in-process debugging mode enforces nothing: the probe is not blind
    assert {"ledger envelope rot15->server", "file summary.json", "run folder", "object DomainSet"} <= set(found)


@dataclasses.dataclass
class WalkerParams(AttackParams):
    marker: str = ""


class FrameWalker(Attack):
    """A hostile plugin whose import and ``__init__`` look for the harness: every frame's locals above it (the
    ledger, the runs, the aux cache), and the process it runs in, written to ``marker``."""
    name = "frame_walker"
    consumes = ("weights",)
    Params = WalkerParams

    def __init__(self, params=None, device="cpu"):
        super().__init__(params, device)
        f, seen = sys._getframe(1), []
        while f is not None:
            seen += [k for k in ("ledger", "runs", "cache", "summary") if k in f.f_locals]
            f = f.f_back
        with open(self.p.marker, "a") as fh:
            fh.write(json.dumps(dict(pid=os.getpid(), seen=seen)) + "\n")

    def run(self, view, aux):
        return []


def test_plugin_code_runs_only_in_the_worker(copy, tmp_path):
    """Checking the scenario's attacks (before training) and attacking a folder import and construct the plugin in
    worker processes only: its __init__ never runs in the harness and finds none of the harness's objects."""
    from fdg_audit.audit.checks import check_attacks
    marker = tmp_path / "inits.jsonl"
    cfg = {"name": f"{HERE}:FrameWalker", "marker": str(marker)}
    check_attacks([cfg])
    run_attacks(copy, [cfg], quiet=True)
    inits = [json.loads(x) for x in marker.read_text().splitlines()]
    assert len(inits) >= 2 and all(i["pid"] != os.getpid() and i["seen"] == [] for i in inits), inits


@pytest.mark.skipif(not __import__("fdg_audit.audit.bwrap").audit.bwrap.bwrap_works(), reason="needs bubblewrap")
def test_under_bubblewrap_a_plugin_opens_nothing_outside_its_view(copy, tmp_path, monkeypatch):
    """With bubblewrap (the default where it is installed) the worker's file system holds no run folder, no
    truth/, no other view folder, no /proc/<harness> and no network; the same plugin as a plain process reads them
    all (the README says that worker is unenforced)."""
    import tempfile

    from conftest import leakage_rows
    other = Path(tempfile.mkdtemp(prefix="fdg_view_"))   # another job's view folder, alive meanwhile
    (other / "messages.jsonl").write_text("secret")
    paths = [str(copy / "summary.json"), str(copy / "truth"), str(other / "messages.jsonl"), str(copy.parent)]
    import socket
    srv = socket.create_server(("127.0.0.1", 0))
    cfg = {"name": "sandbox_probe:Escape", "paths": paths, "harness": os.getpid(), "port": srv.getsockname()[1]}
    found = {}
    for mode in ("bwrap", "process"):
        monkeypatch.setenv("FDG_AUDIT_SANDBOX", mode)
        run_attacks(copy, [cfg], quiet=True)
        found[mode] = json.loads(leakage_rows(copy, attack="escape", metric="skipped")[0]["status"][9:])
        assert [c["passed"] for c in json.loads((copy / "controls.json").read_text()) if c["attack"] == "escape"] \
            == [True], mode   # the installed plugins (methods, for shadow runs) load inside the sandbox
    shutil.rmtree(other)
    srv.close()
    assert found["bwrap"] == [], found["bwrap"]
    assert len(found["process"]) == len(paths) + 2, found["process"]   # the control: the plain worker reads them


def test_the_sandbox_setting_is_checked(monkeypatch, copy, capsys):
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", "docker")
    one_line_error(capsys, ["attack", str(copy), "--attacks", "mia_loss"], "FDG_AUDIT_SANDBOX = 'docker'")


# ------------------------------------------------------------------------------------------ 3. tamper evidence

def _lines(copy):
    return (copy / "messages.jsonl").read_text().splitlines(keepends=True)


def _rewrite(copy, lines):
    (copy / "messages.jsonl").write_text("".join(lines))


RUN = "rotated/fedavg/rot45/s0"


@pytest.mark.parametrize("damage,needle", [
    ("delete", f"messages.jsonl line 4 (run {RUN}) does not chain to line 3"),
    ("reorder", f"messages.jsonl line 3 (run {RUN}) does not chain to line 2"),
    ("edit", f"messages.jsonl line 5 (run {RUN}) does not chain to line 4"),
    ("cut_end", f"run {RUN} ends at line"),
    ("foreign", "messages.jsonl line 3 is not an envelope (missing field 'run')"),
    ("garbage", "messages.jsonl line 3 is not valid JSON"),
    ("missing_payload", "is missing from payloads/"),
    ("edited_payload", "does not match its envelope's sha256"),
    ("summary_json", "summary.json is not valid JSON"),
    ("summary_keys", "summary.json is not a run summary"),
])
def test_damage_is_one_line_naming_run_and_line(copy, capsys, damage, needle):
    lines = _lines(copy)
    if damage == "delete":
        _rewrite(copy, lines[:3] + lines[4:])
    elif damage == "reorder":
        _rewrite(copy, lines[:2] + [lines[3], lines[2]] + lines[4:])
    elif damage == "edit":
        _rewrite(copy, lines[:3] + [lines[3].replace('"wire_bytes":', '"wire_bytes":1')] + lines[4:])
    elif damage == "cut_end":
        _rewrite(copy, lines[:-1])
    elif damage == "foreign":
        _rewrite(copy, lines[:2] + ['{"hello": 1}\n'] + lines[2:])
    elif damage == "garbage":
        _rewrite(copy, lines[:2] + ['{"run": "dig\n'] + lines[2:])
    elif damage in ("missing_payload", "edited_payload"):   # a payload the curious client rot0 received
        env = next(json.loads(x) for x in lines if '"receiver":"rot0"' in x and '"kind":"weights"' in x)
        p = copy / "payloads" / env["sha256"][:2] / env["sha256"]
        p.unlink() if damage == "missing_payload" else p.write_bytes(p.read_bytes()[:-4] + b"\0\0\0\0")
    elif damage == "summary_json":
        (copy / "summary.json").write_text('{"runs": [')
    else:
        (copy / "summary.json").write_text('{"scenario": "tr"}')
    err = one_line_error(capsys, ["attack", str(copy), "--attacks", f"{HERE}:Probe", "--quiet"], needle)
    assert "damaged" in err


def test_torn_last_line_is_an_interrupted_run_not_a_crash(copy, capsys):
    with open(copy / "messages.jsonl", "a") as f:
        f.write('{"run": "rotated/fedavg/rot45/s1", "meth')                 # a kill mid-write
    run_attacks(copy, [{"name": f"{HERE}:Probe"}], quiet=True)        # the finished run is intact
    assert main(["report", str(copy)]) == 0
    md = (copy / "report.md").read_text()
    assert "1 runs planned, 1 finished, 0 failed, 0 missing" in md and "torn last line" in md


def test_object_arrays_and_damaged_npz_are_one_line(copy, capsys):
    bad = copy / "mia" / "x" / "rotated__fedavg__rot45__s0.npz"
    bad.parent.mkdir(parents=True)
    np.savez(bad, score=np.array([{"a": 1}], dtype=object))
    one_line_error(capsys, ["report", str(copy)], "cannot be read as plain arrays (score.npy declares objects)")


# ------------------------------------------------------------------------------------------ 4. validation first

def _png(path: Path, w: int, h: int) -> None:
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("change,needle", [
    (("rounds = 2", "rounds = 2.5"), "train.rounds = 2.5 has the wrong type: expected int"),
    (("threads = 1", "threads = 1\nseeds = [0, 0]"), "seeds = [0, 0] repeats a seed"),
    (("threads = 1", "threads = 1\nseeds = []"), "seeds = []: give a non-empty list of integers"),
    (('targets = ["rot45"]', "targets = []"), "data.targets = []: give \"all\" or a non-empty list"),
    (('targets = ["rot45"]', 'targets = "rot0"'), 'data.targets = "rot0"'),
    (('[[methods]]\nname = "fedavg"', "", "threads = 1", "threads = 1\nmethods = []"), "methods = [] names no method"),
    (('name = "fedavg"', 'name = "fedavg"\n[[attacks]]\nname = "no_such_attack"'), "neither a registered name"),
    (('name = "fedavg"', 'name = "fedavg"\n[[attacks]]\nname = "dataset_size"\nbogus = 1'),
     "unknown key attacks.dataset_size.bogus"),
    (("per_domain = 40", "per_domain = 40.5"), "data.per_domain = 40.5 has the wrong type"),
    (('name = "fedavg"', 'name = "fedavg"\n[[attacks]]\nname = "dataset_size"\ntargets = ["rot99"]'),
     "attacks.dataset_size.targets = ['rot99']: no run holds out ['rot99']"),
    (('name = "fedavg"', 'name = "fedavg"\n[[attacks]]\nname = "update_inversion"\nmax_parties = -1'),
     "max_parties >= 0 (0 = all)"),
])
def test_bad_scenarios_fail_before_any_work(tmp_path, capsys, change, needle):
    f = tmp_path / "bad.toml"
    text = SCENARIO
    for old, new in zip(change[::2], change[1::2]):
        assert old in text
        text = text.replace(old, new)
    f.write_text(text)
    one_line_error(capsys, ["scenario", str(f), "--out", str(tmp_path / "runs"), "--quiet"], needle)
    assert not (tmp_path / "runs").exists()                          # nothing was trained or written


def test_oversized_image_and_idx_headers_are_one_line(tmp_path, capsys):
    for d in ("a", "b"):
        (tmp_path / "img" / d / "cat").mkdir(parents=True)
        _png(tmp_path / "img" / d / "cat" / "ok.png", 2, 2)
    _png(tmp_path / "img" / "b" / "cat" / "huge.png", 30000, 30000)
    f = tmp_path / "img.toml"
    f.write_text(f'[data]\ndataset = "folder"\nroot = "{tmp_path / "img"}"\nval_fraction = 0.5\n')
    one_line_error(capsys, ["scenario", str(f), "--quiet", "--out", str(tmp_path / "runs")], "huge.png claims too many pixels")
    (tmp_path / "idx").mkdir()
    from fdg_audit.data.idx import FILES
    for name in FILES:
        (tmp_path / "idx" / name).write_bytes(bytes([0, 0, 8, 200]) + b"\0" * 40)
    f.write_text(f'[data]\ndataset = "idx"\nroot = "{tmp_path / "idx"}"\n')
    one_line_error(capsys, ["scenario", str(f), "--quiet", "--out", str(tmp_path / "runs")], "claims 200 dimensions")
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ 5. resume

TWO = SCENARIO.replace('targets = ["rot45"]', 'targets = ["rot45", "rot30"]')


def test_interrupted_scenario_resumes_to_the_same_records(tmp_path, capsys, monkeypatch):
    f = tmp_path / "two.toml"
    f.write_text(public_split(TWO))
    assert main(["scenario", str(f), "--out", str(tmp_path / "a"), "--quiet"]) == 0
    (a,) = (tmp_path / "a" / "fw").iterdir()
    real, calls = runs.run_federation, []

    def killed(spec, ledger, data, on_round=None, truth_sink=None):   # Ctrl-C in round 2 of the second run
        calls.append(spec.run_id)

        def tick(row):
            if len(calls) == 2 and row["round"] == 2:
                raise KeyboardInterrupt
        return real(spec, ledger, data, on_round=tick, truth_sink=truth_sink)
    monkeypatch.setattr(runs, "run_federation", killed)
    err = one_line_error(capsys, ["scenario", str(f), "--out", str(tmp_path / "b"), "--quiet"],
                         "interrupted during run 2/2 (rotated/fedavg/rot30/s0): 1 of 2 runs finished in")
    (b,) = (tmp_path / "b" / "fw").iterdir()
    assert err.endswith(f"resume with: python -m fdg_audit scenario {f} --resume {b}")
    assert "rot30" in (b / "messages.jsonl").read_text()                  # the killed run left partial lines
    with open(b / "messages.jsonl", "a") as fh:
        fh.write('{"run": "rotated/fedavg/rot30/s0", "se')                   # and a torn one
    assert main(["report", str(b)]) == 0
    md = (b / "report.md").read_text()
    assert "2 runs planned, 1 finished, 0 failed, 1 missing" in md and "missing: `rotated/fedavg/rot30/s0`" in md
    monkeypatch.setattr(runs, "run_federation", real)
    capsys.readouterr()
    assert main(["scenario", str(f), "--resume", str(b), "--quiet"]) == 0
    for name in ("metrics.csv", "messages.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    heads = [{r["run"]: r["chain_head"] for r in json.loads((d / "summary.json").read_text())["runs"]} for d in (a, b)]
    assert heads[0] == heads[1] and len(heads[0]) == 2
    assert json.loads((b / "manifest.json").read_text())["resumed_with"] == ["rotated/fedavg/rot45/s0"]
    before = {p.name: p.read_bytes() for p in b.iterdir() if p.is_file()}
    one_line_error(capsys, ["scenario", str(f), "--resume", str(b), "--set", "train.lr=0.07"],
                   "2 finished run(s) (e.g. rotated/fedavg/rot45/s0) were made with another configuration")
    assert {p.name: p.read_bytes() for p in b.iterdir() if p.is_file()} == before    # nothing lost, nothing rewritten

    # a folder made before a field existed (here data.client_sizes): its runs were hashed without the field, and the
    # field at its default leaves their configuration what it was, so they resume; set to anything else, it does not
    summary = json.loads((b / "summary.json").read_text())
    import hashlib
    for r in summary["runs"]:
        r["data"].pop("client_sizes")
        cfg = dict(run=r["run"], method=r["plugin"], params=r["params"],
                   data=dict(r["data"], label="rotated", targets=["rot45", "rot30"]), model=r["model"],
                   target=r["target"], seed=r["seed"], store="all", store_rounds=[], privacy={})
        r["config_sha256"] = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
    (b / "summary.json").write_text(json.dumps(summary))
    one_line_error(capsys, ["scenario", str(f), "--resume", str(b), "--set", "data.client_sizes=[2, 3]"],
                   "2 finished run(s) (e.g. rotated/fedavg/rot45/s0) were made with another configuration")
    assert main(["scenario", str(f), "--resume", str(b), "--quiet"]) == 0
    assert sorted(json.loads((b / "manifest.json").read_text())["resumed_with"]) == ["rotated/fedavg/rot30/s0",
                                                                                    "rotated/fedavg/rot45/s0"]
    assert (a / "messages.jsonl").read_bytes() == (b / "messages.jsonl").read_bytes()     # nothing trained again


PLUGIN_FILE = '''
from fdg_audit.api.attack import Attack
{before}

class Probe(Attack):
    name = "tmp_probe"
    consumes = ("weights",)
    outputs = {{"": "nothing"}}

    def run(self, view, aux):
        return []
'''


@pytest.mark.skipif(not __import__("fdg_audit.audit.bwrap").audit.bwrap.bwrap_works(), reason="needs bubblewrap")
def test_a_plugin_under_tmp_loads_in_the_bubblewrap_worker(tmp_path, monkeypatch):
    """The sandbox's own /tmp is mounted before the plugin's read-only source, so a plugin kept under /tmp (here
    pytest's tmp_path) stays visible to its worker."""
    from fdg_audit.audit.checks import check_attacks
    assert str(tmp_path.resolve()).startswith("/tmp/")
    (tmp_path / "tmp_plugin_ok.py").write_text(PLUGIN_FILE.format(before=""))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", "bwrap")
    check_attacks([{"name": "tmp_plugin_ok:Probe"}])


def test_a_plugin_whose_worker_dies_at_import_is_one_line(tmp_path, monkeypatch, capsys):
    """A plugin that kills its probe worker while being imported stops the scenario with one line, not a
    traceback, before any training."""
    (tmp_path / "tmp_plugin_dies.py").write_text(PLUGIN_FILE.format(before="import os\nos._exit(3)"))
    monkeypatch.syspath_prepend(str(tmp_path))
    f = tmp_path / "s.toml"
    f.write_text(public_split(SCENARIO) + '\n[[attacks]]\nname = "tmp_plugin_dies:Probe"\n')
    one_line_error(capsys, ["scenario", str(f), "--out", str(tmp_path / "o"), "--quiet"],
                   "attack 'tmp_plugin_dies:Probe' could not be loaded in its worker")
    assert not (tmp_path / "o").exists()
