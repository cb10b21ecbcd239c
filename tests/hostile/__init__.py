"""Hostile attack plugins (issue 35): each tries one way across the trust boundary from inside its worker. The tests
(tests/test_hostile.py) run them under bubblewrap as the user running the suite (root on CI and in containers). A
plugin reports what it reached as a ``Skipped`` reason (JSON), or breaks the result protocol on purpose; this package
imports only fdg_audit, so under bubblewrap nothing else of tests/ is exposed."""
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fdg_audit.api.attack import Attack, AttackParams, Control, Scores, Skipped


@dataclass
class Params(AttackParams):
    paths: list = field(default_factory=list)   # files the plugin tries to change or read (the test names them)
    canary: str = ""                             # a value set only in the harness's environment
    how: str = ""                                # which break to try (Protocol, Keeper)
    target: str = ""                             # a file outside the view (Protocol: "link")
    mb: int = 0                                  # MB to allocate (Protocol: "memory")


def _remount_rw(path: str) -> str:
    """MS_REMOUNT | MS_BIND without MS_RDONLY: makes a read-only bind writable, given CAP_SYS_ADMIN."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    ok = libc.mount(None, path.encode(), None, 32 | 4096, None) == 0
    return "remounted" if ok else os.strerror(ctypes.get_errno())


class Root(Attack):
    """As root inside the sandbox: its capabilities, remounting and appending to each of ``paths``, and the
    harness's environment through /proc (every process visible, PID 1 = bubblewrap itself)."""
    name = "hostile_root"
    consumes = ("weights",)
    Params = Params

    def run(self, view, aux):
        status = Path("/proc/self/status").read_text()
        got = dict(uid=os.getuid(), cap_eff=next(x.split()[1] for x in status.splitlines() if x.startswith("CapEff")))
        for p in self.p.paths:
            got[p] = _remount_rw(str(Path(p).parent))
            try:
                with open(p, "a") as f:
                    f.write("\n# written from inside the sandbox\n")
                got[p] += ", written"
            except OSError as e:
                got[p] += f", {e.strerror}"
        seen = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and self.p.canary and self.p.canary.encode() in (d / "environ").read_bytes():
                    seen.append(d.name)
            except OSError:
                pass
        got["canary_in"] = seen
        return [Skipped(view.me, "weights", 1, json.dumps(got))]


class Protocol(Attack):
    """Breaks the result protocol: ``how`` = "link" (result.npz a link to ``target``), "fifo", "pickle" (an object
    array), "victim" (a victim name that walks out of the folder), "memory" (allocates ``mb`` MB), "hang"
    (never returns), "ok" (a plain valid output, the control)."""
    name = "hostile_protocol"
    consumes = ("weights",)
    aux = ("candidates",)
    Params = Params

    def run(self, view, aux):
        how = self.p.how
        victim = view.clients[0]
        if how in ("link", "fifo", "pickle"):
            os.symlink(self.p.target, "result.npz") if how == "link" else os.mkfifo("result.npz") if how == "fifo" \
                else np.savez("result.npz", meta=np.array([{"x": 1}], dtype=object))
            os._exit(0)   # leave it there as the worker's answer
        if how == "memory":
            np.ones(self.p.mb * 2 ** 20, np.uint8)
        if how == "hang":
            import time
            while True:
                time.sleep(1)
        if how == "victim":
            victim = "../../../../tmp/x"
        return [Scores(victim, "weights", 1, np.zeros(len(aux.candidates[view.clients[0]])))]


class BadParams(Attack):
    """A self-description the harness must not trust: ``__post_init__`` turns targets or seeds into junk."""
    name = "hostile_params"
    consumes = ("weights",)

    @dataclass
    class Params(AttackParams):
        junk: str = "targets"

        def __post_init__(self):
            if self.junk == "targets":
                self.targets = 5
            else:
                self.seeds = ["x"]

    def run(self, view, aux):
        return []


