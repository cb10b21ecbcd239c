"""Adversary views, and the attack worker process that sees nothing else.

``AdversaryView`` is what one adversary observed in one run: the envelopes it sent or received (every envelope
for an eavesdropper), their payloads, and the run's public protocol (Kerckhoffs). ``Aux`` is the auxiliary data
an attack declared.

Isolation (the default of the harness, ``run_isolated``): the parent writes a *view folder* for one attack on one
run: ``view.json`` (protocol: method, params, model, shape, clients; who the adversary is; the attack and its
parameters), ``messages.jsonl`` (the adversary's envelopes only, without the hash-chain field), ``payloads/`` (only
those envelopes' payload bytes, each checked against its envelope's sha256 on the way), ``aux.npz`` (only the
declared aux data) and ``cache/`` (what earlier jobs of the same attack kept, ``AdversaryView.keep``; read-only). The
attack runs in a fresh process whose only input is that folder: multiprocessing's "forkserver" starts a clean server
once (torch and the core imported, no copy of the parent's memory) and forks one worker per job; where forkserver is
missing (Windows), "spawn". The worker is told neither the run folder nor its path.

Results are data (``read_result``): the worker writes one ``result.npz``: plain numeric or string arrays and one JSON
document (``meta``) that refers to them; the harness opens it only as a regular file of the view folder (no link,
no FIFO, at most ``MAX_RESULT`` bytes), loads it without pickle, and the harness then checks every field
(fdg_audit.harness). Anything else is that attack's one-line failure. Every worker ends: it runs under a memory limit
(``attack_memory_gb``, the process's data size) and is killed with everything it started after ``attack_timeout``
seconds (the scenario's settings; ``LIMITS`` holds the defaults).

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
files do not exist there. Warm sandboxes (``WarmSandbox``): jobs share a sandbox (one per set of binds: a plugin
named by path, an attack's cache) whose server imported the core once (never a plugin) and forks each job from it,
so a job pays no interpreter start-up; the view
folder is rewritten per job and emptied after it, and before the next job the server kills every other process of
the sandbox, empties /tmp and /dev/shm and removes System V IPC objects, while POSIX message queues cannot be made
(tests/test_hostile.py: what one job leaves, the next does not find); the sandbox ends with the harness's attacks, or
when a job runs over its time (bench/attack_isolation.py measures the start-up).
"process" (or "auto" without bubblewrap) keeps the forkserver worker: an ordinary process of the same user, so code
that searches the file system on its own (outside the API) could still open files that user can read; there the
boundary is the API and the process, not an OS sandbox. "bwrap" insists. ``isolate=False`` (``attack
--in-process``) runs the attack inside the harness for debugging: there the view's messages hold the whole ledger and
the process holds the truth, so nothing is enforced. View folders are created private to the user (0700) and removed
on every exit path of the harness, after their worker is stopped.
"""
from __future__ import annotations

import dataclasses
import io
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import traceback
import zipfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from .api.attack import AdversaryView, Aux
from .data import Split
from .errors import UserError
from .ledger import Ledger, atomic_write
from .models import ModelConfig
from .params import typed
from .plugins import import_path

MAX_RESULT = 2 ** 31          # bytes of a worker's result.npz (and of its arrays unpacked)
MAX_KEPT = 2 ** 30            # bytes one job may keep in the attack cache
CACHE_KEY = re.compile(r"[A-Za-z0-9_.-]{1,100}")
LIMITS = dict(timeout=3600.0, memory_gb=8.0)   # defaults of the scenario's attack_timeout, attack_memory_gb
PROTECT: set = set()          # folders no bubblewrap bind may be or hold (the run folders being attacked)


# ------------------------------------------------------------------------------------------- plain-data transport

