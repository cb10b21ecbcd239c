"""What crosses the boundary between the harness and an attack worker, as data.

Results are data (``read_result``): the worker writes one ``result.npz``: plain numeric or string arrays and one JSON
document (``meta``) that refers to them; the harness opens it only as a regular file of the view folder (no link,
no FIFO, at most ``MAX_RESULT`` bytes), loads it without pickle, and the harness then checks every field
(fdg_audit.audit.harness). Anything else is that attack's one-line failure. Every worker ends: it runs under a memory limit
(``attack_memory_gb``, fdg_audit/audit/confine.py) and is killed with everything in it after ``attack_timeout``
seconds (the scenario's settings; ``LIMITS`` holds the defaults).
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import stat
import zipfile
from pathlib import Path

import numpy as np
import torch

from ..store.ledger import atomic_write

MAX_RESULT = 2 ** 31          # bytes of a worker's result.npz (and of its arrays unpacked)

MAX_KEPT = 2 ** 30            # bytes one job may keep in the attack cache

CACHE_KEY = re.compile(r"[A-Za-z0-9_.-]{1,100}")



class AttackFailed(Exception):
    """The attack raised (or its process died) in the worker; ``detail`` holds the worker's traceback."""

    def __init__(self, msg: str, detail: str = ""):
        super().__init__(msg)
        self.detail = detail


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
        atomic_write(Path(cache_dir) / f"{key}.npz", buf.getvalue(), Path(cache_dir).parents[1])   # the run folder