class Keeper(Attack):
    """The attacker-side cache: reports whether ``view.cached("state")`` held what an earlier job kept, tries to
    change the cache from inside, and keeps (when the cache is empty, or ``how`` is not "ok") by ``how``: "ok" (an
    int array under "state"), "dotdot" (a key that walks out), "object" (an object array)."""
    name = "hostile_keeper"
    consumes = ("weights",)
    Params = Params

    def run(self, view, aux):
        before = view.cached("state")
        got = dict(cached=None if before is None else before["x"].tolist())
        try:
            (Path(view.cache_dir) / "state.npz").write_bytes(b"overwritten from inside")
            got["wrote"] = True
        except OSError as e:
            got["wrote"] = e.strerror
        key, arr = {"dotdot": ("../../escape", np.arange(3)),
                    "object": ("state", np.array([{"a": 1}], dtype=object))}.get(self.p.how, ("state", np.arange(4)))
        if before is None or self.p.how != "ok":   # kept once: a later job's write would mask a changed cache
            view.keep(key, {"x": arr})
        return [Skipped(view.me, "weights", 1, json.dumps(got))]


STASH_KEY = 0x5a17   # the System V shared-memory key Stash leaves behind


def in_sandbox() -> bool:
    """Whether PID 1 is a sandbox's server (or bubblewrap's own init, as before the server became PID 1)."""
    one = Path("/proc/1/cmdline").read_bytes()
    return b"fdg_audit.audit.serve" in one or b"bwrap" in one
PLACES = ("/tmp", "/dev/shm", ".", "/", "/dev", "cache")   # where Stash leaves a file (round 4: /, /dev, cache/)


class Stash(Attack):
    """Tries to carry something from one job to the next one of the same attack (a warm sandbox serves both): its
    control() leaves a file in /tmp, /dev/shm, its view folder, /, /dev and the view's cache/, a process that outlives it, a System V shared
    memory segment and a POSIX message queue, and in a sandbox a user xattr and another mode on /tmp and a folder
    it made unreadable there; run() reports which of them it finds, and in a sandbox whether it could open its
    server's (PID 1's) file descriptors or memory or ptrace it ("server" first: PID 1 is the sandbox's server)."""
    name = "hostile_stash"
    consumes = ("weights",)
    Params = Params

    def control(self):
        import ctypes
        import subprocess
        import sys
        for d in self.p.paths or PLACES:
            try:
                Path(d, "fdg_stash").write_text("left")
            except OSError:
                pass
        try:   # a process that outlives the job (no new process can be made in a worker now)
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "fdg-stash-sleeper"],
                             start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        except OSError:
            pass
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmget(STASH_KEY, 4096, 0o1000 | 0o600)   # IPC_CREAT
        rt = ctypes.CDLL("librt.so.1", use_errno=True)
        rt.mq_open.restype = ctypes.c_int
        made = rt.mq_open(b"/fdg_stash", os.O_CREAT | os.O_RDWR, 0o600, None)
        if in_sandbox():   # never on the host's /tmp
            for try_ in (lambda: os.setxattr("/tmp", "user.fdg_stash", b"left"), lambda: os.chmod("/tmp", 0o1770),
                         lambda: os.makedirs("/tmp/fdg_stash_dir/deep"), lambda: os.chmod("/tmp/fdg_stash_dir", 0)):
                try:
                    try_()
                except OSError:
                    pass
        return [Control("left", "mq_open", float(made >= 0), 0.0)]

    def run(self, view, aux):
        import ctypes
        found = [d for d in self.p.paths or PLACES if Path(d, "fdg_stash").exists()]
        for d in os.listdir("/proc"):
            try:
                if d.isdigit() and b"fdg-stash-sleeper" in Path(f"/proc/{d}/cmdline").read_bytes():
                    found.append("process")
            except OSError:
                pass
        if ctypes.CDLL(None).shmget(STASH_KEY, 0, 0) >= 0:
            found.append("sysv_shm")
        rt = ctypes.CDLL("librt.so.1")
        rt.mq_open.restype = ctypes.c_int
        if rt.mq_open(b"/fdg_stash", os.O_RDONLY) >= 0:
            found.append("mqueue")
        if in_sandbox():
            found.insert(0, "server")   # (its fd numbers are listed to anyone; what they are, not)
            if os.listxattr("/tmp"):
                found.append("xattr")
            if os.stat("/tmp").st_mode & 0o7777 == 0o1770:
                found.append("mode")
            if os.path.lexists("/tmp/fdg_stash_dir"):
                found.append("folder")
            for what, f in (("proc1_fd", lambda: [os.readlink(f"/proc/1/fd/{n}") for n in os.listdir("/proc/1/fd")]),
                            ("proc1_fd", lambda: open("/proc/1/fd/0", "rb").close()),
                            ("proc1_mem", lambda: open("/proc/1/mem", "rb").close())):
                try:
                    f()
                    found.append(what)
                except OSError:
                    pass
            if ctypes.CDLL(None).ptrace(16, 1, 0, 0) == 0:   # PTRACE_ATTACH
                found.append("ptrace")
        return [Skipped(view.me, "weights", 1, json.dumps(found))]


