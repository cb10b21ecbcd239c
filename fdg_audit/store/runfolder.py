"""The run folder: every path and file of one, for writing and for reading (one module owns the layout).

    config.resolved.toml   the scenario as run (without secret split seeds)
    manifest.json          versions, commit, runs planned
    summary.json           {"scenario", "reference", "bytes", "runs": [RunInfo as a dict]}
    messages.jsonl         the hash-chained ledger (fdg_audit.store.ledger); payloads/ its bytes
    metrics.csv            per-round history of every run
    privacy.csv            spent ε per party and mechanism (DP runs)
    truth/                 ground truth the attacks never see: secrets.json, <run>/<client>/<record>.npz
    leakage.csv            one row per scored attack output (LEAK_FIELDS)
    controls.json          every attack's positive and negative controls
    attacks.json           what each attack said of itself: {label: {name, adversary, aux, consumes, outputs}}
    items/<attack>/<run>.npz      per-item values behind each leakage row (``save_items``)
    mia/<attack>/<run>.npz        raw membership scores (``save_scores``)
    recon/<attack>/<run>__<victim>__<variant>.npz   reconstruction grids (``save_grid``)

A run's record is ``RunInfo``: written by the runner into summary.json, read back by ``attack`` and ``report`` on a
finished folder, which therefore never re-plan the scenario (no re-validation against today's defaults). Everything
read from a folder is data, and every file is read and written through fdg_audit.store.safe (no link followed under
the folder, no FIFO or device, sizes checked first, long names shortened with their hash): a damaged or hostile file
is a one-line error, never a traceback, and nothing is written outside the folder.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import UserError
from .ledger import atomic_write, load_npz, read_json, read_secrets, read_summary
from .safe import bounded, entries, read_in
from ..data.base import DataConfig
from ..metrics.stats import Items
import tomllib

LEAK_FIELDS = ["run", "dataset", "method", "variant", "target", "seed", "attack", "adversary", "artifact",
               "round", "victim", "output", "metric", "value", "baseline", "status", "alignment", "baseline_kind",
               "plateau", "n_distractors", "n_same_class", "chance", "free_guess"]
ITEM_KEYS = ("run", "attack", "adversary", "artifact", "round", "victim", "output", "metric", "status")
NEEDS = {"leakage.csv": ("run", "attack", "metric", "value", "baseline", "round", "status"),
         "privacy.csv": ("run", "epsilon", "delta")}
CONTROL_KEYS = ("attack", "name", "metric", "value", "threshold", "passed")


@dataclass
class RunInfo:
    """One run as the run folder records it (summary.json's ``runs``): who, on what data, with what result.

    ``data`` is the dataset's DataConfig without a secret split seed; ``secret`` names the entry of
    truth/secrets.json that holds it ("" when the scenario set the seed itself). ``model`` is the ModelConfig."""
    run: str
    status: str
    dataset: str = ""
    method: str = ""              # the method's label in the scenario
    plugin: str = ""              # the method's registered name
    variant: str = ""
    target: str = ""
    seed: int = 0
    sweep: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    privacy: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    secret: str = ""
    model: dict = field(default_factory=dict)
    num_classes: int = 0
    channels: int = 0
    size: int = 0
    config_sha256: str = ""
    seconds: float = 0.0
    chain_head: str = ""
    selected_round: int = -1
    target_acc: float = float("nan")
    source_val_acc: float = float("nan")
    final_target_acc: float = float("nan")
    converged: bool = False
    clients: list = field(default_factory=list)
    adaptation: bool = False      # the held-out domain took part as an unlabeled client: domain adaptation, not DG
    extra: dict = field(default_factory=dict)   # Server.extra_metrics() at the selected round (e.g. personal_acc)
    error: str = ""
    traceback: str = ""

    @property
    def run_id(self) -> str:
        return self.run

    @property
    def shape(self) -> tuple:
        return (self.channels, self.size, self.num_classes)

    def protocol(self) -> dict:
        """The public protocol of the run, as an attack's view gets it (Kerckhoffs)."""
        return dict(run_id=self.run, plugin=self.plugin, params=self.params, model_cfg=self.model,
                    shape=list(self.shape), clients=list(self.clients))

    def get(self, key: str, default=None):   # rows of leakage.csv are filled from these fields
        return getattr(self, key, default)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "RunInfo":
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise UserError(f"{where}: run {d.get('run')!r} is not a run record ({e}): the run folder is damaged; "
                            "re-run the scenario") from None


class RunFolder:
    """Paths, writers and readers of one run folder."""

    def __init__(self, root):
        self.root = Path(root)

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    # ------------------------------------------------------------------------------------------- runs

    def summary(self) -> dict:
        return read_summary(self.root)

    def runs(self, ok_only: bool = True) -> dict[str, RunInfo]:
        """{run id: RunInfo} of the folder's finished runs (every run with ``ok_only=False``)."""
        where = str(self.root / "summary.json")
        infos = [RunInfo.from_dict(r, where) for r in self.summary()["runs"]]
        return {i.run: i for i in infos if i.status == "ok" or not ok_only}

    def data_config(self, info: RunInfo):
        """The run's DataConfig, with its secret split seed from truth/ (one-line error for an old or damaged
        folder)."""
        if not info.data:
            raise UserError(f"{self.root}: run {info.run} has no data record in summary.json (a folder written by "
                            "an older fdg_audit): re-run the scenario")
        names = {f.name for f in dataclasses.fields(DataConfig)}
        cfg = {k: v for k, v in info.data.items() if k in names}
        if info.secret:
            secrets = read_secrets(self.root)
            if info.secret not in secrets:
                raise UserError(f"{self.root / 'truth' / 'secrets.json'} lacks the split seed of run {info.run}: the "
                                "run folder is damaged; restore truth/ or re-run the scenario")
            cfg["split_seed"] = secrets[info.secret]
        try:
            return DataConfig(**cfg)
        except TypeError as e:
            raise UserError(f"{self.root}: run {info.run}'s data record is damaged ({e}); re-run the scenario") from None

    def truth_file(self, run: str, party: str, name: str) -> Path:
        """A ground-truth record a party wrote (e.g. the image ids behind a bank): never shown to an attack."""
        return self.root / "truth" / run / party / f"{name}.npz"

    # ------------------------------------------------------------------------------------------- attack results

    def items_file(self, label: str, run: str) -> Path:
        return self.root / "items" / bounded(label) / (run_tag(run) + ".npz")

    def mia_file(self, label: str, run: str) -> Path:
        return self.root / "mia" / bounded(label) / (run_tag(run) + ".npz")

    def recon_file(self, label: str, run: str, victim: str, variant: str) -> Path:
        return self.root / "recon" / bounded(label) / (f"{bounded(run.replace('/', '__'), 100)}__"
                                                       f"{bounded(victim_tag(victim), 50)}__"
                                                       f"{bounded(variant.replace('/', '__'), 50) or 'main'}.npz")

    def write_results(self, rows: list[dict], controls: list[dict], described: dict) -> None:
        """leakage.csv, controls.json and attacks.json after attacks ``described`` ran: their earlier rows and
        controls are replaced, every other attack's kept."""
        labels = set(described)
        old = [r for r in self.leakage(check=False) if r["attack"] not in labels]
        old_c = [c for c in self.controls() if c["attack"] not in labels] if (self / "controls.json").exists() else []
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=LEAK_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(old + rows)
        atomic_write(self / "leakage.csv", buf.getvalue(), self.root)
        atomic_write(self / "controls.json", json.dumps(old_c + controls, indent=1), self.root)
        atomic_write(self / "attacks.json", json.dumps({**self.attacks(), **described}, indent=1, sort_keys=True),
                     self.root)

    def save_scores(self, label: str, run: str, scores: list, members: dict) -> None:
        """Raw membership scores for ROC plots and pooling across runs: one entry per candidate: ``score``
        (float64, higher = member), ``member`` (int8 truth), ``victim``, ``variant`` (str), ``round`` (int64)."""
        if not scores:
            return
        rep = lambda f: np.concatenate([np.repeat(f(o), len(o.scores)) for o in scores])  # noqa: E731
        buf = io.BytesIO()
        np.savez_compressed(buf, score=np.concatenate([np.asarray(o.scores, np.float64) for o in scores]),
                            member=np.concatenate([members[o.victim] for o in scores]).astype(np.int8),
                            victim=rep(lambda o: o.victim), variant=rep(lambda o: o.variant),
                            round=rep(lambda o: o.round).astype(np.int64))
        atomic_write(self.mia_file(label, run), buf.getvalue(), self.root)

    def save_items(self, label: str, run: str, rows: list) -> None:
        """Per-item values behind each scored row (fdg_audit.metrics.stats): ``meta`` (a JSON list, one entry per
        row: the leakage.csv keys, the item kind, and which arrays it has) and arrays ``<j>/<x|y|ids>`` (the
        attack's values) and ``<j>/b<x|y|ids>`` (its baseline's, when the baseline varies per item; else the
        baseline is the constant in leakage.csv)."""
        meta, arrays = [], {}
        for r in rows:
            if r.get("items") is None:
                continue
            j = len(meta)
            b = r.get("base_items")
            meta.append({k: r.get(k, "") for k in ITEM_KEYS} | {"kind": r["items"].kind, "base": b and b.kind})
            for pre, it in (("", r["items"]), ("b", b)):
                if it is not None:
                    arrays |= {f"{j}/{pre}{f}": np.asarray(getattr(it, f)) for f in ("x", "y", "ids")
                               if getattr(it, f) is not None}
        if not meta:
            return
        buf = io.BytesIO()
        np.savez_compressed(buf, meta=np.array(json.dumps(meta, default=str)), **arrays)
        atomic_write(self.items_file(label, run), buf.getvalue(), self.root)

    def save_grid(self, label: str, run: str, victim: str, variant: str, images: tuple, n: int = 8) -> None:
        x, r, b = images
        buf = io.BytesIO()
        np.savez_compressed(buf, truth=x[:n].numpy(), recon=r[:n].numpy(), baseline=b[:n].cpu().float().numpy())
        atomic_write(self.recon_file(label, run, victim, variant), buf.getvalue(), self.root)

    # ------------------------------------------------------------------------------------------- readers

    def csv(self, name: str, check: bool = True) -> list[dict]:
        """A CSV file of the folder ([] when absent); one without its columns (NEEDS) is a one-line error."""
        path = self.root / name
        data = read_in(self.root, path)
        if data is None:
            return []
        try:
            rows = csv.DictReader(io.StringIO(data.decode(), newline=""))
            missing = [c for c in NEEDS.get(name, ()) if c not in (rows.fieldnames or [])]
            rows = list(rows)
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise UserError(f"{path} cannot be read as CSV ({e}): the run folder is damaged; restore it or re-run") \
                from None
        if missing and check:
            raise UserError(f"{path} lacks the column(s) {', '.join(missing)}: the run folder is damaged; restore the "
                            f"file or re-run `fdg_audit attack {self.root}`")
        return rows

    def leakage(self, check: bool = True) -> list[dict]:
        return self.csv("leakage.csv", check)

    def privacy(self) -> list[dict]:
        return self.csv("privacy.csv")

    def controls(self) -> list[dict]:
        """controls.json: a list of {attack, name, metric, value, threshold, passed}; anything else is one line."""
        path = self / "controls.json"
        if not path.exists():
            return []
        c = read_json(path, "attack controls file", self.root)
        if not (isinstance(c, list) and all(isinstance(x, dict) and all(k in x for k in CONTROL_KEYS) for x in c)):
            raise UserError(f"{path} is not a list of attack controls ({', '.join(CONTROL_KEYS)}): the run folder is "
                            f"damaged; re-run `fdg_audit attack {self.root}`")
        return c

    def attacks(self) -> dict:
        """attacks.json: {label: {name, adversary, aux, consumes, outputs}} ({} when absent); plain strings only."""
        path = self / "attacks.json"
        if not path.exists():
            return {}
        a = read_json(path, "attack descriptions file", self.root)
        strs = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)  # noqa: E731
        ok = isinstance(a, dict) and all(
            isinstance(d, dict) and isinstance(d.get("name"), str) and isinstance(d.get("adversary"), str)
            and strs(d.get("aux")) and strs(d.get("consumes")) and isinstance(d.get("outputs"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in d["outputs"].items()) for d in a.values())
        if not ok:
            raise UserError(f"{path} is not a table of attack descriptions: the run folder is damaged; re-run "
                            f"`fdg_audit attack {self.root}`")
        return a

    @cached_property
    def config(self) -> dict:
        """config.resolved.toml as a table, read once ({} when missing or damaged)."""
        try:
            return tomllib.loads((read_in(self.root, "config.resolved.toml") or b"").decode())
        except (UnicodeDecodeError, tomllib.TOMLDecodeError):
            return {}

    def reference_values(self) -> dict:
        """The [reference] table of config.resolved.toml (published numbers; validated when planned)."""
        ref = self.config.get("reference", {})
        return ref if isinstance(ref, dict) and isinstance(ref.get("values", {}), dict) else {}

    def left_out(self) -> tuple[list[str], list[str]]:
        """(the attacks config.resolved.toml's [[attacks]] tables exclude, its see_also lines); strings only, so a
        damaged or hostile folder adds nothing else."""
        raw = self.config
        tables = raw.get("attacks") if isinstance(raw.get("attacks"), list) else []
        out = [x for t in tables if isinstance(t, dict) and isinstance(t.get("exclude"), list)
               for x in t["exclude"] if isinstance(x, str)]
        see = raw.get("see_also") if isinstance(raw.get("see_also"), list) else []
        return list(dict.fromkeys(out)), [x for x in see if isinstance(x, str)]

    def result_files(self, kind: str, runs: set) -> list[dict]:
        """The files under ``kind`` ("items" | "mia" | "recon") of the runs ``runs``: dicts with attack, run, path
        (and victim, variant for "recon"); files of other runs or with names no run writes are ignored."""
        out = []
        safe = {bounded(r.replace("/", "__"), 100) if kind == "recon" else run_tag(r): r for r in runs}
        files = [self / kind / a / f for a in entries(self.root, kind, folders=True)
                 for f in entries(self.root, f"{kind}/{a}") if f.endswith(".npz")]   # no link, no FIFO
        for p in files:
            if kind != "recon":
                if p.stem in safe:
                    out.append(dict(attack=p.parent.name, run=safe[p.stem], path=p, root=self.root))
                continue
            for s in sorted(safe, key=len, reverse=True):   # <run>__<victim>__<variant>
                if p.stem.startswith(s + "__"):
                    rest = p.stem[len(s) + 2:].split("__")
                    out.append(dict(attack=p.parent.name, run=safe[s], victim=rest[0].replace("@", "/"),
                                    variant="__".join(rest[1:]) or "main", path=p, root=self.root))
                    break
        return out


def run_tag(run: str) -> str:
    """A run id in a file name: "/" as "__", a long one shortened with its hash (``bounded``)."""
    return bounded(run.replace("/", "__"), 150)


def victim_tag(victim: str) -> str:
    """A victim's name in a file name: client ids "rot15/0" -> "rot15@0"; a union of more than four clients (a
    curious client's "a+b+...+z") -> "a+<n>more+z", so that 120 client ids stay under the file-name limit."""
    parts = victim.replace("/", "@").split("+")
    return "+".join(parts) if len(parts) <= 4 else f"{parts[0]}+{len(parts) - 2}more+{parts[-1]}"


def load_items(path, root=None) -> list[dict]:
    """The rows of one ``items/<attack>/<run>.npz`` of run folder ``root``: leakage keys plus ``items`` and ``base``
    (Items or None)."""
    out, z = [], load_npz(Path(path), root)
    try:
        meta = json.loads(str(z["meta"]))
        for j, m in enumerate(meta):
            get = lambda pre, f: z.get(f"{j}/{pre}{f}")  # noqa: E731
            it = lambda pre, kind: Items(kind, get(pre, "x"), get(pre, "y"), get(pre, "ids"))  # noqa: E731
            out.append(dict(m, items=it("", m["kind"]), base=it("b", m["base"]) if m["base"] else None))
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{path} is not an attack's per-item file ({type(e).__name__}: {e}): the run folder is "
                        "damaged; re-run the attacks") from None
    return out
