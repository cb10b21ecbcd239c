"""Audit a Flower app: record what its federation sends into an fdg_audit run folder, then ``attack`` and ``report`` it.

Nothing in the core imports this module (it needs ``pip install 'fdg_audit[flower]'``). The user's app changes in
four places (README, "Audit your own Flower app in five steps"; examples/flower_fedavg/ is a whole app):

    rec = FlowerRecorder("runs/flower/my_app", data=DataConfig(...), target="rot75", seed=0,
                         method="fedavg", settings={"lr": 0.05, ...}, kinds={"amp": "amplitude_bank"})
    client_app = ClientApp(mods=[rec.client_mod])       # the outermost mod: it sees what leaves the client
    declare(context, "rot30/2", idx=ids)                # in the ClientApp: what this client trains on (truth/)
    grid = rec.wrap(grid); strategy.start(grid=grid, ..., evaluate_fn=rec.evaluate_fn); rec.finish()

What is recorded: every Message the ServerApp's Grid sends or receives (instructions and replies: what a network
between server and clients carries), one envelope per record of its RecordDict, through the native bus and ledger
(fdg_audit.bus, fdg_audit.store.ledger): the same FDG1 codec (so ``wire_bytes`` is the record's FDG1 size: its arrays'
bytes exactly, plus one JSON header), the same content-addressed payloads and per-run hash chain, so a recorded
folder has the tamper evidence of a native one. Round = the Message's ``group_id`` (Flower's strategies put the
server round there), phase = its ``message_type`` ("train", "evaluate", ...), sender and receiver "server" or the
client's name (what it ``declare``d; "node<id>" until it does). Kinds: an ArrayRecord is ``weights`` unless ``kinds``
names it (e.g. "amp" -> "amplitude_bank"); a ConfigRecord is ``config`` (or its ``kinds`` entry); a MetricRecord is
``metric``, except its ``sizes_key`` entry (Flower's "num-examples", the n_k FedAvg weights by), recorded apart as
``n_samples`` {"n": n_k}, the kind native methods send it as and attacks read.

Ground truth never reaches an attack: ``declare`` writes truth/<run>/<client>/<record>.npz as a native client's
``record_truth`` does; the "train" ids a client declares must be its part of the recorder's data set (checked by
``finish``), so the scorer's truth (built from the data set, as for native runs) is what the client trained on.
The client mod also keeps a receipt of each record it received and sent (flower/receipts/, never read by attacks);
``finish`` checks every receipt against the ledger, so a mod placed outside the recorder that changes a reply, or a
reply lost on the way, is one line, not a silent gap.

Limits: clients write truth and receipts into the run folder, so it must be on a file system they share (Flower's
simulation engine; a deployment's clients would need the folder mounted). Clients are named by a data set fdg_audit
loads (DataConfig); image tensors of another data set cannot be declared yet.
"""
from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .bus import Bus, encode, register_kind
from .data import DataConfig, load_data
from .errors import UserError
from .models import ModelConfig, build_model
from .params import TrainParams, safe_name
from .protocol import load_method
from .protocol import accuracy
from .report.traffic import bytes_summary
from .scenario import dump_toml, parse
from .store.ledger import Ledger, atomic_write, load_npz, npz_bytes
from .store.runfolder import RunFolder, RunInfo
from .train.federation import cat_splits, select_round
from .train.runs import git_commit, write_csv

try:
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
    from flwr.serverapp import Grid
except ImportError as e:   # pragma: no cover - the module is only imported by users of the [flower] extra
    raise ImportError("fdg_audit.flower needs Flower: pip install 'fdg_audit[flower]' (after torch)") from e

__all__ = ["FlowerRecorder", "declare", "records_of"]
register_kind("config")   # a Flower ConfigRecord (e.g. the server round and local settings the strategy sends)
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fdg_audit_flower", default=None)
SERVER = "server"