def pack(v, arrays: list):
    """Tensors, arrays, dataclasses, dicts, lists and scalars as JSON whose arrays are appended to ``arrays``
    (numeric or string arrays; object arrays travel as lists)."""
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        v = (v.float() if v.dtype == torch.bfloat16 else v).numpy()
    if isinstance(v, np.ndarray):
        if v.dtype.kind in "biufU":
            arrays.append(np.ascontiguousarray(v))
            return {"__a__": len(arrays) - 1}
        return pack(v.tolist(), arrays)
    if isinstance(v, np.generic):
        return v.item()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"__dc__": type(v).__name__,
                "f": {f.name: pack(getattr(v, f.name), arrays) for f in dataclasses.fields(v)}}
    if isinstance(v, dict):
        return {str(k): pack(x, arrays) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [pack(x, arrays) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    raise TypeError(f"{type(v).__name__} cannot leave the attack process: return tensors, arrays, numbers or strings")


def unpack(v, arrays: list, types: dict):
    """``pack``'s JSON back to values: dataclasses only of ``types``, with their own fields (TypeError otherwise)."""
    if isinstance(v, dict):
        if "__a__" in v:
            i = v["__a__"]
            if not (type(i) is int and 0 <= i < len(arrays)):
                raise TypeError(f"the result refers to array {i!r}, which it does not hold")
            return arrays[i]
        if "__dc__" in v:
            cls, f = types.get(v["__dc__"]), v.get("f")
            if cls is None:
                raise TypeError(f"attack returned {str(v['__dc__'])[:80]}; return one of {', '.join(types)}")
            names = {x.name for x in dataclasses.fields(cls)}
            if not isinstance(f, dict) or set(f) - names:
                raise TypeError(f"attack returned a {cls.__name__} with fields {sorted(f or {})[:8]}: use "
                                f"{', '.join(sorted(names))}")
            return cls(**{k: unpack(x, arrays, types) for k, x in f.items()})
        return {k: unpack(x, arrays, types) for k, x in v.items()}
    if isinstance(v, list):
        return [unpack(x, arrays, types) for x in v]
    return v


def encode(res) -> bytes:
    """A worker's result as one .npz: the arrays ``a0``, ``a1``, ... and ``meta`` (the JSON, UTF-8 bytes)."""
    arrays = []
    meta = json.dumps(pack(res, arrays)).encode()
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(meta, np.uint8), **{f"a{i}": a for i, a in enumerate(arrays)})
    return buf.getvalue()


def decode(data: bytes, types: dict, what: str = "the attack's result"):
    """``encode``'s bytes back to values, as data from plugin code: no pickle, no more than ``MAX_RESULT`` bytes
    unpacked; anything else is an ``AttackFailed`` naming ``what``."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            if sum(i.file_size for i in z.infolist()) > MAX_RESULT:
                raise AttackFailed(f"{what} unpacks to more than {MAX_RESULT >> 20} MB")
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("meta").tobytes().decode())
        arrays = [arrays.pop(f"a{i}") for i in range(len(arrays))]
        return unpack(meta, arrays, types)
    except AttackFailed:
        raise
    except Exception as e:  # noqa: BLE001  (damaged zip, object arrays, bad JSON, nesting, missing arrays)
        raise AttackFailed(f"{what} is not plain arrays and JSON ({type(e).__name__}: {str(e)[:200]})") from None


def read_result(folder: Path, name: str = "result.npz") -> bytes | None:
    """The bytes of ``folder/name`` if it is a regular file there (not a link, FIFO or device, not through a
    linked folder) of at most ``MAX_RESULT`` bytes; None if absent; else ``AttackFailed``."""
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        finally:
            os.close(dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise AttackFailed(f"the attack left {name} as something other than a regular file ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise AttackFailed(f"the attack left {name} as something other than a regular file")
        data = f.read(MAX_RESULT + 1)
    if len(data) > MAX_RESULT:
        raise AttackFailed(f"the attack's {name} is larger than {MAX_RESULT >> 20} MB")
    return data


def _split(s):
    return s if s is None else Split(torch.as_tensor(s.x), torch.as_tensor(s.y), np.asarray(s.idx))


# ------------------------------------------------------------------------------------------- the attack cache

def check_kept(kept) -> dict:
    """What a job asked to keep (``AdversaryView.keep``), checked as data: {key: {name: int/float array}}, keys of
    ``CACHE_KEY``, at most ``MAX_KEPT`` bytes in all; else ``AttackFailed`` in one line."""
    if not isinstance(kept, dict):
        raise AttackFailed("the attack's kept arrays are not a {key: {name: array}} mapping")
    total = 0
    for key, arrays in kept.items():
        if not isinstance(key, str) or not CACHE_KEY.fullmatch(key) or set(key) == {"."}:
            raise AttackFailed(f"view.keep key {str(key)[:100]!r}: use 1 to 100 of A-Z a-z 0-9 _ . - (not only dots)")
        if not isinstance(arrays, dict) or not arrays:
            raise AttackFailed(f"view.keep({key!r}, ...): give a non-empty dict of arrays")
        for n, a in arrays.items():
            if not (isinstance(n, str) and CACHE_KEY.fullmatch(n) and isinstance(a, np.ndarray)
                    and a.dtype.kind in "biuf"):
                raise AttackFailed(f"view.keep({key!r}, ...): {str(n)[:100]!r} is not a float or integer array under "
                                   "a name of A-Z a-z 0-9 _ . -")
            total += a.nbytes
    if total > MAX_KEPT:
        raise AttackFailed(f"view.keep: {total >> 20} MB kept by one job; the limit is {MAX_KEPT >> 20} MB")
    return kept


def store_kept(cache_dir: Path, kept) -> None:
    """Write what a job kept (checked) atomically to ``cache_dir/<key>.npz``, on the attacker's side of the run
    folder (never beside truth/)."""
    for key, arrays in check_kept(kept).items():
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write(Path(cache_dir) / f"{key}.npz", buf.getvalue())


# ------------------------------------------------------------------------------------------- the worker

class AttackFailed(Exception):
    """The attack raised (or its process died) in the worker; ``detail`` holds the worker's traceback."""

    def __init__(self, msg: str, detail: str = ""):
        super().__init__(msg)
        self.detail = detail


def portrait(atk) -> dict:
    """What the metadata probe (mode "describe") reports of a constructed attack: plain values only."""
    return dict(name=str(getattr(atk, "name", "")), consumes=list(atk.consumes), adversary=atk.adversary,
                aux=list(atk.aux), outputs={str(k): str(v) for k, v in dict(atk.outputs).items()},
                params=json.loads(json.dumps(dataclasses.asdict(atk.p), default=str)),
                threat=json.loads(json.dumps(atk.threat(), default=str)))


ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "TMPDIR", "PYTHONSAFEPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES")


