"""Attack jobs in worker processes that see nothing but their view folder.

Isolation (the default of the harness, ``run_isolated``): the parent writes a *view folder* for one attack on one
run: ``view.json`` (protocol: method, params, model, shape, clients; who the adversary is; the attack and its
parameters), ``messages.jsonl`` (the adversary's envelopes only, without the hash-chain field), ``payloads/`` (only
those envelopes' payload bytes, each checked against its envelope's sha256 on the way), ``aux.npz`` (only the
declared aux data) and ``cache/`` (what earlier jobs of the same attack kept, ``AdversaryView.keep``; read-only). The
attack runs in a fresh process whose only input is that folder: multiprocessing's "forkserver" starts a clean server
once (torch and the core imported, no copy of the parent's memory) and forks one worker per job; where forkserver is
missing (Windows), "spawn". The worker is told neither the run folder nor its path.

OS sandbox (``FDG_AUDIT_SANDBOX``, default "auto"): where bubblewrap (``bwrap``, Debian's ``bubblewrap``) is
installed and works, each worker starts under it instead (``bwrap_argv``): new user (where the kernel allows), PID,
network, IPC and UTS namespaces (no network, its own /proc, so no /proc/<harness>), every capability dropped (so a
worker of a harness running as root cannot remount its read-only binds), bwrap itself started with only the
allow-listed environment (``ENV_ALLOW``: /proc/1/environ holds nothing of the harness), an empty /tmp, and a file
system that holds only the system directories, the Python installation and environment (read-only), the source
files of fdg_audit, of the installed plugins (shadow training runs methods) and of a plugin named by "module:Class"
(read-only), and its own view folder (read-write, for ``result.npz``). No bound source is the working directory or
a folder that holds it or the run folder being attacked (``PROTECT``): a plugin shipped as a namespace package named
like a folder of the project finds nothing. The run folder, its ``truth/``, other views and the rest of the user's
files do not exist there, /tmp and /dev/shm are private tmpfs mounts of a quarter of ``attack_memory_gb`` each, and
the root and /dev are read-only. A sandbox serves one job at a time (``Sandbox``): its server, PID 1, imports the
core once, never a plugin, and forks a fresh child per job, so a job pays no interpreter start-up; the job's "go"
comes on a pipe only the server holds (the server is not dumpable: /proc/1/fd is closed to a job), the result must
carry the job's nonce (tests/test_hostile.py: a job that answers for another, or leaves anything to the next,
reaches nothing), and between jobs the server restores /tmp and /dev/shm and the harness empties the view folder
(fdg_audit/audit/serve.py lists what else keeps jobs apart). Every job
runs confined (fdg_audit/audit/confine.py: memory as address space, no new process, file sizes), in either mode.
"process" (or "auto" without bubblewrap) keeps the forkserver worker: an ordinary process of the same user, so code
that searches the file system on its own (outside the API) could still open files that user can read or write
(each file it writes at most 2 GB, any number, counted by no memory limit); there the boundary is the API and the process, not an OS
sandbox. "bwrap" insists. ``isolate=False`` (``attack
--in-process``) runs the attack inside the harness for debugging: there the view's messages hold the whole ledger and
the process holds the truth, so nothing is enforced. View folders are created private to the user (0700) and removed
on every exit path of the harness, after their worker is stopped.

The pieces: what crosses the boundary (``transport``), the bubblewrap command (``bwrap``), the worker
(``worker``), its limits (``confine``) and the sandbox's entry point (``serve``); this module runs jobs and stops them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..attack import Aux
from ..errors import UserError
from ..plugins import import_path
from ..store.ledger import Ledger, atomic_write
from ..store.safe import entries, read_in
from ..workers import worker_context
from .bwrap import bwrap_argv, clean_env, sandbox_mode
from .transport import MAX_KEPT, AttackFailed, decode, encode, read_result
from .tidy import Tree
from .worker import LIMITS, _worker

def materialise(folder: Path, ledger: Ledger, envs: list) -> None:
    """Write ``envs`` (without their chain field) and the payloads they carry into the view folder ``folder``;
    ``ledger.raw`` refuses a missing or altered payload with a one-line error."""
    lines = []
    for e in envs:
        if e.stored:
            p = folder / "payloads" / e.sha256[:2] / e.sha256
            if not p.exists():
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(ledger.raw(e))
        lines.append(dataclasses.replace(e, prev="").to_json() + "\n")
    (folder / "messages.jsonl").write_text("".join(lines))



_LIVE = set()   # attack processes running now (several when attacks run in parallel), for stop_workers

_LOCK = threading.Lock()

_STOP = threading.Event()   # set by stop_workers: no worker starts until allow_workers



@contextlib.contextmanager
def _ctrl_c_after():
    """Hold a Ctrl-C (SIGINT in the main thread) until the block ends, then raise it: a worker is started and
    registered in ``_LIVE`` whole, so the clean-up never removes the view folder of a process it cannot see (a Ctrl-C
    inside ``Popen`` left bubblewrap starting on a removed folder). Other threads get no KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    old = signal.signal(signal.SIGINT, lambda *a: held.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if held and callable(old):
        old(*held[0])
    elif held and old == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)



