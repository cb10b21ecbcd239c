"""The trust boundary, round 4 (issue 51): one job at a time per sandbox, a channel a job cannot impersonate, limits that hold
over the job's whole process tree and its shared memory, time limits in describe mode, and Ctrl-C while a worker
starts. Each test is one of the hostile tester's tries (tests/hostile/), as root with bubblewrap and, where the try
applies, as plain processes."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from fdg_audit.audit.harness import run_attacks
from fdg_audit.errors import UserError

from conftest import leakage_rows
from test_hostile import CODE, _reason, _settings, needs_bwrap
from test_trust import copy, root  # noqa: F401  (fixtures: a finished run folder and a copy)

MODES = ["process", pytest.param("bwrap", marks=needs_bwrap)]


@pytest.mark.parametrize("sandbox", MODES)
def test_a_job_cannot_answer_for_a_later_job(copy, monkeypatch, sandbox):  # noqa: F811
    """Try 1: the describe job answered itself through /proc/1/fd/1 (the warm sandbox's stdout), stayed alive and
    answered the attack's later jobs ("forged"). Now each job is a child its sandbox's server reaps before the next
    one starts, its go comes on a pipe only the server holds (not dumpable: /proc/1/fd is closed to a job), and the
    answer must carry the job's nonce: the run's row is the attack's own ("real")."""
    import fdg_audit.audit.checks as checks
    monkeypatch.setattr(checks, "_DESCRIBED", {})   # the forger acts in its describe job: no earlier one reused
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", sandbox)
    _settings(copy, attack_timeout=120)
    run_attacks(copy, [{"name": "hostile:Forger", "mb": 8}, {"name": "dataset_size"}], quiet=True)
    (r,) = leakage_rows(copy, attack="hostile_forger", metric="skipped")
    assert r["status"] == "skipped: real", r
    rows = leakage_rows(copy, attack="dataset_size")
    assert rows and all(r["status"] == "ok" for r in rows), rows


HOGS = {"process": ("mmap", "children"), "bwrap": ("mmap", "shm", "tmp", "children")}


@pytest.mark.parametrize("sandbox", MODES)
def test_the_memory_limit_holds_over_shared_memory_and_children(copy, monkeypatch, sandbox):  # noqa: F811
    """Try 2, as the tester ran it: with attack_memory_gb = 1.0 a plugin held 2,500 MB through a MAP_SHARED mapping,
    a file in /dev/shm or /tmp, or three children (RLIMIT_DATA counted none). Now it holds at most the documented
    1.5 x the limit (address space plus a quarter each for /tmp and /dev/shm), and makes no child. (A smaller limit
    would not reproduce the try on 3cee758: its RLIMIT_DATA counted the worker's start, which alone is near 0.25 GB.)
    Every way in one call, each its own attack (label) and so its own sandboxes."""
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", sandbox)
    _settings(copy, attack_memory_gb=1.0, attack_timeout=300)
    run_attacks(copy, [{"name": "hostile:Hog", "label": f"hog_{how}", "how": how, "mb": 2500}
                       for how in HOGS[sandbox]], quiet=True)
    for how in HOGS[sandbox]:
        got = _reason(copy, f"hog_{how}")
        assert got["held"] <= 1.5 * 1024, (how, got)
        if how == "children":
            assert got == {"held": 0, "why": "PermissionError"}, got


@pytest.mark.parametrize("sandbox", MODES)
def test_a_describe_job_ends_at_attack_timeout(copy, monkeypatch, sandbox):  # noqa: F811
    """Try 6: a constructor that sleeps forever; the describe job ends at the folder's attack_timeout with one
    line."""
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", sandbox)
    _settings(copy, attack_timeout=5)
    with pytest.raises(UserError, match="longer than attack_timeout = 5 s"):
        run_attacks(copy, [{"name": "hostile:Sleeper"}], quiet=True)


def _idle():
    time.sleep(60)


def test_stopping_a_worker_that_never_started_is_quiet():
    """Try 7 (the loaded suite's traceback): Ctrl-C inside ``Process.start`` left ``_kill`` a Process whose
    ``_popen`` is None; ``kill()`` raised AttributeError. Now there is nothing to stop and nothing raised."""
    from fdg_audit.audit.sandbox import _kill
    p = multiprocessing.get_context("spawn").Process(target=_idle)
    _kill(p)   # not started
    assert p.pid is None


@pytest.mark.parametrize("delay", [0.5, 2.0])   # the failing delays; 1.0 and 3.0 took the same path
def test_ctrl_c_after_the_last_job_is_one_line_or_a_clean_exit(copy, tmp_path, delay):  # noqa: F811
    """Try 7: a Ctrl-C two seconds after the last job killed the process silently (exit -2). Whenever it comes
    after the command's output, the process exits 0 with no error or 2 with the one line, never by the signal."""
    p = subprocess.Popen([sys.executable, "-m", "fdg_audit", "attack", str(copy), "--attacks", "dataset_size",
                          "--quiet"], env=dict(CODE, FDG_AUDIT_SANDBOX="auto"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = p.stdout.readline()   # "leakage: ..." : the last job is done
    time.sleep(delay)
    try:
        os.killpg(p.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    out, err = p.communicate(timeout=300)
    assert line.startswith("leakage: "), line + err
    assert p.returncode == 0 and err == "" or p.returncode == 2 and err.count("\n") == 1 and \
        err.startswith("error: interrupted"), (p.returncode, err)


@needs_bwrap
def test_ctrl_c_inside_popen_stops_the_sandbox_before_its_folder_goes(copy, monkeypatch, capfd, tmp_path):  # noqa: F811
    """Issue 51 (the loaded fresh-clone suite): a Ctrl-C that lands inside ``Popen``, after bubblewrap is forked,
    made the clean-up remove the sandbox's view folder while bubblewrap was still starting and no one held its pid;
    bubblewrap printed "Can't find source path" on the user's terminal. The signal here comes at that moment, in the
    first sandbox (it would serve every job of the attack): it is held until the sandbox is registered, so the
    bubblewrap is stopped and reaped before its folder goes, no view folder or sandbox is left, and bubblewrap's
    stderr is a private file, not the terminal."""
    import tempfile

    import fdg_audit.audit.checks as checks
    import fdg_audit.audit.sandbox as sandbox
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", "bwrap")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(checks, "_DESCRIBED", {})   # a describe job whatever ran before in this process
    old = signal.signal(signal.SIGINT, signal.default_int_handler)   # as in the CLI (a pytest-xdist worker ignores it)
    started = []

    class Popen(subprocess.Popen):
        def __init__(self, argv, *a, **k):
            super().__init__(argv, *a, **k)
            if "--new-session" in argv:
                started.append(self)
                if len(started) == 1:   # the user's Ctrl-C arrives right now
                    os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(sandbox.subprocess, "Popen", Popen)
    capfd.readouterr()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_attacks(copy, [{"name": "dataset_size"}], quiet=True)
    finally:
        signal.signal(signal.SIGINT, old)
    assert len(started) == 1 and all(p.returncode is not None for p in started), started   # stopped and reaped
    assert not sandbox._LIVE and not sandbox._IDLE and not list(tmp_path.glob("fdg_view_*"))
    assert "bwrap" not in capfd.readouterr().err