def clean_env() -> dict:
    """The allow-listed part of this process's environment: all a worker (and bubblewrap itself) starts with."""
    return {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}


SANDBOXES = ("auto", "bwrap", "process")


def sandbox_mode() -> str:
    """"bwrap" or "process": the ``FDG_AUDIT_SANDBOX`` setting resolved on this machine (one line if unusable)."""
    mode = os.environ.get("FDG_AUDIT_SANDBOX", "auto") or "auto"
    if mode not in SANDBOXES:
        raise UserError(f"FDG_AUDIT_SANDBOX = {mode[:100]!r}: use one of {', '.join(SANDBOXES)}")
    if mode == "process" or mode == "auto" and not bwrap_works():
        return "process"
    if not bwrap_works():
        raise UserError("FDG_AUDIT_SANDBOX = \"bwrap\" but bubblewrap is missing or refuses to start here: "
                        "apt-get install bubblewrap (user namespaces must be allowed), or unset FDG_AUDIT_SANDBOX")
    return "bwrap"


@lru_cache(maxsize=None)
def bwrap_flags() -> tuple | None:
    """The namespace and capability flags bubblewrap accepts here (a new user namespace where the kernel allows
    one; every capability dropped in any case), or None when bubblewrap is missing or cannot start."""
    exe = shutil.which("bwrap")
    if not exe:
        return None
    for flags in (("--unshare-all", "--unshare-user", "--cap-drop", "ALL"), ("--unshare-all", "--cap-drop", "ALL")):
        try:
            if subprocess.run([exe, *flags, "--ro-bind", "/", "/", "--proc", "/proc", "true"], env=clean_env(),
                              capture_output=True, timeout=30).returncode == 0:
                return flags
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def bwrap_works() -> bool:
    """bubblewrap is installed and can create the namespaces ``bwrap_argv`` asks for."""
    return bwrap_flags() is not None


