"""The limits an attack job runs under, set in its own process before any plugin code (``confine``).

- memory: ``RLIMIT_AS`` = the address space the worker holds when the job starts (the interpreter, torch, the core)
  plus ``attack_memory_gb``: every mapping counts, MAP_SHARED anonymous ones included;
- no new process (a seccomp filter: fork, vfork and clone without CLONE_THREAD fail with EPERM; threads may be
  made), so the job's process tree is the job's process and its limit holds over the tree, and nothing outlives the
  job when its process is killed; System V shared memory (shmget) and memfd_create fail too (memory no mapping
  counts), and so do what could outlive the job in its sandbox or reach the sandbox's server (System V queues and
  semaphores, kernel keys, ptrace, process_vm_*: fdg_audit/audit/serve.py);
- each file it writes is at most ``MAX_FILE`` bytes (``RLIMIT_FSIZE``), no core dump, no POSIX message queue.

Under bubblewrap, /tmp and /dev/shm are tmpfs mounts of at most ``attack_memory_gb / 4`` each (fdg_audit/audit/bwrap.py),
the root and /dev are read-only: the job's memory is at most 1.5 x attack_memory_gb beyond its start. Without
bubblewrap, /tmp and /dev/shm are the host's: files there are bounded per file only; so are the view folder's in
either mode (docs/threat-models.md, "Limits").
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct

MAX_FILE = 2 ** 31   # bytes of one file a job writes (its result.npz is at most transport.MAX_RESULT)

# (audit arch, syscall numbers) of the architectures the filter knows; elsewhere no process limit (docs/threat-models.md)
_ARCH = {"x86_64": (0xC000003E, dict(clone=56, clone3=435, fork=57, vfork=58, shmget=29, memfd_create=319, msgget=68,
                                     semget=64, add_key=248, request_key=249, keyctl=250, ptrace=101,
                                     process_vm_readv=310, process_vm_writev=311)),
         "aarch64": (0xC00000B7, dict(clone=220, clone3=435, shmget=194, memfd_create=279, msgget=186, semget=190,
                                      add_key=217, request_key=218, keyctl=219, ptrace=117, process_vm_readv=270,
                                      process_vm_writev=271))}
DENIED = ("fork", "vfork", "shmget", "memfd_create", "msgget", "semget", "add_key", "request_key", "keyctl", "ptrace",
          "process_vm_readv", "process_vm_writev")
_CLONE_THREAD = 0x00010000



def _program(arch: int, nr: dict) -> bytes:
    """The classic BPF seccomp program: another architecture or the x32 ABI, ``DENIED`` and clone without
    CLONE_THREAD fail (EPERM); clone3 reports ENOSYS (libc then makes threads with clone)."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    op = lambda code, k, jt=0, jf=0: struct.pack("HBBI", code, jt, jf, k)  # noqa: E731
    prog = [op(ld, 4), op(jeq, arch, 1, 0), op(ret, eperm), op(ld, 0), op(jge, 0x40000000, 0, 1), op(ret, eperm)]
    for name in DENIED:
        if name in nr:
            prog += [op(jeq, nr[name], 0, 1), op(ret, eperm)]
    prog += [op(jeq, nr["clone3"], 0, 1), op(ret, enosys)]
    prog += [op(jeq, nr["clone"], 0, 3), op(ld, 16), op(jset, _CLONE_THREAD, 1, 0), op(ret, eperm), op(ret, allow)]
    return b"".join(prog)



def no_new_processes() -> bool:
    """Install the seccomp filter in this process (and every thread it makes later); False where it cannot be."""
    known = _ARCH.get(platform.machine())
    if known is None or not hasattr(os, "sched_getaffinity"):   # Linux only
        return False
    prog = ctypes.create_string_buffer(_program(*known))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog.raw) // 8, ctypes.cast(prog, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    ul = ctypes.c_ulong
    if libc.prctl(38, ul(1), ul(0), ul(0), ul(0)) != 0:   # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, ul(2), ctypes.byref(fprog), ul(0), ul(0)) == 0   # PR_SET_SECCOMP, SECCOMP_MODE_FILTER



def address_space() -> int:
    """This process's mapped address space in bytes (VmSize; 0 where /proc does not tell)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return 0



def confine(memory_gb: float) -> None:
    """Limit this process (an attack worker about to load plugin code) as the module docstring says."""
    import resource
    limit = int(memory_gb * 2 ** 30)
    have = address_space()
    if have:
        resource.setrlimit(resource.RLIMIT_AS, (have + limit, have + limit))
    else:   # no /proc: the data segment at least
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    for what, v in (("RLIMIT_FSIZE", MAX_FILE), ("RLIMIT_CORE", 0), ("RLIMIT_MSGQUEUE", 0)):
        if hasattr(resource, what):
            resource.setrlimit(getattr(resource, what), (v, v))
    no_new_processes()
