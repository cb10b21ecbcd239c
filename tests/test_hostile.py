"""The trust boundary, round 3 (issue 35): hostile plugins (tests/hostile/) run under bubblewrap as the user running
the suite (root on CI): the sandbox holds as root, results are data, every worker ends, every input is checked."""
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from fdg_audit.errors import UserError
from fdg_audit.audit.checks import check_attacks
from fdg_audit.audit.harness import run_attacks
from fdg_audit.audit.bwrap import bwrap_works

from conftest import leakage_rows, tiny_scenario
from test_trust import ENV, copy, one_line_error, root  # noqa: F401  (fixtures: a finished run folder and a copy)

HOSTILE = Path(__file__).parent / "hostile"
CODE = dict(ENV, PYTHONPATH=os.pathsep.join([str(Path(__import__("fdg_audit").__file__).parents[1]),
                                            ENV["PYTHONPATH"]]))   # subprocesses run the fdg_audit under test
needs_bwrap = pytest.mark.skipif(not bwrap_works(), reason="needs bubblewrap (apt-get install bubblewrap)")


def _reason(folder, label: str) -> dict:
    (r,) = leakage_rows(folder, attack=label, metric="skipped")
    return json.loads(r["status"].removeprefix("skipped: "))


def _settings(folder: Path, **kv) -> None:
    """Top-level scenario settings in the folder's config.resolved.toml (before its first table)."""
    cfg = folder / "config.resolved.toml"
    cfg.write_text("".join(f"{k} = {v}\n" for k, v in kv.items()) + cfg.read_text())


@needs_bwrap
def test_root_in_the_sandbox_has_no_capabilities_no_writable_mount_and_no_harness_environment(
        copy, tmp_path, monkeypatch):  # noqa: F811
    """Break 1 and 3: as root the worker kept CAP_SYS_ADMIN, remounted its read-only plugin source and appended to
    it; bubblewrap itself (PID 1 inside) carried the harness's environment. The same plugin as a plain process is
    the control: there the append lands."""
    shutil.copytree(HOSTILE, tmp_path / "hostile_root_copy")
    monkeypatch.syspath_prepend(str(tmp_path))
    target = tmp_path / "hostile_root_copy" / "__init__.py"
    canary = "fdg-canary-" + secrets.token_hex(8)
    monkeypatch.setenv("FDG_TEST_CANARY", canary)
    before = target.read_text()
    cfg = {"name": "hostile_root_copy:Root", "paths": [str(target)], "canary": canary}
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", "bwrap")
    run_attacks(copy, [cfg], quiet=True)
    got = _reason(copy, "hostile_root")
    assert got["cap_eff"] == "0000000000000000", got
    assert "written" not in got[str(target)] and target.read_text() == before, got
    assert got["canary_in"] == [], got
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", "process")
    run_attacks(copy, [cfg], quiet=True)
    assert "written" in _reason(copy, "hostile_root")[str(target)] and target.read_text() != before


