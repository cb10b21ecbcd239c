"""A sandbox's entry point (``_serve``): PID 1 of its bubblewrap sandbox. It imports the core (never a plugin) while
it waits, then forks one child per job the harness sends, and cleans up after each (fdg_audit/audit/sandbox.py,
``Sandbox``).

What keeps one job from reaching the next one served by the same sandbox:
- the server is not dumpable (``PR_SET_DUMPABLE`` 0): a job cannot ptrace it, read its memory or open its
  /proc/1/fd (the pipes); as PID 1 of its namespace it ignores every signal a job can send; the job's seccomp filter
  refuses ptrace and process_vm_* anyway (fdg_audit/audit/confine.py);
- a job makes no process (seccomp), so nothing of it is left once the server has reaped it;
- kernel objects that outlive a process in the sandbox's namespaces are refused to the job: System V segments,
  queues and semaphores, memfd, POSIX queues (RLIMIT_MSGQUEUE 0) and keys (seccomp, confine.py);
- the writable places are the view folder (the harness empties it and resets it after each job, sandbox.py) and
  the private /tmp and /dev/shm: after each job the server removes everything the job added there and resets what
  was there before (mode, times, user xattrs), and checks that both are as they were when it started (``Tree``).
  Where they are not, it says so and ends: the sandbox serves no further job.
"""
from __future__ import annotations

import ctypes
import os
import signal

from .tidy import Tree
from .worker import _main

PLACES = ("/tmp", "/dev/shm")   # the sandbox's writable tmpfs mounts



def _lines(fd: int):
    """The harness's lines "go <nonce>" on ``fd``, one at a time; ends at end of file or a malformed line."""
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(fd, 256)
            if not chunk or len(buf) > 256:
                return
            buf += chunk
        line, _, buf = buf.partition(b"\n")
        go, _, nonce = line.decode("ascii", "replace").strip().partition(" ")
        if go != "go" or not nonce:
            return
        yield nonce


def _serve(folder: str, channel: int, reply: int) -> None:
    """Import the core, make this process undumpable, then for each line "go <nonce>" on ``channel`` (a pipe only
    this process holds) fork a child that runs the job of the view folder (``_main``: limits first, no new process,
    the result carries the nonce), reap it, clean /tmp and /dev/shm, and answer "done <exit code> <1 if clean>" on
    ``reply``. End of file on ``channel``: exit. An unclean sandbox exits after its answer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import fdg_audit.audit.harness  # noqa: F401  (the core, as the forkserver preloads it: fdg_audit.workers)
    import torch._dynamo  # noqa: F401
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:   # PR_SET_DUMPABLE 0
        os._exit(1)
    trees = [Tree(p) for p in PLACES if os.path.isdir(p)]
    for nonce in _lines(channel):
        pid = os.fork()
        if pid == 0:   # the job: it holds neither pipe
            code = 1
            try:
                os.close(channel)
                os.close(reply)
                _main(folder, nonce)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        clean = all(t.restore() for t in trees)
        os.write(reply, f"done {os.waitstatus_to_exitcode(status)} {int(clean)}\n".encode())
        if not clean:
            break
    os._exit(0)
