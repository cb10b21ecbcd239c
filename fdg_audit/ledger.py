"""Append-only record of envelopes (``messages.jsonl``) plus a content-addressed payload store.

A payload is stored once under ``payloads/<sha[:2]>/<sha>`` however many envelopes carry it (a broadcast
sends the same bytes to every receiver). ``Ledger.open(run_dir)`` re-reads a finished run folder, which is
how attacks run again later.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .bus import Envelope, Payload, decode
from .errors import UserError


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write via a temporary file and rename, so a crash never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


class Ledger:
    def __init__(self, root: str | Path, store: str | list[str] = "all", rounds: list[int] = ()):
        """``store``: "all", "none" or a list of artifact kinds whose payload bytes are kept; ``rounds``: if
        given, only payloads of these rounds are kept. Envelopes (with sizes and hashes) are always recorded."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.store, self.rounds = store, list(rounds)
        self.envelopes: list[Envelope] = []
        self._fh = None

    def _keep(self, env: Envelope) -> bool:
        kind_ok = self.store == "all" or (isinstance(self.store, list) and env.kind in self.store)
        return kind_ok and (not self.rounds or env.round in self.rounds)

    def stored(self, env: Envelope) -> bool:
        return self.payload_path(env.sha256).exists()

    def payload_path(self, sha: str) -> Path:
        return self.root / "payloads" / sha[:2] / sha

    def append(self, env: Envelope, data: bytes) -> None:
        if self._keep(env):
            p = self.payload_path(env.sha256)
            if not p.exists():
                atomic_write(p, data)
        if self._fh is None:
            self._fh = open(self.root / "messages.jsonl", "a")
        self._fh.write(env.to_json() + "\n")
        self._fh.flush()
        self.envelopes.append(env)

    def close(self) -> None:
        if self._fh:
            self._fh.close()
            self._fh = None

    @classmethod
    def open(cls, run_dir: str | Path) -> "Ledger":
        run_dir = Path(run_dir)
        f = run_dir / "messages.jsonl"
        if not f.exists():
            raise UserError(f"{f} not found: pass a finished run folder (runs/<scenario>/<timestamp>)")
        led = cls.__new__(cls)
        led.root, led.store, led._fh = run_dir, "all", None
        led.envelopes = [Envelope(**json.loads(line)) for line in f.read_text().splitlines() if line.strip()]
        return led

    def raw(self, env: Envelope) -> bytes:
        p = self.payload_path(env.sha256)
        if not p.exists():
            raise UserError(f"payload of {env.kind} (round {env.round}, {env.sender}->{env.receiver}) was not "
                            f"stored: rerun with store = \"all\" (or a list with {env.kind!r}) and store_rounds = []")
        data = p.read_bytes()
        if hashlib.sha256(data).hexdigest() != env.sha256:
            raise UserError(f"{p} does not match its envelope's sha256: the run folder is corrupted")
        return data

    def payload(self, env: Envelope) -> Payload:
        return decode(self.raw(env))

    def select(self, **match) -> list[Envelope]:
        """Envelopes whose fields equal every given value (a list/tuple value means 'any of')."""
        def ok(e):
            return all(getattr(e, k) in v if isinstance(v, (list, tuple, set)) else getattr(e, k) == v
                       for k, v in match.items())
        return [e for e in self.envelopes if ok(e)]


class MemoryLedger(Ledger):
    """A ledger that keeps envelopes and payloads in memory: for federations an attacker runs itself
    (reference/shadow runs), whose records never belong in a run folder."""

    def __init__(self):
        self.root, self.store, self.envelopes, self._fh, self._blobs = None, "all", [], None, {}

    def append(self, env: Envelope, data: bytes) -> None:
        self._blobs.setdefault(env.sha256, data)
        self.envelopes.append(env)

    def raw(self, env: Envelope) -> bytes:
        return self._blobs[env.sha256]

    def stored(self, env: Envelope) -> bool:
        return True