def records_of(msg, kinds: dict, sizes_key: str) -> list[tuple[str, bytes]]:
    """(kind, FDG1 bytes) of each record of a Message's content, in its order (MetricRecord's ``sizes_key`` apart as
    ``n_samples``); nothing for a Message without content (an error reply)."""
    if not msg.has_content():
        return []
    out = []
    for name, rec in msg.content.items():
        if isinstance(rec, ArrayRecord):
            out.append((kinds.get(name, "weights"), encode({k: a.numpy() for k, a in rec.items()})))
            continue
        scalars = {k: _plain(v) for k, v in rec.items()}
        if isinstance(rec, MetricRecord) and sizes_key in scalars:
            out.append(("n_samples", encode({}, {"n": scalars.pop(sizes_key)})))
        if scalars or not isinstance(rec, MetricRecord):
            out.append((kinds.get(name, "config" if isinstance(rec, ConfigRecord) else "metric"), encode({}, scalars)))
    return out


def _plain(v):
    """A record value as JSON: bytes as a list of byte values (a ConfigRecord may carry bytes)."""
    if isinstance(v, (bytes, bytearray)):
        return list(bytes(v))
    return [_plain(x) for x in v] if isinstance(v, list) else v


def _round(msg, default: int = 0) -> int:
    """The server round of a Message: its ``group_id`` when that is a number, else the "server-round" of its
    ConfigRecord (which Flower's strategies always send), else ``default`` (a reply: its instruction's round)."""
    g = str(msg.metadata.group_id or "")
    if g.isdigit():
        return int(g)
    if msg.has_content():
        r = next((c["server-round"] for c in msg.content.config_records.values() if "server-round" in c), None)
        if isinstance(r, int) and not isinstance(r, bool):
            return r
    return default


# ------------------------------------------------------------------------------------------- client side

class ClientMod:
    """The client mod (Flower's ``Mod``): makes ``declare`` work inside the ClientApp and keeps a receipt (kind,
    sha256) of every record the client received and sent, in flower/receipts/<node>.jsonl. Plain data only, so
    Flower's simulation engine can ship it to its workers."""

    def __init__(self, root: str, run: str, kinds: dict, sizes_key: str):
        self.root, self.run, self.kinds, self.sizes_key = root, run, dict(kinds), sizes_key

    def __call__(self, msg, context, call_next):
        node, rnd = int(context.node_id), _round(msg)
        self._receipt(node, "in", msg, rnd)
        token = _ACTIVE.set((self, node))
        try:
            reply = call_next(msg, context)
        finally:
            _ACTIVE.reset(token)
        self._receipt(node, "out", reply, _round(reply, rnd))
        return reply

    def _receipt(self, node: int, way: str, msg, rnd: int) -> None:
        line = json.dumps({"way": way, "round": rnd, "type": msg.metadata.message_type,
                           "records": [[k, hashlib.sha256(b).hexdigest()]
                                       for k, b in records_of(msg, self.kinds, self.sizes_key)]})
        f = Path(self.root) / "flower" / "receipts" / f"{node}.jsonl"
        f.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "a") as fh:
            fh.write(line + "\n")


def declare(context, client: str, record: str = "train", **arrays) -> None:
    """Inside a ClientApp wrapped by the recorder's ``client_mod``: this client's name (a client id of the recorder's
    data set, e.g. "rot30/2") and a ground-truth record for the scorer, never for attacks: "train" with ``idx`` (the
    global image ids it trains on), or a record an attack's output names (fdg_audit.api.records, e.g. "amp": the
    image id of each row of an amplitude bank it sends)."""
    active = _ACTIVE.get()
    if active is None:
        raise UserError("fdg_audit.flower.declare was called outside the recorder: add the recorder's client_mod to "
                        "your ClientApp (ClientApp(mods=[recorder.client_mod]))")
    mod, node = active
    safe_name(record, "declare(record)")
    if not isinstance(client, str) or not all(p and p not in (".", "..") for p in client.split("/")):
        raise UserError(f"declare(client={client!r}): name the client by its id in the data set, e.g. \"rot30/2\"")
    root = Path(mod.root)
    atomic_write(root / "flower" / "nodes" / f"{node}.json", json.dumps({"client": client}))
    atomic_write(RunFolder(root).truth_file(mod.run, client, record),
                 npz_bytes({k: np.asarray(v.cpu() if torch.is_tensor(v) else v) for k, v in arrays.items()}))