@lru_cache(maxsize=64)
def _sources(names: tuple, path: tuple) -> frozenset:
    """The files or directories that top-level modules ``names`` load from (found on ``path`` without importing);
    the same for every worker of a process with the same plugins and import path."""
    import importlib.util
    out, saved = set(), sys.path[:]
    sys.path[:] = list(path)
    try:
        for n in names:
            mod = sys.modules.get(n)
            spec = getattr(mod, "__spec__", None) or importlib.util.find_spec(n)
            if spec is None:
                continue
            locs = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
            out |= {str(Path(x).resolve()) for x in locs if x and Path(x).exists()}
    except (ImportError, ValueError):
        pass
    finally:
        sys.path[:] = saved
    return frozenset(out)


def _py_files(d: str, cap: int = 5000) -> list[str]:
    """The Python source files of a plugin named by "module:Class" (a file, or a package or namespace package
    folder): never the data beside them (a run folder, its truth/), nothing inside a protected folder."""
    files = [d] if os.path.isfile(d) else [str(p) for p in Path(d).rglob("*.py") if p.is_file() and not p.is_symlink()]
    guard = tuple(os.path.realpath(p).rstrip("/") + "/" for p in PROTECT)
    return [f for f in files[:cap] if f.endswith(".py") and not f.startswith(guard)]


def exposable(d: str) -> bool:
    """Whether a source folder may be bound into the sandbox: it is not the working directory, nor a folder that
    holds it or a run folder being attacked (``PROTECT``)."""
    guard = {os.path.realpath(os.getcwd())} | {os.path.realpath(p) for p in PROTECT}
    return not any(g == d or g.startswith(d.rstrip("/") + "/") for g in guard)


