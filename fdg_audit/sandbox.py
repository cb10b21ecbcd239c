"""Adversary views, and the attack worker process that sees nothing else.

``AdversaryView`` is what one adversary observed in one run: the envelopes it sent or received (every envelope
for an eavesdropper), their payloads, and the run's public protocol (Kerckhoffs). ``Aux`` is the auxiliary data
an attack declared.

Isolation (the default of the harness, ``run_isolated``): the parent writes a *view folder* for one attack on one
run: ``view.json`` (protocol: method, params, model, shape, clients; who the adversary is; the attack and its
parameters), ``messages.jsonl`` (the adversary's envelopes only, without the hash-chain field), ``payloads/`` (only
those envelopes' payload bytes, each checked against its envelope's sha256 on the way) and ``aux.pt`` (only the
declared aux data). The attack runs in a fresh process whose only input is that folder: multiprocessing's
"forkserver" starts a clean server once (torch and the core imported, no copy of the parent's memory) and forks one
worker per job; where forkserver is missing (Windows), "spawn". Outputs come back as plain tensors and
strings (``torch.load(weights_only=True)``). Ground truth, the run folder and other parties' messages stay in the
parent, which joins outputs with truth in the scorer. The worker is told neither the run folder nor its path.

OS sandbox (``FDG_AUDIT_SANDBOX``, default "auto"): where bubblewrap (``bwrap``, Debian's ``bubblewrap``) is
installed and works, each worker starts under it instead (``bwrap_argv``): new user, PID, network, IPC and UTS
namespaces (no network, its own /proc, so no /proc/<harness>), an empty /tmp, and a file system that holds only the
system directories, the Python installation and environment (read-only), the source directories of fdg_audit, of
the installed plugins (shadow training runs methods) and of a plugin named by "module:Class" (read-only), and its
own view folder (read-write, for ``result.pt``). The run folder, its
``truth/``, other views and the rest of the user's files do not exist there. A fresh interpreter per worker costs
start-up time (bench/attack_isolation.py). "process" (or "auto" without bubblewrap) keeps the forkserver worker: an
ordinary process of the same user, so code that searches the file system on its own (outside the API) could still
open files that user can read; there the boundary is the API and the process, not an OS sandbox. "bwrap" insists.
``isolate=False`` (``attack --in-process``) runs the attack inside the harness for debugging: there the view's
messages hold the whole ledger and the process holds the truth, so nothing is enforced. View folders are created
private to the user (0700) and removed on every exit path of the harness.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .api.attack import AdversaryView, Aux
from .data import Split
from .errors import UserError
from .ledger import Ledger, atomic_write
from .models import ModelConfig
from .params import typed
from .plugins import import_path


# ------------------------------------------------------------------------------------------- plain-data transport

def pack(v):
    """Tensors, arrays, dataclasses, dicts, lists and scalars as what ``torch.load(weights_only=True)`` accepts."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, np.ndarray):
        if v.dtype.kind in "biuf" and v.dtype.itemsize <= 8 and v.dtype.str[1:] not in ("u2", "u4", "u8"):
            return {"__np__": torch.from_numpy(np.ascontiguousarray(v))}
        return {"__nplist__": v.tolist(), "dtype": v.dtype.str if v.dtype.kind in "USbiuf" else "O"}
    if isinstance(v, np.generic):
        return v.item()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"__dc__": type(v).__name__, "f": {f.name: pack(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if isinstance(v, dict):
        return {str(k): pack(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [pack(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    raise TypeError(f"{type(v).__name__} cannot leave the attack process: return tensors, arrays, numbers or strings")


def unpack(v, types: dict):
    if isinstance(v, dict):
        if "__np__" in v:
            return v["__np__"].numpy()
        if "__nplist__" in v:
            return np.array(v["__nplist__"], dtype=None if v["dtype"] == "O" else v["dtype"])
        if "__dc__" in v:
            if v["__dc__"] not in types:
                raise TypeError(f"attack returned {v['__dc__']}; return one of {', '.join(types)}")
            return types[v["__dc__"]](**{k: unpack(x, types) for k, x in v["f"].items()})
        return {k: unpack(x, types) for k, x in v.items()}
    if isinstance(v, list):
        return [unpack(x, types) for x in v]
    return v


def _split(s):
    return s if s is None else Split(torch.as_tensor(s.x), torch.as_tensor(s.y), np.asarray(s.idx))


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


SANDBOXES = ("auto", "bwrap", "process")


def sandbox_mode() -> str:
    """"bwrap" or "process": the ``FDG_AUDIT_SANDBOX`` setting resolved on this machine (one line if unusable)."""
    import os
    mode = os.environ.get("FDG_AUDIT_SANDBOX", "auto") or "auto"
    if mode not in SANDBOXES:
        raise UserError(f"FDG_AUDIT_SANDBOX = {mode!r}: use one of {', '.join(SANDBOXES)}")
    if mode == "process" or mode == "auto" and not bwrap_works():
        return "process"
    if not bwrap_works():
        raise UserError("FDG_AUDIT_SANDBOX = \"bwrap\" but bubblewrap is missing or refuses to start here: "
                        "apt-get install bubblewrap (user namespaces must be allowed), or unset FDG_AUDIT_SANDBOX")
    return "bwrap"


@lru_cache(maxsize=None)
def bwrap_works() -> bool:
    """bubblewrap is installed and can create the namespaces ``bwrap_argv`` asks for."""
    import subprocess
    exe = shutil.which("bwrap")
    if not exe:
        return False
    try:
        return subprocess.run([exe, "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


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


def bwrap_argv(folder: Path, spec: dict, paths: dict) -> list[str]:
    """The command that runs ``_worker`` on ``folder`` under bubblewrap (see the module docstring)."""
    import glob
    import os
    from .plugins import available
    top = lambda path: path.partition(":")[0].split(".")[0]  # noqa: E731
    tops = ["fdg_audit"] + [top(v) for kind in ("attack", "method") for v in available(kind).values()]
    tops += [top(n) for n in (spec["attack"], spec.get("run", {}).get("plugin", "")) if ":" in n]   # named by path
    ro = {"/usr", "/etc", sys.base_prefix, sys.prefix}
    ro |= {d for d in ("/bin", "/lib", "/lib64", "/lib32", "/sbin") if os.path.lexists(d)}
    ro |= _sources(tuple(tops), tuple(paths["attack"])) | _sources(tuple(tops), tuple(paths["method"]))
    ro |= {str(Path(p).resolve()) for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    argv = [shutil.which("bwrap"), "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]   # first: plugin sources under /tmp bind inside
    for d in sorted(ro, key=len):   # parents first: a child bind lands inside its parent's
        if Path(d).exists():
            argv += ["--ro-bind", d, d]
    if spec.get("device", "cpu") != "cpu":   # a GPU: its device nodes and the driver's view of /sys
        argv += [x for d in glob.glob("/dev/nvidia*") for x in ("--dev-bind", d, d)] + ["--ro-bind", "/sys", "/sys"]
    argv += ["--bind", str(folder), str(folder), "--chdir", str(folder)]
    for k in ENV_ALLOW:
        if k in os.environ:
            argv += ["--setenv", k, os.environ[k]]
    argv += ["--setenv", "PYTHONSAFEPATH", "1", "--setenv", "HOME", str(folder)]
    root = str(Path(__file__).resolve().parents[1])   # this fdg_audit's folder (also when PYTHONPATH chose it)
    return argv + [sys.executable, "-P", "-c", "import sys; sys.path.insert(0, sys.argv[2]); "
                   "from fdg_audit.sandbox import _main; _main(sys.argv[1])", str(folder), root]


def _main(folder: str) -> None:
    """Entry point under bubblewrap: the import paths come in the view folder's ``paths.json``."""
    _worker(folder, json.loads((Path(folder) / "paths.json").read_text()))


def _worker(folder: str, paths: dict) -> None:
    """Entry point of the attack process: read the view folder, run the attack, write ``result.pt``.
    ``paths``: the import path for the run's method and for the attack (see plugins.import_path). Before any plugin
    code: the working directory is the view folder, argv and the environment name nothing of the harness (an
    allowlist, ENV_ALLOW), and Ctrl-C is left to the harness (no traceback from the worker)."""
    import os
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.chdir(folder)
    sys.argv = ["fdg_audit-attack-worker"]
    keep = {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}
    os.environ.clear()
    os.environ.update(keep, HOME=folder)
    root = Path(folder)
    try:
        spec = json.loads((root / "view.json").read_text())
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
            aux = unpack(torch.load(root / "aux.pt", weights_only=True), {"Aux": Aux, "Split": Split})
            aux.public = _split(aux.public)
            for part in (aux.domain_samples, aux.candidates):
                part.update({k: _split(s) for k, s in part.items()})
            res = {"outputs": list(atk.run(view, aux))}
        out = pack(res)
    except UserError as e:
        out = {"user_error": str(e)}
    except Exception as e:  # noqa: BLE001  (reported by the parent as a failed row, like an in-process crash)
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    torch.save(out, root / "result.pt")


@lru_cache(maxsize=None)
def worker_context():
    """The multiprocessing context of every worker (attack workers, parallel runs): a process has one forkserver,
    and its preload is fixed when it first starts, so everything that starts workers takes this one. Helper
    processes (the forkserver, the resource tracker) start as ``python -c``, which would put the working directory
    first on their import path (a received folder's ``selectors.py`` would run): PYTHONSAFEPATH keeps it off."""
    import os
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


def stop_workers() -> None:
    """Stop every attack process still running (after an error or Ctrl-C in the harness); their results are
    dropped, as an interrupted attack's are."""
    for p in list(_LIVE):   # a forkserver Process or a bubblewrap Popen: both have kill(), harmless once ended
        p.kill()


def run_isolated(spec: dict, types: dict, ledger: Ledger | None = None, envs: list = (), aux: Aux | None = None):
    """Run one attack job in a worker process whose only input is a fresh view folder; return its result.

    ``spec``: attack (registered name or module:Class), label, params, device, mode ("run" | "control" |
    "describe") and, for "run", run (protocol fields), adversary, me. ``types``: the output classes the parent accepts back."""
    folder = Path(tempfile.mkdtemp(prefix="fdg_view_"))
    try:
        if spec["mode"] == "run":
            materialise(folder, ledger, list(envs))
            torch.save(pack(aux), folder / "aux.pt")
        atomic_write(folder / "view.json", json.dumps(dict(spec, threads=spec.get("threads") or torch.get_num_threads()),
                                                      default=str))
        paths = dict(attack=import_path(spec["attack"]), method=import_path(spec.get("run", {}).get("plugin", "")))
        if sandbox_mode() == "bwrap":
            import subprocess
            atomic_write(folder / "paths.json", json.dumps(paths))
            p = subprocess.Popen(bwrap_argv(folder, spec, paths), stdin=subprocess.DEVNULL, start_new_session=True)
            wait = p.wait
        else:
            p = worker_context().Process(target=_worker, args=(str(folder), paths), daemon=True)
            p.start()
            wait = lambda: (p.join(), p.exitcode)[1]  # noqa: E731
        _LIVE.add(p)
        try:
            code = wait()
        finally:
            _LIVE.discard(p)
        if not (folder / "result.pt").exists():
            raise AttackFailed(f"the attack process exited with code {code} and no result")
        res = torch.load(folder / "result.pt", weights_only=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if "user_error" in res:
        raise UserError(res["user_error"])
    if "error" in res:
        raise AttackFailed(res["error"], res["traceback"])
    try:
        return unpack(res, types)
    except TypeError as e:
        raise AttackFailed(str(e)) from None
