"""The one multiprocessing context of every worker process of the core: training's parallel runs
(fdg_audit.train.runs) and the attack workers (fdg_audit.audit.sandbox)."""
from __future__ import annotations

import multiprocessing as mp
import os
from functools import lru_cache


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
        forkserver.ensure_running()   # now: its imports overlap the caller's work before its first worker
        return ctx
    return mp.get_context("spawn")