def _kill(p) -> None:
    """Stop worker ``p`` (a bubblewrap Popen or a forkserver Process) and everything in its session (bubblewrap's
    PID namespace ends with it; a forkserver worker leads its own session and can start no process). A Process that
    never got a pid (Ctrl-C inside its ``start``) has nothing to stop."""
    if getattr(p, "pid", None) is None:
        return
    try:
        if not isinstance(p, subprocess.Popen) or p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        p.kill()
        p.wait() if isinstance(p, subprocess.Popen) else p.join()
    except (OSError, ValueError, AssertionError, AttributeError):
        pass



def stop_workers() -> None:
    """Stop every attack process still running (after an error or Ctrl-C in the harness), and start none until
    ``allow_workers``; their results are dropped, as an interrupted attack's are."""
    _STOP.set()
    with _LOCK:
        live = list(_LIVE)
    for p in live:
        _kill(p)
    close_warm()



def allow_workers() -> None:
    _STOP.clear()



def run_isolated(spec: dict, types: dict, ledger: Ledger | None = None, envs: list = (), aux: Aux | None = None,
                 cache: Path | None = None):
    """Run one attack job in a worker process whose only input is a fresh view folder; return its result.

    ``spec``: attack (registered name or module:Class), label, params, device, mode ("run" | "control" |
    "describe"), optionally timeout (s) and memory_gb (``LIMITS``) and, for "run", run (protocol fields), adversary,
    me. ``types``: the output classes the parent accepts back. ``cache``: the attack's cache folder, read-only in
    the view as ``cache/``. Under bubblewrap the job runs in a sandbox of its own (``Sandbox``)."""
    spec = dict(spec, timeout=float(spec.get("timeout") or LIMITS["timeout"]),
                memory_gb=float(spec.get("memory_gb") or LIMITS["memory_gb"]))
    cache = cache if cache is not None and Path(cache).name in entries(Path(cache).parents[1], Path(cache).parent.name,
                                                                       folders=True) else None   # a real folder
    paths = dict(attack=import_path(spec["attack"]), method=import_path(spec.get("run", {}).get("plugin", "")))
    nonce = secrets.token_hex(16)
    if sandbox_mode() == "bwrap":
        data = _run_sandbox(spec, paths, ledger, envs, aux, cache, nonce)
    else:
        data = _run_once(spec, paths, ledger, envs, aux, cache, nonce)
    try:
        res = decode(data, types)
    except AttackFailed:
        raise
    except TypeError as e:
        raise AttackFailed(str(e)) from None
    if not isinstance(res, dict):
        raise AttackFailed("the attack's result is not a mapping")
    if res.pop("nonce", None) != nonce:
        raise AttackFailed("the attack's result is not the answer to this job (its nonce differs)")
    if "user_error" in res:
        raise UserError(str(res["user_error"])[:2000])
    if "error" in res:
        raise AttackFailed(str(res["error"])[:2000], str(res.get("traceback", ""))[:100_000])
    return res



