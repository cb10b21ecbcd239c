"""The warm sandbox's server (``_serve``): it runs inside bubblewrap, imports the core once (never a plugin) and
forks one attack worker per job (fdg_audit/audit/worker.py), leaving nothing of a job to the next.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .worker import _main

def _serve(folder: str) -> None:
    """Entry point of a warm sandbox: import the core once (never a plugin), then for each line on stdin fork one
    job (``_main`` on the view folder the harness has just written), wait for it, and before answering "done" leave
    nothing of it behind: every other process of the sandbox's PID namespace is killed, /tmp and /dev/shm are
    emptied, System V IPC objects are removed, and POSIX message queues cannot be created (RLIMIT_MSGQUEUE 0).
    The server is not dumpable, so a job cannot trace it; a job never sees stdin or stdout."""
    import resource   # Unix only, as bubblewrap is
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE = 0
    # the core, as the forkserver preloads it (fdg_audit.workers), once the server is hardened (above)
    import fdg_audit.audit.harness  # noqa: F401
    import torch._dynamo  # noqa: F401
    for _ in sys.stdin:
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            try:
                resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
                _main(folder)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        _sweep(os.path.realpath(folder))
        sys.stdout.write("done\n")
        sys.stdout.flush()



def _sweep(keep: str) -> None:
    """Kill every process of this PID namespace but bubblewrap's init and this one, then empty the shared places
    (all but the view folder ``keep``)."""
    me = os.getpid()
    for _ in range(200):
        live = []
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) not in (1, me):
                try:
                    if Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        live.append(int(d))
                except (OSError, IndexError):
                    pass
        if not live:
            break
        for q in live:
            try:
                os.kill(q, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)
    for d in ("/tmp", "/dev/shm"):
        _empty(d, keep)
    subprocess.run(["ipcrm", "--all"], capture_output=True, env={"PATH": "/usr/bin:/bin"})



def _empty(d: str, keep: str) -> None:
    """Remove everything in folder ``d`` but the path to ``keep`` (the view folder, which the harness empties)."""
    for e in os.listdir(d) if os.path.isdir(d) and not os.path.islink(d) else []:
        path = os.path.join(d, e)
        if path == keep:
            continue
        if keep.startswith(path + "/"):
            _empty(path, keep)
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
