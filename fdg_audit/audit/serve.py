"""A sandbox's entry point (``_serve``): it runs inside bubblewrap, imports the core (never a plugin) while it waits,
then runs exactly one job and ends, and the sandbox with it (fdg_audit/audit/sandbox.py, ``Sandbox``).
"""
from __future__ import annotations

import os
import signal

from .worker import _main



def _serve(folder: str, channel: int) -> None:
    """Import the core, then read the harness's one line "go <nonce>" from ``channel`` (a pipe the harness passed
    to this process only: bubblewrap's PID 1 closes it, so /proc/1/fd/* does not hold it), close it, and run the job
    of the view folder in this process (``_main``: limits first, no new process, the result carries the nonce).
    End of file without a line (the harness needed no job): exit at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import fdg_audit.audit.harness  # noqa: F401  (the core, as the forkserver preloads it: fdg_audit.workers)
    import torch._dynamo  # noqa: F401
    msg = b""
    while not msg.endswith(b"\n") and len(msg) < 256:
        chunk = os.read(channel, 256)
        if not chunk:
            os._exit(0)
        msg += chunk
    os.close(channel)
    go, _, nonce = msg.decode("ascii", "replace").strip().partition(" ")
    if go != "go" or not nonce:
        os._exit(1)
    _main(folder, nonce)
    os._exit(0)
