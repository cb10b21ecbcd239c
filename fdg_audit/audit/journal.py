"""The attack journal: every finished attack job of a run folder, kept the moment it is scored, so that an
interrupted attack phase (Ctrl-C, SIGTERM, a crash) loses no finished job and ``run_attacks(resume=True)`` goes on
where it stopped.

RUN/attack_jobs/<label>/<key>/ (``key``: a hash of the attack's name, label, params and device: other settings are
another folder): ``controls.json`` (its Controls) and one ``<run>.json`` per attacked run ({"cpu": the job's CPU
seconds, "csv": its leakage.csv rows as written}), each written atomically and read as data, no link followed
(fdg_audit.store.safe). A run without a record (never finished, failed, or damaged) runs again.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

from ..attack import Control
from ..store.ledger import atomic_write
from ..store.runfolder import LEAK_FIELDS, run_tag
from ..store.safe import bounded, read_in


class Journal:
    """The kept jobs of one attack's settings; ``resume`` False drops the attack's earlier records first (its jobs
    all run again)."""

    def __init__(self, root, label: str, job: dict, resume: bool):
        key = json.dumps({k: job.get(k) for k in ("attack", "label", "params", "device")}, sort_keys=True, default=str)
        self.root = Path(root)
        self.dir = self.root / "attack_jobs" / bounded(label) / hashlib.sha256(key.encode()).hexdigest()[:16]
        if not resume:   # the attack's folder, removed inside attack_jobs/ (a link there is not followed)
            try:
                fd = os.open(self.root / "attack_jobs", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError:
                return
            try:
                shutil.rmtree(self.dir.parent.name, dir_fd=fd, ignore_errors=True)
            finally:
                os.close(fd)

    def _read(self, name: str):
        try:
            return json.loads(read_in(self.root, self.dir / name) or b"null")
        except ValueError:
            return None

    def controls(self) -> list | None:
        """The attack's kept Controls, or None."""
        try:
            return [Control(**c) for c in self._read("controls.json")]
        except TypeError:
            return None

    def job(self, run: str) -> tuple[list, float] | None:
        """A kept job of run ``run``: (its leakage.csv rows, as strings; its CPU seconds), or None."""
        got = self._read(run_tag(run) + ".json")
        try:
            return list(csv.DictReader(io.StringIO(got["csv"]))), float(got["cpu"])
        except (TypeError, KeyError, ValueError):
            return None

    def keep_controls(self, controls: list) -> None:
        self._write("controls.json", [dataclasses.asdict(c) for c in controls])

    def keep_job(self, run: str, rows: list[dict], cpu: float) -> None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, LEAK_FIELDS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        self._write(run_tag(run) + ".json", dict(cpu=cpu, csv=buf.getvalue()))

    def _write(self, name: str, record) -> None:
        atomic_write(self.dir / name, json.dumps(record), self.root)