def bwrap_argv(folder: Path, spec: dict, paths: dict, cache: Path | None = None, entry: str = "_main") -> list[str]:
    """The command that runs ``_worker`` on ``folder`` under bubblewrap (see the module docstring); ``entry``
    "_serve": a warm sandbox that runs one job per line it reads (``WarmSandbox``)."""
    import glob
    from .plugins import available
    top = lambda path: path.partition(":")[0].split(".")[0]  # noqa: E731
    tops = ["fdg_audit"] + [top(v) for kind in ("attack", "method") for v in available(kind).values()]
    named = [top(n) for n in (spec["attack"], spec.get("run", {}).get("plugin", "")) if ":" in n]   # named by path
    ro = {"/usr", "/etc", sys.base_prefix, sys.prefix}
    ro |= {d for d in ("/bin", "/lib", "/lib64", "/lib32", "/sbin") if os.path.lexists(d)}
    src = {str(Path(p).resolve()) for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    for pick, path in ((tops, paths["attack"]), (tops, paths["method"])):
        src |= _sources(tuple(pick), tuple(path))
    ro |= {d for d in src if exposable(d)}
    for path in (paths["attack"], paths["method"]):   # a plugin named by path: its Python files, nothing else
        ro |= {f for d in _sources(tuple(named), tuple(path)) - src for f in _py_files(d)}
    argv = [shutil.which("bwrap"), *bwrap_flags(), "--die-with-parent", "--new-session", "--clearenv",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]   # first: plugin sources under /tmp bind inside
    for d in sorted(ro, key=len):   # parents first: a child bind lands inside its parent's
        if Path(d).exists():
            argv += ["--ro-bind", d, d]
    if spec.get("device", "cpu") != "cpu":   # a GPU: its device nodes and the driver's view of /sys
        argv += [x for d in glob.glob("/dev/nvidia*") for x in ("--dev-bind", d, d)] + ["--ro-bind", "/sys", "/sys"]
    argv += ["--bind", str(folder), str(folder), "--chdir", str(folder)]
    if cache is not None:   # earlier jobs' kept arrays: read-only inside
        argv += ["--ro-bind", str(cache), str(folder / "cache")]
    for k, v in clean_env().items():
        argv += ["--setenv", k, v]
    argv += ["--setenv", "PYTHONSAFEPATH", "1", "--setenv", "HOME", str(folder)]
    root = str(Path(__file__).resolve().parents[1])   # this fdg_audit's folder (also when PYTHONPATH chose it)
    return argv + [sys.executable, "-P", "-c", "import sys; sys.path.insert(0, sys.argv[2]); "
                   f"from fdg_audit.sandbox import {entry}; {entry}(sys.argv[1])", str(folder), root]


def _main(folder: str) -> None:
    """Entry point under bubblewrap: the import paths come in the view folder's ``paths.json`` (a folder removed
    meanwhile, e.g. by Ctrl-C in the harness, ends the worker without a word)."""
    try:
        paths = json.loads((Path(folder) / "paths.json").read_text())
    except (OSError, ValueError):
        sys.exit(1)
    _worker(folder, paths)


def _serve(folder: str) -> None:
    """Entry point of a warm sandbox: import the core once (never a plugin), then for each line on stdin fork one
    job (``_main`` on the view folder the harness has just written), wait for it, and before answering "done" leave
    nothing of it behind: every other process of the sandbox's PID namespace is killed, /tmp and /dev/shm are
    emptied, System V IPC objects are removed, and POSIX message queues cannot be created (RLIMIT_MSGQUEUE 0).
    The server is not dumpable, so a job cannot trace it; a job never sees stdin or stdout."""
    import ctypes
    import resource
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE = 0
    import fdg_audit.harness  # noqa: F401   (the core, as the forkserver preloads it)
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
    import time
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


def _worker(folder: str, paths: dict) -> None:
    """Entry point of the attack process: read the view folder, run the attack, write ``result.npz``.
    ``paths``: the import path for the run's method and for the attack (see plugins.import_path). Before any plugin
    code: its own session (the harness stops it with everything it started), the memory limit, the working directory
    is the view folder, argv and the environment name nothing of the harness (an allowlist, ENV_ALLOW), and Ctrl-C is
    left to the harness (no traceback from the worker)."""
    import resource
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.setsid()
    except OSError:
        pass
    os.chdir(folder)
    sys.argv = ["fdg_audit-attack-worker"]
    keep = clean_env()
    os.environ.clear()
    os.environ.update(keep, HOME=folder)
    root = Path(folder)
    try:
        spec = json.loads((root / "view.json").read_text())
    except (OSError, ValueError):
        sys.exit(1)
    limit = int(float(spec.get("memory_gb") or LIMITS["memory_gb"]) * 2 ** 30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    view = None
    try:
        torch.set_num_threads(spec["threads"])   # the job's count, else the harness's: the numbers of in-process
        from threadpoolctl import threadpool_limits   # numpy's and scikit-learn's BLAS too: two workers at once
        threadpool_limits(spec["threads"])            # on 2 cores must not each start a thread per core
        from .plugins import load_attack, load_method
        if "run" in spec:   # the method first, so view.protocol finds the installed module, not a shadow
            sys.path[:] = paths["method"]
            load_method(spec["run"]["plugin"])
        sys.path[:] = paths["attack"]
        cls = load_attack(spec["attack"])
        device = torch.device(spec["device"])
        atk = cls(typed(cls.Params, spec["params"], f"attacks.{spec.get('label') or cls.name or spec['attack']}"),
                  device)
        if spec["mode"] == "describe":   # the metadata probe (attack.describe): the harness never imports plugins
            res = {"describe": portrait(atk)}
        elif spec["mode"] == "control":
            res = {"controls": list(atk.control())}
        else:
            run = dict(spec["run"], model_cfg=ModelConfig(**spec["run"]["model_cfg"]))
            view = AdversaryView(Ledger.open(root), run, spec["adversary"], spec["me"], device)
            view.cache_dir = str(root / "cache")
            aux = decode((root / "aux.npz").read_bytes(), {"Aux": Aux, "Split": Split}, "aux.npz")
            aux.public = _split(aux.public)
            for part in (aux.domain_samples, aux.candidates):
                part.update({k: _split(s) for k, s in part.items()})
            res = {"outputs": list(atk.run(view, aux)), "keep": dict(getattr(view, "_kept", {}))}
        data = encode(res)
    except UserError as e:
        data = encode({"user_error": str(e)})
    except Exception as e:  # noqa: BLE001  (reported by the parent as a failed row, like an in-process crash)
        data = encode({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    out = root / "result.npz"
    if os.path.lexists(out):   # whatever the plugin left there (a link, a FIFO) is replaced, never written through
        os.unlink(out)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@lru_cache(maxsize=None)
def worker_context():
    """The multiprocessing context of every worker (attack workers, parallel runs): a process has one forkserver,
    and its preload is fixed when it first starts, so everything that starts workers takes this one. Helper
    processes (the forkserver, the resource tracker) start as ``python -c``, which would put the working directory
    first on their import path (a received folder's ``selectors.py`` would run): PYTHONSAFEPATH keeps it off."""
    os.environ["PYTHONSAFEPATH"] = "1"
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # the core only: never a plugin or the parent's data. torch._dynamo too: torch imports it on the first
        # optimizer a process builds (seconds), which every worker that trains or optimises would pay again
        ctx.set_forkserver_preload(["fdg_audit.harness", "torch._dynamo"])
        return ctx
    return mp.get_context("spawn")


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


def _kill(p) -> None:
    """Stop worker ``p`` (a bubblewrap Popen or a forkserver Process) and everything in its session (bubblewrap's
    PID namespace ends with it; a forkserver worker leads its own session)."""
    try:
        if not isinstance(p, subprocess.Popen) or p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    except (OSError, TypeError):
        pass
    try:
        p.kill()
        p.wait() if isinstance(p, subprocess.Popen) else p.join()
    except (OSError, ValueError, AssertionError):
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
    the view as ``cache/``. Under bubblewrap the job runs in a warm sandbox of its attack (``WarmSandbox``)."""
    timeout = float(spec.get("timeout") or LIMITS["timeout"])
    cache = cache if cache is not None and Path(cache).is_dir() else None
    paths = dict(attack=import_path(spec["attack"]), method=import_path(spec.get("run", {}).get("plugin", "")))
    bwrap = sandbox_mode() == "bwrap"
    if bwrap:
        data = _run_warm(spec, paths, ledger, envs, aux, cache, timeout)
    else:
        data = _run_once(spec, paths, ledger, envs, aux, cache, timeout, bwrap)
    try:
        res = decode(data, types)
    except AttackFailed:
        raise
    except TypeError as e:
        raise AttackFailed(str(e)) from None
    if not isinstance(res, dict):
        raise AttackFailed("the attack's result is not a mapping")
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
    if cache is not None:
        shutil.copytree(cache, folder / "cache")
    threads = spec.get("threads") or torch.get_num_threads()
    atomic_write(folder / "view.json", json.dumps(dict(spec, threads=threads), default=str))
    atomic_write(folder / "paths.json", json.dumps(paths))


def _no_result(code) -> AttackFailed:
    return AttackFailed(f"the attack process exited with code {code} and no result"
                        + (" (killed: over attack_memory_gb?)" if code in (-9, 137) else ""))


def _timed_out(timeout: float) -> AttackFailed:
    return AttackFailed(f"the attack process ran longer than attack_timeout = {timeout:g} s and was stopped")


def _run_once(spec: dict, paths: dict, ledger, envs, aux, cache, timeout: float, bwrap: bool) -> bytes:
    """One job in a process of its own (bubblewrap, else a forkserver worker); the result's bytes."""
    folder = Path(tempfile.mkdtemp(prefix="fdg_view_"))
    p = None
    try:
        _write_view(folder, spec, paths, ledger, envs, aux, cache if not bwrap else None)
        if bwrap and cache is not None:
            (folder / "cache").mkdir()   # the mount point of the read-only bind
        with _LOCK:
            if _STOP.is_set():
                raise AttackFailed("stopped before it started (the harness is stopping)")
            if bwrap:
                p = subprocess.Popen(bwrap_argv(folder, spec, paths, cache), stdin=subprocess.DEVNULL, env=clean_env(),
                                     start_new_session=True)
            else:
                p = worker_context().Process(target=_worker, args=(str(folder), paths), daemon=True)
                p.start()
            _LIVE.add(p)
        if bwrap:
            try:
                code = p.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
        else:
            p.join(timeout)
            code = p.exitcode
        if code is None:
            raise _timed_out(timeout)
        data = read_result(folder)
        if data is None:
            raise _no_result(code)
        return data
    finally:
        if p is not None:
            _kill(p)
            with _LOCK:
                _LIVE.discard(p)
        shutil.rmtree(folder, ignore_errors=True)


class WarmSandbox:
    """One bubblewrap sandbox (``bwrap_argv``, entry ``_serve``) that runs jobs in turn (of any attack whose binds it
    has), each in a process forked from a server that imported the core and no plugin: a job pays no interpreter
    start-up, and reaches what a fresh sandbox would give it. Its view folder is written for the job and emptied after it (all
    but the read-only ``cache/`` bind); the server leaves no process, temporary file or IPC object of a job to the
    next (``_serve``). A job that runs over its time, or a server that dies, ends the sandbox."""

    def __init__(self, spec: dict, paths: dict, cache: Path | None):
        self.folder = Path(tempfile.mkdtemp(prefix="fdg_view_"))
        if cache is not None:
            (self.folder / "cache").mkdir()
        self.p = subprocess.Popen(bwrap_argv(self.folder, spec, paths, cache, entry="_serve"), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=clean_env(), start_new_session=True)

    def run(self, spec: dict, paths: dict, ledger, envs, aux, timeout: float) -> bytes:
        import select
        try:
            _write_view(self.folder, spec, paths, ledger, envs, aux, None)
            self.p.stdin.write(b"job\n")
            self.p.stdin.flush()
            ready = select.select([self.p.stdout], [], [], timeout)[0]
            line = self.p.stdout.readline() if ready else b""
        except (OSError, ValueError):   # the server is gone
            line, ready = b"", True
        data = read_result(self.folder)
        for e in self.folder.iterdir():
            if e.name != "cache":
                shutil.rmtree(e, ignore_errors=True) if e.is_dir() and not e.is_symlink() else e.unlink()
        if not ready:
            raise _timed_out(timeout)
        if line != b"done\n" or data is None:
            raise _no_result(self.p.poll())
        return data

    def close(self) -> None:
        _kill(self.p)
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)


_IDLE: dict = {}   # (attack and method named by path, device, cache) -> warm sandboxes waiting for a job


def _run_warm(spec: dict, paths: dict, ledger, envs, aux, cache, timeout: float) -> bytes:
    # every job is its own fork of a server that runs no plugin code, so jobs share a sandbox whenever it binds the
    # same files: a plugin named by path, and an attack's cache folder, are binds of their own
    method, attack = spec.get("run", {}).get("plugin", ""), spec["attack"]
    key = (attack if ":" in attack else "", method if ":" in method else "", spec.get("device", "cpu"), str(cache))
    with _LOCK:
        if _STOP.is_set():
            raise AttackFailed("stopped before it started (the harness is stopping)")
        box = _IDLE[key].pop() if _IDLE.get(key) else None
        if box is None:
            box = WarmSandbox(spec, paths, cache)
            _LIVE.add(box.p)
    ok = False
    try:
        data = box.run(spec, paths, ledger, envs, aux, timeout)
        ok = True
        return data
    finally:
        with _LOCK:
            if ok and not _STOP.is_set():
                _IDLE.setdefault(key, []).append(box)
            else:
                _LIVE.discard(box.p)
        if not ok or _STOP.is_set():
            box.close()


def close_warm() -> None:
    """End every idle warm sandbox (when the harness is done or stops)."""
    with _LOCK:
        boxes = [b for v in _IDLE.values() for b in v]
        _IDLE.clear()
        for b in boxes:
            _LIVE.discard(b.p)
    for b in boxes:
        b.close()
