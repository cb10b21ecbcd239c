"""The bus: the only channel between parties, and the trust boundary of every run.

Wire codec ``FDG1`` (one documented format for every artifact):

    b"FDG1" | uint32 little-endian header length | header (UTF-8 JSON, sorted keys) | array bytes

The header is ``{"arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...], "scalars": {name: value}}``;
arrays follow in header order as C-contiguous little-endian bytes. Encoding is deterministic, so the same
payload always has the same sha256, and ``len(encode(p))`` is the size that would cross a real network.

``Bus.send`` applies the sender's mods (privacy mechanisms: ``Mod``), encodes, records an Envelope in the ledger
and returns a decoded copy for the receiver. A broadcast is one envelope per receiver.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import UserError

MAGIC = b"FDG1"
ARTIFACT_KINDS = {"weights", "delta", "bn_stats", "head", "amplitude_bank", "style_bank", "prototypes",
                  "generator", "scalar", "n_samples", "metric"}


def register_kind(kind: str) -> None:
    """Methods may extend the vocabulary of artifact kinds."""
    ARTIFACT_KINDS.add(kind)


def _as_numpy(v) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().numpy()
    a = np.ascontiguousarray(v)
    return a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a


def _on_device(v) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type != "cpu"


def _to_host(arrays: dict[str, Any]) -> dict[str, Any]:
    """Tensors on an accelerator come to the host in one copy (one synchronisation), not one per tensor."""
    dev = [k for k, v in arrays.items() if _on_device(v)]
    if len(dev) < 2:
        return arrays
    ts = [arrays[k].detach().contiguous() for k in dev]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in ts]).cpu().numpy()
    out, off = dict(arrays), 0
    for k, t in zip(dev, ts):
        n = t.numel() * t.element_size()
        out[k] = flat[off:off + n].view(torch.empty(0, dtype=t.dtype).numpy().dtype).reshape(tuple(t.shape))
        off += n
    return out


def encode(arrays: dict[str, Any], scalars: dict[str, Any] | None = None) -> bytes:
    """Encode named arrays (tensors or ndarrays) and JSON scalars into FDG1 bytes."""
    arrays = _to_host(arrays)
    metas, blobs, offset = [], [], 0
    for name, v in arrays.items():
        a = _as_numpy(v)
        b = a.tobytes()
        metas.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": len(b)})
        blobs.append(b)
        offset += len(b)
    header = json.dumps({"arrays": metas, "scalars": scalars or {}}, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + b"".join(blobs)


def decode_header(data: bytes) -> tuple[dict, int]:
    if data[:4] != MAGIC:
        raise ValueError("not an FDG1 payload")
    (n,) = struct.unpack("<I", data[4:8])
    return json.loads(data[8:8 + n]), 8 + n


def decode(data: bytes) -> "Payload":
    header, start = decode_header(data)
    arrays = {}
    for m in header["arrays"]:
        a = np.frombuffer(data, dtype=np.dtype(m["dtype"]), count=int(np.prod(m["shape"], dtype=np.int64)),
                          offset=start + m["offset"])
        arrays[m["name"]] = torch.from_numpy(a.reshape(m["shape"]).copy())
    return Payload(arrays, header["scalars"])


@dataclass
class Payload:
    """What a party receives: named tensors (CPU, decoded copies) and scalars."""
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name):
        return self.arrays[name] if name in self.arrays else self.scalars[name]

    def group(self, prefix: str) -> dict[str, torch.Tensor]:
        """Arrays whose name starts with ``prefix + '/'``, with the prefix removed."""
        p = prefix + "/"
        return {k[len(p):]: v for k, v in self.arrays.items() if k.startswith(p)}


@dataclass
class Envelope:
    """One recorded transmission: what the network carried from one party to another."""
    run: str
    method: str
    round: int
    phase: str
    seq: int
    sender: str
    receiver: str
    kind: str
    arrays: list[dict]
    scalars: list[str]
    wire_bytes: int
    sha256: str
    filters: list[dict] = field(default_factory=list)
    stored: bool = True           # payload bytes kept by the run's store/store_rounds policy (set by the ledger)
    prev: str = ""                # sha256 of the previous messages.jsonl line of this run ("" = first): a hash chain

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


class Mod:
    """A mod: the hook through which the bus lets a mechanism see a party's traffic (as Flower's mods wrap a
    client's requests and replies), never the party's internals.

    ``request(party, payload)`` sees each decoded request delivered to ``party`` (on the host where that party
    lives), before the party handles it; ``__call__(kind, arrays, scalars, where)`` sees each payload a party
    sends, of the kinds the mod is registered for, where ``where = {"run", "round", "sender"}``, and returns
    ``(arrays, scalars, event)``: what is sent, and an accounting record stored in the envelope (None: nothing to
    record, e.g. a mod that passes this sender)."""

    def request(self, party: str, payload: "Payload") -> None:
        pass

    def __call__(self, kind: str, arrays: dict, scalars: dict, where: dict) -> tuple[dict, dict, dict | None]:
        return arrays, scalars, None


class Bus:
    """Records every transmission of one run in a ledger and delivers decoded copies."""

    def __init__(self, ledger, run: str, method: str, filters: dict[str, list[Mod]] | None = None,
                 declared: tuple | None = None):
        self.ledger, self.run, self.method = ledger, run, method
        self.declared = None if declared is None else set(declared)   # the method's kinds: anything else is refused
        self.filters = filters or {}
        self.round, self.seq = 0, 0
        self.sent: dict[int, int] = {}   # wire bytes per round
        self._last = None                # (bytes, header, sha256) of the last recorded payload
        self._metas: dict[tuple, list] = {}

    def encode_from(self, sender: str, kind: str, arrays: dict, scalars: dict | None = None) -> tuple[bytes, list]:
        """Apply the sender's filters and encode; used where the sender lives (maybe another process)."""
        if kind not in ARTIFACT_KINDS:
            raise ValueError(f"unknown artifact kind {kind!r}; known: {sorted(ARTIFACT_KINDS)} "
                             "(a method adds kinds with fdg_audit.bus.register_kind)")
        scalars, events = dict(scalars or {}), []
        where = {"run": self.run, "round": self.round, "sender": sender}
        for f in self.filters.get(kind, []) + self.filters.get("*", []):
            arrays, scalars, ev = f(kind, arrays, scalars, where)
            if ev:
                events.append(ev)
        return encode(arrays, scalars), events

    def deliver(self, party: str, payload: Payload) -> None:
        """Show a request delivered to ``party`` to every mod (``Mod.request``)."""
        for mod in {id(m): m for ms in self.filters.values() for m in ms}.values():
            mod.request(party, payload)

    def record(self, phase: str, sender: str, receiver: str, kind: str, data: bytes, events=(),
               deliver: bool = True) -> Payload | None:
        """Record already-encoded bytes as one envelope and return the receiver's decoded copy (None when not
        ``deliver``: the engine delivers the bytes itself). The same bytes object sent again (a broadcast) is
        hashed and its header parsed once. A party's message of a kind the method did not declare is refused (one
        line), as the conformance test would."""
        if self.declared is not None and kind not in self.declared and sender != "public":
            raise UserError(f"method {self.method} sent kind {kind!r} ({sender} -> {receiver}, phase {phase!r}), which "
                            f"it does not declare (kinds = {tuple(sorted(self.declared))}): add it to the class "
                            f"attribute kinds (methods/README.md)")
        if self._last is None or self._last[0] is not data:
            self._last = (data, decode_header(data)[0], hashlib.sha256(data).hexdigest())
        _, header, digest = self._last
        key = tuple((m["name"], m["dtype"], tuple(m["shape"])) for m in header["arrays"])
        if key not in self._metas:   # one shared list per distinct layout: the ledger's index stays small
            self._metas[key] = [{k: m[k] for k in ("name", "dtype", "shape")} for m in header["arrays"]]
        env = Envelope(self.run, self.method, self.round, phase, self.seq, sender, receiver, kind, self._metas[key],
                       sorted(header["scalars"]), len(data), digest, list(events))
        self.seq += 1
        self.sent[self.round] = self.sent.get(self.round, 0) + len(data)
        self.ledger.append(env, data)
        return decode(data) if deliver else None

    def send(self, phase: str, sender: str, receiver: str, kind: str, arrays: dict,
             scalars: dict | None = None) -> Payload:
        data, events = self.encode_from(sender, kind, arrays, scalars)
        return self.record(phase, sender, receiver, kind, data, events)

    def broadcast(self, phase: str, sender: str, receivers: list[str], kind: str, arrays: dict,
                  scalars: dict | None = None) -> dict[str, Payload]:
        """One encoding, one envelope per receiver (that is what the network carries)."""
        data, events = self.encode_from(sender, kind, arrays, scalars)
        return {r: self.record(phase, sender, r, kind, data, events) for r in receivers}
