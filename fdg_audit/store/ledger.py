"""Append-only record of envelopes (``messages.jsonl``) plus a content-addressed payload store.

A payload is stored once under ``payloads/<sha[:2]>/<sha>`` however many envelopes carry it (a broadcast
sends the same bytes to every receiver). ``Ledger.open(run_dir)`` re-reads a finished run folder, which is
how attacks run again later.

Tamper evidence: every envelope carries ``prev``, the sha256 of the previous ``messages.jsonl`` line of the same
run (a hash chain per run), and ``summary.json`` records each finished run's last line hash (``chain_head``).
``Ledger.verify`` finds a deleted, reordered, edited or foreign line and names the run and the line; a payload
that is missing or edited is found when it is read. Each line is appended with one ``write`` call; a torn last
line (a kill mid-write) is dropped on reading and reported as an interrupted run (``Ledger.torn``).

Memory: a ledger that writes a run folder keeps no envelope in memory (only a line count and each run's chain
head), so the driver does not grow with rounds; ``envelopes`` / ``stream()`` read them back from ``messages.jsonl``.
A ledger re-opened with ``Ledger.open`` (attacks, reports) and ``MemoryLedger`` (shadow runs) hold them in a list.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np

from ..bus import Envelope, Payload, decode
from ..errors import UserError
from .safe import MAX_FILE_BYTES, read_in, write_in

_FIELDS = {f.name: f for f in dataclasses.fields(Envelope)}
_TYPES = {"run": str, "method": str, "round": int, "phase": str, "seq": int, "sender": str, "receiver": str,
          "kind": str, "arrays": list, "scalars": list, "wire_bytes": int, "sha256": str, "filters": list,
          "stored": bool, "prev": str}


def atomic_write(path: Path, data: bytes | str, root: Path | None = None) -> None:
    """Write via a temporary file of the writer's own and rename, so a crash never leaves a half-written file and two
    processes writing the same payload do not collide; no link is followed under ``root`` (the run or report folder;
    default the file's folder) and a link at ``path`` is replaced (fdg_audit.store.safe)."""
    write_in(Path(path).parent if root is None else root, path, data)


def line_hash(line: str | bytes) -> str:
    return hashlib.sha256(line.encode() if isinstance(line, str) else line).hexdigest()


def read_json(path: Path, what: str = "file", root: Path | None = None):
    """A JSON file of a run folder (``root``; default the file's folder) opened as data (fdg_audit.store.safe); a
    missing or damaged one is a one-line error naming it."""
    path = Path(path)
    data = read_in(path.parent if root is None else root, path)
    if data is None:
        raise UserError(f"{path} is missing: the {what} is damaged; restore it or re-run the scenario")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({str(e).splitlines()[0]}): the {what} is damaged; restore it "
                        "or re-run the scenario") from None


def read_secrets(root: Path) -> dict:
    """The secret split seeds of a run folder (truth/secrets.json; none in a folder written before them)."""
    f = Path(root) / "truth" / "secrets.json"
    if not f.exists():
        return {}
    s = read_json(f, "secret split seeds", root)
    if not isinstance(s, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                          for v in s.values()):
        raise UserError(f"{f} is not a table of split seeds: the run folder is damaged; re-run the scenario")
    return s


def read_summary(root: Path) -> dict:
    """``summary.json`` of a run folder, checked to be a {"runs": [{"run", "status", ...}]} table."""
    f = Path(root) / "summary.json"
    if not f.exists():
        raise UserError(f"{Path(root)} has no summary.json: pass a run folder written by `fdg_audit scenario` "
                        "(runs/<scenario>/<timestamp>)")
    s = read_json(f, "run folder's summary", root)
    if not (isinstance(s, dict) and isinstance(s.get("runs"), list) and all(
            isinstance(r, dict) and isinstance(r.get("run"), str) and isinstance(r.get("status"), str)
            for r in s["runs"])):
        raise UserError(f"{f} is not a run summary (it needs a \"runs\" list of entries with \"run\" and \"status\"):"
                        " the run folder is damaged; restore summary.json or re-run the scenario")
    bad = next((r["run"] for r in s["runs"] if not safe_run_id(r["run"])), None)
    if bad is not None:
        raise UserError(f"{f} names run {bad!r}, which is not a run id (<dataset>/<method>/<target>/s<seed>, no empty, "
                        "'.' or '..' part): the run folder is damaged or hostile; re-run the scenario")
    return s