# ------------------------------------------------------------------------------------------- server side

class RecordingGrid(Grid):
    """The ServerApp's Grid, recording every instruction it sends and every reply it receives (``wrap``). Messages
    are recorded when their replies are pulled, when every client has run and ``declare``d its name: the
    instructions first, then the replies, as a native round's envelopes."""

    def __init__(self, grid, rec: "FlowerRecorder"):
        self.grid, self.rec, self.pending = grid, rec, {}

    def set_run(self, run):
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, *a, **kw):
        return self.grid.create_message(*a, **kw)

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def get_nodes(self):
        return self.grid.get_nodes()

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(self.grid.push_messages(messages))
        self.pending.update(zip(ids, messages))
        return ids

    def pull_messages(self, message_ids):
        replies = list(self.grid.pull_messages(message_ids))
        self.rec.record([self.pending.pop(i) for i in list(message_ids) if i in self.pending], replies)
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.rec.record(messages, replies)
        return replies


class FlowerRecorder:
    """Records one Flower federation as one run of a new run folder ``root`` (module docstring).

    The run's public protocol (what attacks may assume, Kerckhoffs): ``method`` (an installed method plugin whose
    local training the ClientApp runs, e.g. "fedavg") with ``settings`` (its Params: lr, batch_size, local_epochs,
    ...), ``model`` (the model zoo's network whose state_dict the ArrayRecords carry). The data: ``data`` (a
    DataConfig; its split seed is kept in truth/secrets.json), ``target`` the held-out domain, ``seed`` the run's seed.
    ``kinds``: {record name: artifact kind}; ``attacks``: the [[attacks]] tables ``attack RUN`` runs ("all": every
    applicable one); ``label`` the method's label in the report (default ``method``), ``dataset_label`` the data set's
    (default its family); the run id is <dataset_label>/<label>/<target>/s<seed>. Everything is checked here, before
    the federation starts."""

    def __init__(self, root, *, data: DataConfig, target: str, seed: int = 0, method: str = "fedavg",
                 settings: dict | None = None, model: ModelConfig | None = None, kinds: dict | None = None,
                 sizes_key: str = "num-examples", attacks="all", name: str = "flower", label: str = "",
                 dataset_label: str = ""):
        self.root, self.data, self.target, self.seed = Path(root), data, target, int(seed)
        self.model, self.kinds, self.sizes_key = model or ModelConfig(), dict(kinds or {}), sizes_key
        plugin = load_method(method)
        known = [f.name for f in dataclasses.fields(plugin.Params)]
        bad = sorted(set(settings or {}) - set(known))
        if bad:
            raise UserError(f"FlowerRecorder settings: {bad[0]!r} is not a setting of method {method}; use "
                            f"{', '.join(known)}")
        self.params = plugin.Params(**(settings or {}))
        label, dlabel = label or method, dataset_label or data.family
        self.run_id = f"{dlabel}/{label}/{target}/s{self.seed}"
        train = {f.name: getattr(self.params, f.name) for f in dataclasses.fields(TrainParams)}
        extra = {k: v for k, v in dataclasses.asdict(self.params).items() if k not in train}
        ds = {k: v for k, v in dataclasses.asdict(data).items() if k not in ("split_seed", "draw")}
        self.raw = dict(name=name, seeds=[self.seed], datasets=[dict(ds, label=dlabel, targets=[target])],
                        model=dataclasses.asdict(self.model), train=train,
                        methods=[dict(name=method, label=label, **extra)],
                        attacks=attacks)
        parse(self.raw)   # one-line errors for bad settings, kinds of data or attacks, before anything runs
        for k in self.kinds.values():
            safe_name(k, "kinds")
        self.client_mod = ClientMod(str(self.root), self.run_id, self.kinds, sizes_key)
        self.history, self.ledger, self.bus, self._data = [], None, None, None

    # --------------------------------------------------------------------------------------- recording

    def wrap(self, grid) -> RecordingGrid:
        """The ServerApp's ``grid``, recording; creates the run folder (refused if it holds a recording)."""
        if (self.root / "messages.jsonl").exists() or (self.root / "summary.json").exists():
            raise UserError(f"{self.root} already holds a recording: give the recorder a new folder")
        self.root.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(self.root)
        self.bus = Bus(self.ledger, self.run_id, self.raw["methods"][0]["label"])
        return RecordingGrid(grid, self)

    def name(self, node: int) -> str:
        f = self.root / "flower" / "nodes" / f"{int(node)}.json"
        return json.loads(f.read_text())["client"] if f.exists() else f"node{int(node)}"

    def record(self, sent: list, replies: list) -> None:
        """Instructions (server -> node) then replies (node -> server), each record one envelope."""
        rounds = {}
        for msg, out in [(m, True) for m in sent] + [(m, False) for m in replies]:
            node = msg.metadata.dst_node_id if out else msg.metadata.src_node_id
            who = self.name(node)
            self.bus.round = _round(msg, rounds.get(msg.metadata.reply_to_message_id, self.bus.round))
            if out:
                rounds[msg.metadata.message_id] = self.bus.round
            for kind, data in records_of(msg, self.kinds, self.sizes_key):
                self.bus.record(msg.metadata.message_type, SERVER if out else who, who if out else SERVER, kind,
                                data, deliver=False)

    # --------------------------------------------------------------------------------------- evaluation

    def dataset(self):
        if self._data is None:
            self._data = load_data(self.data)
        return self._data

    def evaluate_fn(self, server_round: int, arrays):
        """A strategy's ``evaluate_fn``: the harness's evaluation of a native run (fdg_audit.train.federation), not a
        party's: the global model on the pooled source validation splits and on the whole held-out domain, every
        round after round 0; the round is later chosen on source validation only. Returns a MetricRecord."""
        d = self.dataset()
        row = {"round": int(server_round), "bytes": self.bus.sent.get(int(server_round), 0) if self.bus else 0}
        if server_round > 0:
            net = build_model(self.model, d.channels, d.num_classes, d.size)
            net.load_state_dict(arrays.to_torch_state_dict())
            sources = [x for x in d.domains if x.name != self.target]
            tgt = d.domain(self.target)
            row.update(source_val_acc=accuracy(net, cat_splits([x.val for x in sources]), "cpu"),
                       target_acc=accuracy(net, cat_splits([tgt.train, tgt.val]), "cpu"))
        self.history.append(row)
        return MetricRecord({k: v for k, v in row.items() if k.endswith("_acc")}) if server_round > 0 else None

    # --------------------------------------------------------------------------------------- the run folder

    def finish(self) -> Path:
        """Check the recording (declared truth, receipts) and write the run folder's records: summary.json,
        metrics.csv, manifest.json, config.resolved.toml, truth/secrets.json. Returns the folder."""
        if self.ledger is None:
            raise UserError("FlowerRecorder.finish: nothing was recorded; pass recorder.wrap(grid) to the strategy")
        self.ledger.close()
        clients = sorted({e.sender for e in self.ledger.stream()} - {SERVER})
        self._check_truth(clients)
        self._check_receipts()
        root, d = self.root, self.dataset()
        ev = [r for r in self.history if "source_val_acc" in r]
        if not ev:
            raise UserError("FlowerRecorder.finish: no evaluated round; pass evaluate_fn=recorder.evaluate_fn to "
                            "strategy.start")
        best, converged = select_round(self.history, sum(len(x.val.y) for x in d.domains if x.name != self.target),
                                       ev[-1]["round"])
        data = {k: v for k, v in dataclasses.asdict(self.data).items() if k != "split_seed"}
        ds = self.raw["datasets"][0]
        info = RunInfo(self.run_id, "ok", dataset=ds["label"], method=self.raw["methods"][0]["label"],
                       plugin=self.raw["methods"][0]["name"], target=self.target, seed=self.seed,
                       params=dataclasses.asdict(self.params), data=data, secret="0",
                       model=dataclasses.asdict(self.model), num_classes=d.num_classes, channels=d.channels,
                       size=d.size, chain_head=self.ledger.heads.get(self.run_id, ""), selected_round=best["round"],
                       target_acc=best["target_acc"], source_val_acc=best["source_val_acc"],
                       final_target_acc=ev[-1]["target_acc"], converged=converged, clients=clients)
        runs = [dataclasses.asdict(info)]
        summary = {"scenario": self.raw["name"], "reference": info.method, "runs": runs,
                   "bytes": bytes_summary((dataclasses.asdict(e) for e in self.ledger.stream()), runs)}
        keys = ("run", "dataset", "method", "variant", "target", "seed")
        write_csv(root / "metrics.csv", [{k: runs[0][k] for k in keys} | h for h in self.history])
        atomic_write(root / "truth" / "secrets.json", json.dumps({"0": int(self.data.split_seed)}))
        atomic_write(root / "config.resolved.toml", dump_toml(self.raw))
        atomic_write(root / "manifest.json", json.dumps(self._manifest(), indent=1))
        atomic_write(root / "summary.json", json.dumps(summary, indent=1, default=str))
        return root

    def _manifest(self) -> dict:
        from flwr import __version__ as flwr_version   # noqa: PLC0415
        return {"scenario": self.raw["name"], "source": "flower", "sets": [], "fdg_audit": __version__,
                "commit": git_commit(), "python": platform.python_version(), "torch": torch.__version__,
                "numpy": np.__version__, "flwr": flwr_version, "seeds": [self.seed], "runs": [self.run_id],
                "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "preview": False, "resumed_with": []}

    def _check_truth(self, clients: list[str]) -> None:
        """Every client declared its name and its "train" ids, and they are its part of the data set."""
        d, folder = self.dataset(), RunFolder(self.root)
        for c in clients:
            f = folder.truth_file(self.run_id, c, "train")
            if c.startswith("node") or not f.exists():
                raise UserError(f"client {c} of the Flower run declared no training data: call fdg_audit.flower."
                                "declare(context, client, idx=ids) in its ClientApp")
            try:
                own = d.domain(c).train.idx
            except UserError:
                raise UserError(f"client {c!r} is not a client of the recorder's data set: declare a client id of "
                                f"it (domains {', '.join(d.names)}, e.g. \"{d.names[0]}/0\")") from None
            ids = load_npz(f)["idx"]
            if not np.array_equal(np.sort(ids), np.sort(own)):
                raise UserError(f"client {c} declared {len(ids)} training ids that are not its part of the data set "
                                f"({len(own)} images): load its data from the recorder's DataConfig")

    def _check_receipts(self) -> None:
        """Each record a client's mod saw received or sent is in the ledger with the same bytes, and vice versa."""
        seen = {}
        for e in self.ledger.stream():
            node = e.receiver if e.sender == SERVER else e.sender
            seen.setdefault(node, []).append(("in" if e.sender == SERVER else "out", e.round, e.phase, e.kind,
                                              e.sha256))
        for f in sorted((self.root / "flower" / "receipts").glob("*.jsonl")):
            who = self.name(int(f.stem))
            got = [(r["way"], r["round"], r["type"], k, h) for r in map(json.loads, f.read_text().splitlines())
                   for k, h in r["records"]]
            if sorted(got) != sorted(seen.get(who, [])):
                raise UserError(f"{self.root}: client {who}'s receipts ({len(got)} records) differ from the ledger's "
                                f"({len(seen.get(who, []))}): put the recorder's client_mod first in "
                                "ClientApp(mods=[...]) so that no mod changes a message after it")