def _write_view(folder: Path, spec: dict, paths: dict, ledger, envs, aux, cache: Path | None) -> None:
    """The view folder of one job: its envelopes and payloads, aux, a copy of the cache (where no read-only bind
    holds it), view.json and paths.json."""
    if spec["mode"] == "run":
        materialise(folder, ledger, list(envs))
        (folder / "aux.npz").write_bytes(encode(aux))
    if cache is not None:   # its regular files, each read as data (no link, no FIFO)
        for name in entries(cache.parents[1], cache.relative_to(cache.parents[1])):
            atomic_write(folder / "cache" / name, read_in(cache.parents[1], cache / name, MAX_KEPT) or b"")
    threads = spec.get("threads") or torch.get_num_threads()
    atomic_write(folder / "view.json", json.dumps(dict(spec, threads=threads), default=str))
    atomic_write(folder / "paths.json", json.dumps(paths))



def _no_result(code, stderr: str = "") -> AttackFailed:
    return AttackFailed(f"the attack process exited with code {code} and no result"
                        + (" (killed: over attack_memory_gb?)" if code in (-9, 137) else "")
                        + (f"; its stderr ended: {stderr}" if stderr else ""))



def _timed_out(timeout: float) -> AttackFailed:
    return AttackFailed(f"the attack process ran longer than attack_timeout = {timeout:g} s and was stopped")



def _run_once(spec: dict, paths: dict, ledger, envs, aux, cache, nonce: str) -> bytes:
    """One job in a forkserver worker of its own (no OS sandbox); the result's bytes."""
    folder = Path(tempfile.mkdtemp(prefix="fdg_view_"))
    p = None
    try:
        _write_view(folder, spec, paths, ledger, envs, aux, cache)
        with _LOCK:
            if _STOP.is_set():
                raise AttackFailed("stopped before it started (the harness is stopping)")
            p = worker_context().Process(target=_worker, args=(str(folder), paths, nonce), daemon=True)
            with _ctrl_c_after():
                p.start()
                _LIVE.add(p)
        p.join(spec["timeout"])
        if p.exitcode is None:
            raise _timed_out(spec["timeout"])
        data = read_result(folder)
        if data is None:
            raise _no_result(p.exitcode)
        return data
    finally:
        if p is not None:
            _kill(p)
            with _LOCK:
                _LIVE.discard(p)
        shutil.rmtree(folder, ignore_errors=True)