def safe_run_id(run: str) -> bool:
    """Run ids become paths (truth/<run>/...): relative, with no empty, '.' or '..' part, backslash or NUL."""
    parts = run.split("/")
    return len(parts) >= 2 and all(p not in ("", ".", "..") for p in parts) and not set(run) & {"\\", "\x00"}


HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_LEDGER = 2 ** 36       # bytes of a messages.jsonl read back


def load_npz(path: Path, root: Path | None = None) -> dict:
    """The arrays of an ``.npz`` file of folder ``root`` (default its own folder; opened as data,
    fdg_audit.store.safe: no pickled objects, each array's declared size checked before it is read: at most
    MAX_FILE_BYTES together); a missing or damaged file is a one-line error naming it."""
    data = read_in(Path(path).parent if root is None else root, path)
    if data is None:
        raise UserError(f"{path} is missing: the run folder is damaged; restore the file or re-run the scenario")
    try:
        total = 0
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for info in zf.infolist():
                with zf.open(info) as f:
                    read = {(1, 0): np.lib.format.read_array_header_1_0,
                            (2, 0): np.lib.format.read_array_header_2_0}.get(np.lib.format.read_magic(f))
                    if read is None:
                        raise ValueError(f"{info.filename} is not a .npy array of format 1.0 or 2.0")
                    shape, _, dtype = read(f)
                    total += int(np.prod(shape, dtype=object)) * dtype.itemsize
                    if dtype.hasobject or total > MAX_FILE_BYTES:
                        raise ValueError(f"{info.filename} declares {'objects' if dtype.hasobject else f'{total} bytes'}")
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise UserError(f"{path} cannot be read as plain arrays ({str(e).splitlines()[0]}): the run folder is "
                        "damaged; restore the file or re-run the scenario") from None