@needs_bwrap
def test_a_namespace_package_named_like_the_runs_folder_reaches_no_truth(root, tmp_path):  # noqa: F811
    """Break 2: from the project root, ``attack runs/... --attacks runs.<ns>:Evil`` bound <project>/runs (truth
    included) into the sandbox. Now only the plugin's Python files are: it loads, runs and finds no truth/."""
    proj = tmp_path / "proj"
    shutil.copytree(root, proj / "runs" / "tr" / "copy")
    (proj / "runs" / "evilns").mkdir()
    (proj / "runs" / "evilns" / "mod.py").write_text(
        "from pathlib import Path\nfrom fdg_audit.api.attack import Attack, Skipped\n"
        "TRUTH = Path(__file__).resolve().parents[1] / 'tr' / 'copy' / 'truth'\n"
        "class Evil(Attack):\n    name = 'evil'\n    consumes = ('weights',)\n"
        "    def __init__(self, params=None, device='cpu'):\n        super().__init__(params, device)\n"
        "        self.seen = sorted(p.name for p in TRUTH.rglob('*')) if TRUTH.exists() else []\n"
        "    def run(self, view, aux):\n        return [Skipped(view.me, 'weights', 1, 'seen ' + repr(self.seen))]\n")
    assert any((proj / "runs" / "tr" / "copy" / "truth").rglob("*"))
    p = subprocess.run([sys.executable, "-m", "fdg_audit", "attack", "runs/tr/copy", "--attacks",
                        "runs.evilns.mod:Evil", "--quiet"], cwd=proj, env=dict(CODE, FDG_AUDIT_SANDBOX="bwrap"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    (r,) = leakage_rows(proj / "runs" / "tr" / "copy", attack="evil", metric="skipped")
    assert r["status"] == "skipped: seen []", r["status"]


ALL = ("ok", "link", "fifo", "pickle", "victim", "memory", "hang")


# the hanging job's own call: any limit shows it stopped (it never returns), but its attack's control job, a fresh
# worker that does return, must end within it too (a forkserver child: well under a second; a bubblewrap sandbox
# starts an interpreter: about 3 s idle); 45 s, the limit of the other tries, would be waited out in full
HANG_S = dict(process=10, bwrap=20)


def _protocol(copy, sandbox: str, monkeypatch, capsys, hows=ALL):  # noqa: F811
    """Every try in ``hows`` but "hang" in one call within 45 s; "hang" in a second call within ``HANG_S``, its
    worker's self-description read beforehand within 45 s."""
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", sandbox)
    config = copy / "config.resolved.toml"
    plain = config.read_text()
    _settings(copy, attack_timeout=45, attack_memory_gb=1)
    capsys.readouterr()
    outside = copy / "summary.json"
    cfgs = {h: {"name": "hostile:Protocol", "label": f"p_{h}", "how": h, "target": str(outside), "mb": 1500}
            for h in hows}
    run_attacks(copy, [cfgs[h] for h in hows if h != "hang"], quiet=True)
    if "hang" in hows:
        check_attacks([cfgs["hang"]], dict(timeout=45.0, memory_gb=1.0))   # its describe job, as the others had
        config.write_text(plain)
        _settings(copy, attack_timeout=HANG_S[sandbox], attack_memory_gb=1)
        run_attacks(copy, [cfgs["hang"]], quiet=True)
    rows = {h: leakage_rows(copy, attack=f"p_{h}") for h in hows}
    if "ok" in hows:
        ok = rows["ok"]
        assert {r["metric"] for r in ok} >= {"auc"} and all(r["status"] == "ok" for r in ok), ok
    want = dict(link="other than a regular file", fifo="other than a regular file", pickle="not plain arrays and JSON",
                victim="is not a client of run", memory="MemoryError",
                hang=f"longer than attack_timeout = {HANG_S[sandbox]} s")
    want = {h: want[h] for h in hows if h != "ok"}
    for h, needle in want.items():
        assert [r["metric"] for r in rows[h]] == ["failed"], (h, rows[h])
        assert needle in rows[h][0]["status"] and "\n" not in rows[h][0]["status"], (h, rows[h][0]["status"])
    err = capsys.readouterr().err
    assert len([x for x in err.splitlines() if x.startswith("attack p_")]) == len(want) == len(err.splitlines()), err
    assert outside.read_text()[:20] not in (copy / "leakage.csv").read_text()
    return rows


def test_results_are_data_and_every_worker_ends(copy, monkeypatch, capsys):  # noqa: F811
    """Breaks 4, 5 (victim) and 7 (no limits): result.npz left as a link to a file outside the view, as a FIFO, or as
    a pickle; a victim that walks out of the folder; 1.5 GB under a 1 GB limit; a run that never returns. Each is its
    attack's one failed row; a plain attack beside them is scored."""
    _protocol(copy, "process", monkeypatch, capsys)


@needs_bwrap
def test_results_are_data_under_bubblewrap(copy, monkeypatch, capsys):  # noqa: F811
    """The same under bubblewrap (a fresh interpreter per worker: only a link out of the sandbox's view and a worker
    that never ends, whose whole sandbox is stopped; a pickle is refused by the same parent-side decoding in both
    modes, tried above). Its plain control attack is tried in plain processes above; a plain attack scored beside a
    hostile one under bubblewrap is tests/test_sandbox.py's dataset_size beside the forger."""
    _protocol(copy, "bwrap", monkeypatch, capsys, ("link", "hang"))


@pytest.mark.parametrize("junk,needle", [("targets", ".targets = 5: use a list of domain names"),
                                         ("seeds", ".seeds = ['x']: use a list of integer seeds")])
def test_a_self_description_the_harness_cannot_use_is_one_line(copy, junk, needle):  # noqa: F811
    """Break 5: ``Params.__post_init__`` set targets = 5 or seeds = ['x']: a TypeError/ValueError traceback."""
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        run_attacks(copy, [{"name": "hostile:BadParams", "junk": junk}], quiet=True)


@pytest.mark.parametrize("sandbox", ["process", pytest.param("bwrap", marks=needs_bwrap)])
def test_the_attack_cache_is_shared_read_only_and_checked(copy, monkeypatch, sandbox):  # noqa: F811
    """view.keep / view.cached: a second job of the attack reads what the first kept; neither can change the cache
    from inside; a key that walks out or an object array is that job's one failed row (checked by the harness as
    each job's result comes back, the same in both modes: tried with plain processes only)."""
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", sandbox)
    cache = copy / "attack_cache" / "hostile_keeper"
    run_attacks(copy, [{"name": "hostile:Keeper"}], quiet=True)
    first = _reason(copy, "hostile_keeper")
    assert first["cached"] is None
    stored = np.load(cache / "state.npz", allow_pickle=False)["x"]
    assert stored.tolist() == [0, 1, 2, 3]
    run_attacks(copy, [{"name": "hostile:Keeper"}], quiet=True)
    second = _reason(copy, "hostile_keeper")
    assert second["cached"] == [0, 1, 2, 3], second
    assert second["wrote"] is not True or sandbox == "process", second   # without bubblewrap: its own copy
    assert np.load(cache / "state.npz", allow_pickle=False)["x"].tolist() == [0, 1, 2, 3]
    bad = (("dotdot", "view.keep key '../../escape'"), ("object", "is not a float or integer array"))
    for how, needle in bad if sandbox == "process" else ():   # checked in the harness: once
        run_attacks(copy, [{"name": "hostile:Keeper", "how": how}], quiet=True)
        (r,) = leakage_rows(copy, attack="hostile_keeper")
        assert r["metric"] == "failed" and needle in r["status"], r
    assert sorted(p.name for p in (copy / "attack_cache").rglob("*")) == ["hostile_keeper", "state.npz"]


# ------------------------------------------------------------------------------------------ inputs (break 6, 7)

def test_a_leakage_csv_without_its_columns_is_one_line_before_any_work(copy, capsys, monkeypatch):  # noqa: F811
    (copy / "leakage.csv").write_text("a,b\n1,2\n")
    import fdg_audit.audit.harness as H
    monkeypatch.setattr(H, "load_runs", lambda root: pytest.fail("work started before the check"))
    one_line_error(capsys, ["attack", str(copy), "--attacks", "dataset_size"], "lacks the column(s) run, attack")


def test_names_and_labels_have_a_length_limit(copy, capsys):  # noqa: F811
    one_line_error(capsys, ["attack", str(copy), "--attacks", "x" * 300_000], "1 to 200 characters")


def test_deeply_nested_json_is_exit_code_2(copy, capsys):  # noqa: F811
    (copy / "attacks.json").write_text("[" * 100_000 + "]" * 100_000)
    err = one_line_error(capsys, ["report", str(copy)], "nests too deeply")
    assert len(err) < 300


# the shared tiny scenario on two domains of 20 images, two rounds, with no [[methods]] entries
SCEN = dict(name="s", threads=None, report=None, model=None, methods=None,
            data=dict(domains=["rot0", "rot15"], per_domain=20, targets=None), train=dict(rounds=2, batch_size=None))


@pytest.mark.parametrize("top,sets,needle", [
    ({}, ["datasets.0.client_sizes=[0,-5]"], "the scenario has no [[datasets]] entries to change (this scenario has "
                                             "a [data] table"),
    ({}, ["methods.fedavg.lr=0.1"], "the scenario has no [[methods]] entries"),
    (dict(store_rounds=[1, 3]), [], "store_rounds = [1, 3] names rounds beyond the last (2)"),
    (dict(attack_timeout=0), [], "attack_timeout = 0"),
    ({}, ["data.label=" + "a" * 100_000], "use 1 to 200 letters"),
])
def test_scenario_inputs_are_checked(tmp_path, capsys, top, sets, needle):
    f = tmp_path / "s.toml"
    f.write_text(tiny_scenario(SCEN, top))
    argv = ["scenario", str(f), "--out", str(tmp_path / "runs"), "--quiet"] + [x for s in sets for x in ("--set", s)]
    err = one_line_error(capsys, argv, needle)
    assert len(err) < 400 and not (tmp_path / "runs").exists()


def test_a_list_table_is_addressed_by_position_too(tmp_path):
    from fdg_audit.scenario import load_raw, parse
    f = tmp_path / "s.toml"
    data = tomllib.loads(tiny_scenario(SCEN))["data"]
    f.write_text(tiny_scenario(SCEN, data=None, datasets=[data]))
    sc = parse(load_raw(f, ["datasets.0.per_domain=30"]))
    assert sc.datasets[0].per_domain == 30


@pytest.mark.parametrize("sandbox", ["auto", "process"])
@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_sigint_at_any_moment_is_one_line(copy, tmp_path, delay, sandbox):  # noqa: F811
    """Break 6: Ctrl-C while workers start or finish printed a worker's FileNotFoundError traceback. The signal
    comes ``delay`` seconds after the first worker's view folder appears (warm sandboxes finish a tiny job fast).
    As plain processes (CI without bubblewrap), the signal also reached the forkserver while it imported torch (a
    traceback, or oneMKL's FATAL line) and a worker whose start it interrupted (its view already removed)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen([sys.executable, "-m", "fdg_audit", "attack", str(copy), "--attacks", "dataset_size",
                          "mia_loss", "--quiet"], env=dict(CODE, FDG_AUDIT_SANDBOX=sandbox, TMPDIR=str(tmp)),
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))   # as a shell starts it
                         # (a child inherits an ignored SIGINT, e.g. after an in-process Ctrl-C test of this worker)
    for _ in range(6000):
        if any(tmp.glob("fdg_view_*")) or p.poll() is not None:
            break
        time.sleep(0.01)
    time.sleep(delay)
    os.killpg(p.pid, signal.SIGINT)   # the terminal's Ctrl-C: the whole foreground process group
    err = p.communicate(timeout=300)[1]
    assert p.returncode == 2 and err.count("\n") == 1 and err.startswith("error: interrupted"), err


SERVER_AT_START = """
import os, signal, sys
from multiprocessing import forkserver
from fdg_audit.workers import worker_context
worker_context()
pid = forkserver._forkserver._forkserver_pid
while os.readlink(f"/proc/{pid}/exe").endswith("/env"):   # GNU env still starting: python not yet running
    pass
ignored = int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("SigIgn")).split()[1], 16)
print(bool(ignored >> (signal.SIGINT - 1) & 1))
"""


def test_the_worker_server_ignores_ctrl_c_from_its_first_instruction():
    """helper-15's flake: a Ctrl-C under load reached the forkserver while its interpreter still imported
    multiprocessing, before the first preload (fdg_audit.deaf) ignores it, and printed its traceback. The server now
    starts through ``env --ignore-signal=INT``: as soon as its python runs, SIGINT is already ignored (before, only
    seconds later, once the preload ran)."""
    from fdg_audit.workers import _deaf_env
    if not _deaf_env() or not Path("/proc/self/status").exists():
        pytest.skip("no GNU env with --ignore-signal, or no /proc: the preload alone guards the server")
    r = subprocess.run([sys.executable, "-c", SERVER_AT_START], env=CODE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stdout + r.stderr[-2000:]


def test_a_long_tmpdir_still_runs_process_workers(copy, tmp_path):  # noqa: F811
    """CI's break: under xdist, pytest's per-test TMPDIR was long enough that the forkserver's Unix socket path passed
    107 bytes ("OSError: AF_UNIX path too long", a traceback, no attack run)."""
    tmp = tmp_path / ("t" * 90)
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-m", "fdg_audit", "attack", str(copy), "--attacks", "dataset_size", "--quiet"],
                       env=dict(CODE, FDG_AUDIT_SANDBOX="process", TMPDIR=str(tmp)), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr[-2000:]
    assert not any(tmp.glob("fdg_view_*"))   # the view folders made under TMPDIR are gone again


def _stash_cleanup() -> None:
    """What the Stash plugin leaves on the host when it runs as a plain process."""
    import ctypes
    subprocess.run(["pkill", "-f", "fdg-stash-sleeper"], capture_output=True)
    for d in ("/tmp", "/dev/shm"):
        Path(d, "fdg_stash").unlink(missing_ok=True)
    libc = ctypes.CDLL(None)
    shm = libc.shmget(0x5a17, 0, 0)
    if shm >= 0:
        libc.shmctl(shm, 0, None)   # IPC_RMID
    ctypes.CDLL("librt.so.1").mq_unlink(b"/fdg_stash")


@pytest.mark.parametrize("sandbox", ["process", pytest.param("bwrap", marks=needs_bwrap)])
def test_a_job_leaves_nothing_to_the_next(copy, monkeypatch, sandbox):  # noqa: F811
    """Round 4, and a sandbox that serves several jobs (issue 48): the control leaves a file in /tmp, /dev/shm, its
    view folder, / and /dev (the sandbox's root and /dev tmpfs) and the view's cache/, a process that outlives it, a
    System V segment and a POSIX queue, and in the sandbox a user xattr and another mode on /tmp and an unreadable
    folder there; the runs, served by the control's sandbox (fewer sandboxes start than jobs run), find none of them,
    and cannot open their server's /proc/1/fd or memory or ptrace it. As plain processes it finds the host's /tmp and
    /dev/shm (the probe works) and nothing else: no process, segment or queue can be made."""
    import fdg_audit.audit.sandbox as sb
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", sandbox)
    started, new = [], sb.Sandbox.__init__
    monkeypatch.setattr(sb.Sandbox, "__init__", lambda self, *a: (started.append(1), new(self, *a))[1])
    places = ["/tmp", "/dev/shm", ".", "/", "/dev", "cache"] if sandbox == "bwrap" else ["/tmp", "/dev/shm", ".", "cache"]
    try:
        run_attacks(copy, [{"name": "hostile:Stash", "paths": places}], quiet=True)
        found = _reason(copy, "hostile_stash")
    finally:
        _stash_cleanup()
    assert found == (["server"] if sandbox == "bwrap" else ["/tmp", "/dev/shm"]), found
    assert len(started) == (1 if sandbox == "bwrap" else 0), started   # the control's sandbox served the run