"""The one multiprocessing context of every worker process of the core: training's parallel runs
(fdg_audit.train.runs) and the attack workers (fdg_audit.audit.sandbox)."""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.util
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache

from .errors import UserError

# a Unix socket's path has at most 107 bytes; the forkserver's is TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX
_SOCKET_DIR_MAX = 107 - len("/pymp-XXXXXXXX/listener-XXXXXXXX")


@lru_cache(maxsize=None)
def worker_context():
    """The multiprocessing context of every worker (attack workers, parallel runs): a process has one forkserver,
    and its preload is fixed when it first starts, so everything that starts workers takes this one. Helper
    processes (the forkserver, the resource tracker) start as ``python -c``, which would put the working directory
    first on their import path (a received folder's ``selectors.py`` would run): PYTHONSAFEPATH keeps it off."""
    os.environ["PYTHONSAFEPATH"] = "1"
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # the core only (after fdg_audit.deaf: no Ctrl-C from here on), never a plugin or the parent's data.
        # torch._dynamo too: torch imports it on the first
        # optimizer a process builds (seconds), which every worker that trains or optimises would pay again
        ctx.set_forkserver_preload(["fdg_audit.deaf", "fdg_audit.audit.harness", "torch._dynamo"])
        from multiprocessing import forkserver
        _short_socket_folder()
        spawn, env = multiprocessing.util.spawnv_passfds, _deaf_env()
        if env:   # the forkserver and the resource tracker start deaf to Ctrl-C (module doc of fdg_audit.deaf)
            multiprocessing.util.spawnv_passfds = lambda path, args, fds: spawn(os.fsencode(env[0]), [*env, *args], fds)
        try:
            forkserver.ensure_running()   # now: its imports overlap the caller's work before its first worker
        finally:
            multiprocessing.util.spawnv_passfds = spawn
        return ctx
    return mp.get_context("spawn")


def _short_socket_folder():
    """multiprocessing puts its sockets in a folder it makes under TMPDIR. Under a long TMPDIR (pytest's per-test
    folders under xdist, a deep home) binding the socket failed with a traceback ("AF_UNIX path too long"): that
    folder then goes to /tmp. The workers' view folders stay under TMPDIR."""
    long = tempfile.gettempdir()
    if len(long) <= _SOCKET_DIR_MAX:
        return
    before = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        multiprocessing.util.get_temp_dir()   # made once per process, then reused by every socket
    except OSError as e:
        raise UserError(f"TMPDIR ({long}) is too long for a worker socket and /tmp is not "
                        f"writable ({e.strerror}): set TMPDIR to a folder of at most {_SOCKET_DIR_MAX} characters")
    finally:
        tempfile.tempdir = before


def _deaf_env() -> list:
    """``env --ignore-signal=INT`` where GNU env has it (coreutils 8.31 on): a helper process started through it
    ignores Ctrl-C from its first instruction. The first preload (fdg_audit.deaf) comes only after the interpreter
    and multiprocessing are imported; a Ctrl-C under load in that window printed the server's traceback."""
    env = shutil.which("env")
    try:
        ok = env and subprocess.run([env, "--ignore-signal=INT", "true"], capture_output=True,
                                    timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return [env, "--ignore-signal=INT"] if ok else []