class Forger(Attack):
    """Round 4, try 1: from its describe job (``__init__`` runs there) it answers that job itself (a result.npz and
    "done" written to /proc/1/fd/1, which held a warm sandbox's channel), then waits ``mb`` seconds for the view
    folder to hold a later job and answers it with a forged Skipped("forged"). Its own run() says "real"."""
    name = "hostile_forger"
    consumes = ("weights",)
    Params = Params

    def __init__(self, params=None, device="cpu"):
        super().__init__(params, device)
        import time
        from fdg_audit.audit.transport import encode
        from fdg_audit.audit.worker import portrait
        try:
            mode = json.loads(Path("view.json").read_text()).get("mode")
        except (OSError, ValueError):
            return
        if mode != "describe":
            return
        Path("result.npz").write_bytes(encode({"describe": portrait(self)}))
        if not in_sandbox():   # not inside a sandbox: the host's init
            return
        for fd in ("/proc/1/fd/1", "/proc/1/fd/0"):
            try:
                with open(fd, "w") as f:
                    f.write("done\n")
            except OSError:
                pass
        end = time.monotonic() + self.p.mb
        while time.monotonic() < end:
            try:
                spec = json.loads(Path("view.json").read_text())
            except (OSError, ValueError):
                spec = {}
            if spec.get("mode") in ("run", "control"):
                forged = {"controls": []} if spec["mode"] == "control" else \
                    {"outputs": [Skipped(spec["me"], "weights", 1, "forged")], "keep": {}}
                Path("result.npz").write_bytes(encode(forged))
                try:
                    with open("/proc/1/fd/1", "w") as f:
                        f.write("done\n")
                except OSError:
                    pass
            time.sleep(0.05)

    def run(self, view, aux):
        return [Skipped(view.me, "weights", 1, "real")]


class Hog(Attack):
    """Round 4, try 2: tries to hold ``mb`` MB past attack_memory_gb by ``how``: "mmap" (a MAP_SHARED anonymous
    mapping), "shm" (a file in /dev/shm), "tmp" (a file in /tmp), "children" (three child processes); reports the MB
    it held at once (JSON {"held": MB, "why": the error that stopped it})."""
    name = "hostile_hog"
    consumes = ("weights",)
    Params = Params

    def run(self, view, aux):
        import mmap
        chunk, held, why, keep = 2 ** 20 * 50, 0, "", []
        try:
            if self.p.how == "children":
                import subprocess
                import sys
                code = f"import time; b = bytearray({self.p.mb // 3} * 2 ** 20); time.sleep(30)"
                keep = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(3)]
                held = self.p.mb   # three processes of a third each (killed below)
            else:
                f = None if self.p.how == "mmap" else open(f"/{'dev/shm' if self.p.how == 'shm' else 'tmp'}/hog", "wb")
                while held < self.p.mb:
                    if f is None:
                        m = mmap.mmap(-1, chunk, flags=mmap.MAP_SHARED)
                        m.write(b"x" * chunk)
                        keep.append(m)
                    else:
                        f.write(b"x" * chunk)
                        f.flush()
                    held += chunk >> 20
        except (OSError, MemoryError) as e:
            why = type(e).__name__
        finally:
            for k in keep:
                getattr(k, "kill", getattr(k, "close", None))()
            for d in ("/dev/shm/hog", "/tmp/hog"):
                try:
                    if self.p.how != "mmap":
                        os.unlink(d)
                except OSError:
                    pass
        return [Skipped(view.me, "weights", 1, json.dumps({"held": held, "why": why}))]


class Sleeper(Attack):
    """Round 4, try 6: a constructor that never returns (the describe job must end at attack_timeout)."""
    name = "hostile_sleeper"
    consumes = ("weights",)

    def __init__(self, params=None, device="cpu"):
        super().__init__(params, device)
        import time
        while True:
            time.sleep(1)
