"""The bubblewrap command of an attack worker (``bwrap_argv``) and whether bubblewrap works here.

The OS sandbox's rules are in fdg_audit/audit/sandbox.py's module docstring; the worker that runs inside is
fdg_audit/audit/worker.py, the sandbox's entry point fdg_audit/audit/serve.py.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from ..errors import UserError
from ..plugins import available

PROTECT: set = set()          # folders no bubblewrap bind may be or hold (the run folders being attacked)

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



def bwrap_argv(folder: Path, spec: dict, paths: dict, cache: Path | None, channel: int, reply: int) -> list[str]:
    """The command of a sandbox (fdg_audit.audit.serve as its PID 1, a child of it per job running .worker) on
    ``folder`` under bubblewrap (see fdg_audit/audit/sandbox.py): a job runs when the harness writes "go <nonce>" to
    the pipe ``channel``, the server answers on ``reply`` (``Sandbox``). /tmp and /dev/shm are private tmpfs mounts
    of at most a quarter of ``memory_gb`` each; the root and /dev read-only."""
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
    tmpfs = str(max(1 << 20, int(float(spec["memory_gb"]) * 2 ** 28)))   # bytes: a quarter each
    argv = [shutil.which("bwrap"), *bwrap_flags(), "--die-with-parent", "--as-pid-1", "--new-session", "--clearenv",
            "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--size", tmpfs, "--tmpfs", "/dev/shm",
            "--size", tmpfs, "--tmpfs", "/tmp"]   # first: plugin sources under /tmp bind inside
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
    argv += ["--remount-ro", "/"]   # after every mount point was made: nothing to write outside the mounts
    root = str(Path(__file__).resolve().parents[2])   # this fdg_audit's folder (also when PYTHONPATH chose it)
    return argv + [sys.executable, "-P", "-c", "import sys; sys.path.insert(0, sys.argv[2]); "
                   "from fdg_audit.audit.serve import _serve; _serve(sys.argv[1], int(sys.argv[3]), int(sys.argv[4]))",
                   str(folder), root, str(channel), str(reply)]