def npz_bytes(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def parse_envelope(line: bytes | str, where: str) -> Envelope:
    """One ``messages.jsonl`` line as an Envelope; anything else is a one-line error naming ``where``."""
    try:
        d = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{where} is not valid JSON ({e}): the run folder is damaged; restore messages.jsonl or "
                        "re-run the scenario") from None
    if not isinstance(d, dict):
        raise UserError(f"{where} is not an envelope (not a JSON object): the run folder is damaged; restore "
                        "messages.jsonl or re-run the scenario")
    missing = [k for k, f in _FIELDS.items() if k not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    bad = [k for k in d if k not in _TYPES or not isinstance(d[k], _TYPES[k])
           or _TYPES[k] is int and isinstance(d[k], bool)]
    if missing or bad:
        raise UserError(f"{where} is not an envelope ({'missing' if missing else 'bad'} field {(missing or bad)[0]!r}):"
                        " the run folder is damaged; restore messages.jsonl or re-run the scenario")
    if not HEX64.fullmatch(d["sha256"]) or d.get("prev", "") and not HEX64.fullmatch(d["prev"]):
        raise UserError(f"{where}: its sha256 or prev is not 64 hexadecimal digits: the run folder is damaged; "
                        "restore messages.jsonl or re-run the scenario")
    return Envelope(**d)


class Ledger:
    _by_run: tuple = (None, 0, {})   # select's index of the opened envelopes by run: (the list, its length, index)

    def __init__(self, root: str | Path, store: str | list[str] = "all", rounds: list[int] = (),
                 file: str = "messages.jsonl"):
        """``store``: "all", "none" or a list of artifact kinds whose payload bytes are kept; ``rounds``: if
        given, only payloads of these rounds are kept. Envelopes (with sizes and hashes) are always recorded.
        ``file``: where the lines go (a parallel run's worker writes its own, which the driver then appends)."""
        self.root = Path(root)
        self.file = self.root / file
        self.root.mkdir(parents=True, exist_ok=True)
        self.store, self.rounds = store, list(rounds)
        self._envs: list[Envelope] | None = None     # None: envelopes live in messages.jsonl only (streamed)
        self.lines: list[tuple[int, str]] = []       # (line number, line sha256) of each envelope (opened ledgers)
        self.count = 0                                # lines in messages.jsonl
        self.heads: dict[str, str] = {}               # run -> sha256 of its last line
        self.torn = 0                                 # line number of a torn (dropped) last line, 0 = none
        self._fd = None

    @property
    def envelopes(self) -> list[Envelope]:
        """Every envelope: the opened ledger's list, or (a writing ledger) read back from messages.jsonl."""
        return self._envs if self._envs is not None else list(self.stream())

    @envelopes.setter
    def envelopes(self, envs: list[Envelope]) -> None:
        self._envs = envs

    def stream(self):
        """The envelopes one at a time, read from messages.jsonl (or the in-memory list of an opened ledger)."""
        if self._envs is not None:
            yield from self._envs
            return
        f = self.root / "messages.jsonl"
        if not f.exists():
            return
        with open(f, "rb") as fh:
            for n, line in enumerate(fh, 1):
                if line.endswith(b"\n") and line.strip():
                    yield parse_envelope(line, f"{self.root.name}/messages.jsonl line {n}")

    def _keep(self, env: Envelope) -> bool:
        kind_ok = self.store == "all" or (isinstance(self.store, list) and env.kind in self.store)
        return kind_ok and (not self.rounds or env.round in self.rounds)

    def stored(self, env: Envelope) -> bool:
        return env.stored

    def payload_path(self, sha: str) -> Path:
        return self.root / "payloads" / sha[:2] / sha

    def append(self, env: Envelope, data: bytes) -> None:
        p = self.payload_path(env.sha256)
        if self._keep(env) and not p.exists():
            atomic_write(p, data, self.root)
        env.stored, env.prev = p.exists(), self.heads.get(env.run, "")
        self.append_line(env.to_json(), env.run)

    def append_line(self, line: str, run: str | None = None) -> None:
        """Append one envelope line as is (its ``prev`` already set) and move its run's chain head."""
        if self._fd is None:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        os.write(self._fd, (line + "\n").encode())      # one write: a kill leaves at most a torn last line
        self.heads[run or json.loads(line)["run"]] = line_hash(line)
        self.count += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @classmethod
    def open(cls, run_dir: str | Path, keep: set | None = None) -> "Ledger":
        """Re-read a run folder's envelopes (``keep``: only these runs). A torn last line is dropped and its
        number kept in ``torn``; any other line that is not an envelope is a one-line error."""
        run_dir = Path(run_dir)
        f = run_dir / "messages.jsonl"
        if not f.exists():
            raise UserError(f"{f} not found: pass a finished run folder (runs/<scenario>/<timestamp>)")
        led = cls.__new__(cls)
        led.root, led.store, led.rounds, led._fd, led.count = run_dir, "all", [], None, 0
        led.envelopes, led.lines, led.heads, led.torn = [], [], {}, 0
        raw = read_in(run_dir, f, MAX_LEDGER).split(b"\n")
        if raw[-1]:
            led.torn = len(raw)
        for n, line in enumerate(raw[:-1], 1):
            if not line.strip():
                continue
            env = parse_envelope(line, f"{run_dir.name}/messages.jsonl line {n}")
            led.count += 1
            if keep is None or env.run in keep:
                led.envelopes.append(env)
                led.lines.append((n, line_hash(line)))
        return led

    def verify(self, heads: dict[str, str]) -> None:
        """Check every run's hash chain, and that each run in ``heads`` (run -> summary's ``chain_head``) ends at
        the recorded line. A deleted, reordered, edited or foreign line is a one-line error naming run and line."""
        last: dict[str, tuple[str, int]] = {}
        for env, (n, h) in zip(self.envelopes, self.lines):
            prev, pn = last.get(env.run, ("", 0))
            if env.prev != prev:
                after = f"line {pn}, the run's previous line" if pn else "the start of the run"
                raise UserError(f"{self.root.name}/messages.jsonl line {n} (run {env.run}) does not chain to {after}: "
                                "a line was deleted, reordered, edited or inserted there; the run folder is damaged "
                                "(restore it or re-run the scenario)")
            last[env.run] = (h, n)
        for run, head in heads.items():
            h, n = last.get(run, ("", 0))
            if h != head:
                raise UserError(f"{self.root.name}/messages.jsonl: run {run} ends at line {n or 'none'}, not at the last "
                                "line summary.json records: its last lines were deleted or edited; the run folder is "
                                "damaged (restore it or re-run the scenario)")

    def raw(self, env: Envelope) -> bytes:
        p = self.payload_path(env.sha256)
        if not env.stored:
            raise UserError(f"payload of {env.kind} (round {env.round}, {env.sender}->{env.receiver}) was not "
                            f"stored: rerun with store = \"all\" (or a list with {env.kind!r}), store_rounds = [] and "
                            f"attack_seeds = [] (or a list with the run's seed)")
        if not os.path.lexists(p):
            raise UserError(f"{self.root.name}: the payload of {env.kind} (run {env.run}, round {env.round}, seq "
                            f"{env.seq}, {env.sender}->{env.receiver}) is missing from payloads/: the run folder is "
                            "damaged (restore it or re-run the scenario)")
        data = read_in(self.root, p) or b""
        if hashlib.sha256(data).hexdigest() != env.sha256:
            raise UserError(f"{self.root.name}: payload {p.name[:12]}... of {env.kind} (run {env.run}, round "
                            f"{env.round}, seq {env.seq}) does not match its envelope's sha256: the run folder is "
                            "damaged (restore it or re-run the scenario)")
        return data

    def payload(self, env: Envelope) -> Payload:
        return decode(self.raw(env))

    def select(self, **match) -> list[Envelope]:
        """Envelopes whose fields equal every given value (a list/tuple value means 'any of'), in ledger order. On an
        opened ledger, ``run=<id>`` reads only that run's envelopes (an index built once: a main job's attack phase
        selects each run's envelopes once per attack, and a scan of all 50,000 cost 0.12 s a call)."""
        def ok(e):
            return all(getattr(e, k) in v if isinstance(v, (list, tuple, set)) else getattr(e, k) == v
                       for k, v in match.items())
        envs = self.stream()
        if self._envs is not None and isinstance(match.get("run"), str):
            if self._by_run[0] is not self._envs or self._by_run[1] != len(self._envs):
                index: dict[str, list[Envelope]] = {}
                for e in self._envs:
                    index.setdefault(e.run, []).append(e)
                self._by_run = (self._envs, len(self._envs), index)
            envs = self._by_run[2].get(match["run"], [])
        return [e for e in envs if ok(e)]


def open_verified(root: Path, summary: dict | None = None) -> Ledger:
    """The envelopes of a run folder's finished runs, every hash chain checked against summary.json."""
    summary = summary or read_summary(root)
    ok = [r for r in summary["runs"] if r["status"] == "ok"]
    legacy = [r["run"] for r in ok if not r.get("chain_head")]
    if legacy:
        raise UserError(f"{Path(root).name}/summary.json records no chain_head for run {legacy[0]}: the folder was "
                        "written before hash chains or edited; re-run the scenario")
    led = Ledger.open(root)
    planned = {r["run"] for r in summary["runs"]}
    if (Path(root) / "manifest.json").exists():
        planned |= set(read_json(Path(root) / "manifest.json", "manifest.json", root).get("runs", []))
    stray = next(((n, e.run) for e, (n, _) in zip(led.envelopes, led.lines) if e.run not in planned), None)
    if stray:
        raise UserError(f"{Path(root).name}/messages.jsonl line {stray[0]} belongs to run {stray[1]!r}, which this "
                        "folder never planned: the run folder is damaged or was appended to (restore it or re-run "
                        "the scenario)")
    led.verify({r["run"]: r["chain_head"] for r in ok})
    keep = [i for i, e in enumerate(led.envelopes) if e.run in {r["run"] for r in ok}]
    led.envelopes, led.lines = [led.envelopes[i] for i in keep], [led.lines[i] for i in keep]
    return led


def run_status(root: Path) -> dict:
    """Planned (manifest.json), finished, failed and missing runs of a run folder, after checking that its summary,
    hash chains and saved arrays are intact (one-line errors otherwise); ``torn``: the line a kill cut short."""
    root = Path(root)
    summary = read_summary(root)
    chained = all(r.get("chain_head") for r in summary["runs"] if r["status"] == "ok")
    led = None if not (root / "messages.jsonl").exists() else open_verified(root, summary) if chained else \
        Ledger.open(root)
    for f in sorted(root.glob("mia/*/*.npz")) + sorted(root.glob("recon/*/*.npz")):
        load_npz(f, root)
    manifest = read_json(root / "manifest.json", "run folder's manifest", root) if (root / "manifest.json").exists() else {}
    seen = {r["run"]: r["status"] for r in summary["runs"]}
    planned = manifest.get("runs") if isinstance(manifest, dict) and isinstance(manifest.get("runs"), list) else []
    planned = list(dict.fromkeys(list(planned) + list(seen)))
    return dict(root=root, planned=planned, finished=[r for r in planned if seen.get(r) == "ok"],
                failed=[r for r in planned if r in seen and seen[r] != "ok"],
                missing=[r for r in planned if r not in seen], torn=led.torn if led is not None else 0,
                source=manifest.get("source", "FILE"), chained=chained)


def status_lines(run_dirs) -> list[str]:
    """Report lines: per folder, planned, finished, failed and missing runs, and how to finish an interrupted one."""
    out = []
    for d in run_dirs:
        st = run_status(d)
        out.append(f"- `{st['root']}`: {len(st['planned'])} runs planned, {len(st['finished'])} finished, "
                   f"{len(st['failed'])} failed, {len(st['missing'])} missing"
                   + ("" if st["chained"] else " (no hash chain recorded: messages.jsonl not verified)"))
        if st["missing"] or st["torn"]:
            out.append(f"  - interrupted{' (torn last line ' + str(st['torn']) + ' of messages.jsonl)' if st['torn'] else ''}"
                       f"; missing: {', '.join(f'`{r}`' for r in st['missing']) or 'none'}; finish with "
                       f"`python -m fdg_audit scenario {st['source']} --resume {st['root']}`")
    return out


class MemoryLedger(Ledger):
    """A ledger that keeps envelopes and payloads in memory: for federations an attacker runs itself
    (reference/shadow runs), whose records never belong in a run folder."""

    def __init__(self):
        self.root, self.store, self.envelopes, self._fd, self._blobs, self.count = None, "all", [], None, {}, 0

    def append(self, env: Envelope, data: bytes) -> None:
        self._blobs.setdefault(env.sha256, data)
        self.envelopes.append(env)

    def raw(self, env: Envelope) -> bytes:
        return self._blobs[env.sha256]

    def stored(self, env: Envelope) -> bool:
        return True