class Sandbox:
    """One bubblewrap sandbox (``bwrap_argv``, PID 1 ``serve._serve``), serving one job at a time: started when a job
    needs it (its server imports the core meanwhile, never a plugin), given each job through a pipe only its server
    holds ("go <nonce>"), answered on another ("done <exit code> <clean>"). Each job is a fresh child of the server;
    between jobs the server restores /tmp and /dev/shm and the harness empties and resets the view folder
    (``reset``), so nothing a job writes reaches the next one (fdg_audit/audit/serve.py says how). A sandbox that
    cannot be shown clean, or whose job failed or ran out of time, is ended."""

    def __init__(self, spec: dict, paths: dict, cache: Path | None):
        self.folder = Path(tempfile.mkdtemp(prefix="fdg_view_"))
        self.cache = cache is not None
        if self.cache:
            (self.folder / "cache").mkdir()   # the mount point of the read-only bind
        self.tree = Tree(str(self.folder))
        r, self.w = os.pipe()
        self.r, w = os.pipe()
        self.err = tempfile.TemporaryFile()   # bubblewrap's and the jobs' stderr: shown only when a job fails
        self.clean = False
        try:
            self.p = subprocess.Popen(bwrap_argv(self.folder, spec, paths, cache, r, w), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=self.err, env=clean_env(),
                                      start_new_session=True, pass_fds=(r, w))
        except BaseException:
            for fd in (self.w, self.r):
                os.close(fd)
            self.w = self.r = None
            self.err.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        finally:
            os.close(r)
            os.close(w)

    def run(self, spec: dict, paths: dict, ledger, envs, aux, nonce: str) -> bytes:
        _write_view(self.folder, spec, paths, ledger, envs, aux, None)
        self.clean, mark = False, self.err.seek(0, os.SEEK_END)
        try:
            os.write(self.w, f"go {nonce}\n".encode())
        except OSError:   # the sandbox is gone
            pass
        answer, code = self._answer(spec["timeout"]), None
        if answer is None:   # the server ended without an answer (killed: memory, or it could not start)
            try:
                code = self.p.wait(spec["timeout"])
            except subprocess.TimeoutExpired:
                raise _timed_out(spec["timeout"]) from None
        else:
            code, self.clean = answer
        data = read_result(self.folder)
        if data is None:
            self.clean = False
            self.err.seek(mark)
            tail = self.err.read()[-1000:].decode(errors="replace").strip()
            raise _no_result(code, tail)
        return data

    def _answer(self, timeout: float) -> tuple | None:
        """The server's "done <code> <clean>" for the job just sent: (exit code, clean); None at end of file."""
        import select
        end, buf = time.monotonic() + timeout, b""
        while b"\n" not in buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise _timed_out(timeout)
            chunk = os.read(self.r, 64)
            if not chunk or len(buf) > 64:
                return None
            buf += chunk
        word, code, clean = (buf.split(b"\n")[0].decode("ascii", "replace").split() + ["", "", ""])[:3]
        if word != "done" or not code.lstrip("-").isdigit():
            return None
        return int(code), clean == "1" and code == "0"

    def reset(self) -> bool:
        """Empty the view folder for the next job (its cache/ mount point stays, empty) and reset its mode, times and
        user xattrs (``tidy.Tree``); True when it is as new."""
        return self.tree.restore()

    def close(self) -> None:
        _kill(self.p)
        self.err.close()
        for fd in (self.w, self.r):
            if fd is not None:
                os.close(fd)
        self.w = self.r = None
        shutil.rmtree(self.folder, ignore_errors=True)



_IDLE: dict = {}   # binds of a sandbox -> sandboxes waiting for the next job with those binds (one key at a time)



def _key(spec: dict, cache) -> tuple:
    """The binds of a job's sandbox: a plugin named by path, the attack's cache, the device and memory limit."""
    method, attack = spec.get("run", {}).get("plugin", ""), spec["attack"]
    return (attack if ":" in attack else "", method if ":" in method else "", spec.get("device", "cpu"), str(cache),
            spec["memory_gb"])



def _take(spec: dict, paths: dict, cache) -> Sandbox:
    """A sandbox for this job: one waiting with the same binds, else a new one; sandboxes waiting with other binds
    are ended, so that at most one set waits."""
    key = _key(spec, cache)
    with _LOCK:
        if _STOP.is_set():
            raise AttackFailed("stopped before it started (the harness is stopping)")
        others = [b for k in list(_IDLE) if k != key for b in _IDLE.pop(k)]
        box = _IDLE[key].pop() if _IDLE.get(key) else Sandbox(spec, paths, cache)
        _LIVE.add(box.p)
        for b in others:
            _LIVE.discard(b.p)
    for b in others:
        b.close()
    return box



def _run_sandbox(spec: dict, paths: dict, ledger, envs, aux, cache, nonce: str) -> bytes:
    box, again = None, False
    try:
        with _ctrl_c_after():   # a Ctrl-C while bubblewrap starts comes once ``box`` can be stopped
            box = _take(spec, paths, cache)
        data = box.run(spec, paths, ledger, envs, aux, nonce)
        again = box.clean and box.reset()
        return data
    finally:
        if box is not None:
            with _LOCK:
                if again and not _STOP.is_set():
                    _IDLE.setdefault(_key(spec, cache), []).append(box)
                    box = None
                else:
                    _LIVE.discard(box.p)
            if box is not None:
                box.close()



def close_warm() -> None:
    """End every sandbox started ahead (when the harness is done or stops)."""
    with _LOCK:
        boxes = [b for v in _IDLE.values() for b in v]
        _IDLE.clear()
        for b in boxes:
            _LIVE.discard(b.p)
    for b in boxes:
        b.close()
