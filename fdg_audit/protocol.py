"""The method contract: ``MethodPlugin`` (what a method plugin class declares) and the parties it defines
(``Party``, ``Client``, ``Server``), with the helpers every method uses. Plugins import these from
``fdg_audit.api.method``; the engines (fdg_audit.train.engines) and the round loop (fdg_audit.train.federation) drive them.

Server and clients never hold references to each other: every exchange goes through the bus, and in the
``process`` and ``ray`` engines clients live in workers and see only the encoded bytes they are sent.

Seeding (fdg_audit.seeding): one seed sequence per run (master seed + run id), then one child per (party, round,
call). Before every call the engine reseeds the party's ``rng`` (numpy), ``gen`` (torch CPU generator) and torch's
global RNG from that child, so every engine gives the same ledger on CPU. ``Party.stream(*key)`` is a stream of
the party that does not depend on the round or the calls (e.g. a client's canary coins).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from . import seeding
from .bus import Payload
from .errors import UserError
from .data.base import Domain, Split
from .models import ModelConfig, build_model
from .params import TrainParams, make_optimizer
from .plugins import load
from .privacy import prepare_client
from .privacy.dpsgd import dp_fit


def default_build(party) -> torch.nn.Module:
    """The model zoo's network for the run's ``[model]`` section and image shape; on the server of a run with
    ``model.pretrain_epochs``, loaded with the state pretrained on the public data (``Server.pretrained``)."""
    c, s, _, k = party.shape
    net = build_model(party.model_cfg, c, k, s)
    pre = getattr(party, "pretrained", None)
    if pre:
        net.load_state_dict(pre)
    return net.to(party.device)


class MethodPlugin:
    """The contract of a method plugin: subclass this and register it (entry point group ``fdg_audit.methods``).

    Required class attributes:
      ``name``     the registered name (str);
      ``Params``   a dataclass extending ``TrainParams``: its fields are the scenario's ``[method]`` keys;
      ``Server``   a ``Server`` subclass: ``begin()`` (round 0: one-time exchanges), ``step(t)`` (round t >= 1),
                   optionally ``setup()``, ``global_model()`` (what the harness evaluates; default ``model``) and
                   ``extra_metrics()`` (the method's own metrics, e.g. personalised accuracy, in metrics.csv);
      ``Client``   a ``Client`` subclass answering the server with ``on_<phase>(msg) -> Reply | None``, optionally
                   ``setup()``; cohort training: ``vmap_phase`` with ``vmap_ok()``, ``vmap_begin(msg)``,
                   ``vmap_end()`` (see ``Client``);
      ``kinds``    the artifact kinds it may send (the bus's vocabulary; ``register_kind`` adds one).

    Optional, with the defaults below:
      ``title``                  the method's name as its paper writes it (the report's sentences and figures);
                                 "" (default): ``name``;
      ``partial_participation``  the server accepts a sample of the clients each round (``participation < 1``);
      ``participation_note``     why not, shown when ``participation < 1`` is refused;
      ``dp_sgd_refused``         non-empty: why example-level DP-SGD is undefined for the method (refused at plan time);
      ``build(party)``           the model every party and every attack builds (default: the model zoo's ``Net``);
      ``aggregate_share(params)`` rho: with these settings the server's new model is a weighted mean of the uploads
                                 whose weights sum to 1, are at most rho / K each (K uploads) and depend on nothing
                                 private but privatized update statistics (1.0: the uniform mean; inf, the default:
                                 none of this holds). Central client-level DP scales each client's noise by rho;
      ``update_stats(params)``   True when the method sends privatized statistics of its update with it (arrays
                                 ``stat/<name>`` in the upload; client-level DP clips and noises them apart);
      ``public_data``            non-empty: why the method needs the server's public data (``data.public``, on the
                                 server as ``Server.public``); a run without it is refused (one line, at its start);
      ``partial_state``          artifact kinds whose arrays are a part of the model's state, named as in its state
                                 dict (e.g. adapters over a frozen backbone): attacks read each such message as kind
                                 ``weights``, merged onto the newest full state the adversary saw before it
                                 (``AdversaryView``), so every attack on weights reads them too;
      ``adaptation``             False; True for a domain-adaptation method: the federation adds one client for the
                                 held-out target domain, named like it (``Party.target`` on every party), holding its
                                 images with every label replaced by -1 before the client is built (``unlabeled``).
                                 It is not in ``Server.clients`` (the sources, which ``participation`` samples): the
                                 server reaches it with ``to=[self.target]``. The harness still evaluates on the
                                 target's true labels and selects the round on source validation only; the run's
                                 info records ``adaptation`` and the report labels its accuracy domain adaptation;
      any static function the method makes public (a style function, a class code, a generator architecture):
      attacks reach them through ``AdversaryView.protocol`` (Kerckhoffs), never through the method's module.
    """
    name: str = ""
    title: str = ""
    Params: type = TrainParams
    Server: type
    Client: type
    kinds: tuple = ()
    partial_participation: bool = False
    participation_note: str = "its server expects every client each round"
    dp_sgd_refused: str = ""
    adaptation: bool = False
    public_data: str = ""
    partial_state: tuple = ()
    build = staticmethod(default_build)

    @staticmethod
    def aggregate_share(params) -> float:
        return math.inf

    @staticmethod
    def update_stats(params) -> bool:
        return False


def unlabeled(dom: Domain) -> Domain:
    """The held-out domain as an adaptation method's target client holds it: its images and ids, every label -1."""
    return Domain(dom.name, *(Split(s.x, torch.full_like(s.y, -1), s.idx) for s in (dom.train, dom.val)))


@dataclass
class Reply:
    kind: str
    arrays: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)


def state_arrays(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state (parameters and buffers, e.g. BN running statistics) as named arrays."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def load_arrays(model: torch.nn.Module, arrays: dict[str, torch.Tensor]) -> torch.nn.Module:
    dev = next(model.parameters()).device
    model.load_state_dict({k: v.to(dev) for k, v in arrays.items()})
    return model


class Party:
    def __init__(self, ctx: dict):
        self.id: str = ctx["id"]
        self.params = ctx["params"]
        self.device = torch.device(ctx["device"])
        self.model_cfg: ModelConfig = ctx["model_cfg"]
        self.privacy = ctx.get("privacy")     # fdg_audit.privacy.PrivacyConfig or None
        self.shape: tuple[int, int, int, int] = ctx["shape"]   # (channels, size, size, num_classes)
        self.target: str | None = ctx.get("target")   # the unlabeled target client's id (MethodPlugin.adaptation)
        self.round = 0
        self._root: np.random.SeedSequence = ctx["seedseq"]
        self._index: int = ctx["party"]
        self._calls: dict[int, int] = {}
        self.reseed()

    def reseed(self) -> None:
        n = self._calls.get(self.round, 0)
        self._calls[self.round] = n + 1
        child = seeding.child(self._root, self._index, self.round, n)
        s = int(child.generate_state(1, np.uint64)[0] & 0x7FFF_FFFF_FFFF_FFFF)
        self.rng = np.random.default_rng(child)
        self.gen = torch.Generator().manual_seed(s)
        torch.manual_seed(s)

    def stream(self, *key: int) -> np.random.Generator:
        """A random stream of this party for ``key`` (e.g. ``seeding.CANARY``), fixed by the run, the party and the
        key, whatever the round and the calls."""
        return np.random.default_rng(seeding.child(self._root, self._index, *key))

    def new_model(self) -> torch.nn.Module:
        return default_build(self)


class Client(Party):
    """A source domain's party (or an adaptation method's unlabeled target: ``self.id == self.target``). Owns its data
    split; answers the server with ``on_<phase>`` handlers."""

    def __init__(self, ctx: dict):
        dom: Domain = ctx["domain"]
        self.train = Split(dom.train.x.to(ctx["device"]), dom.train.y.to(ctx["device"]), dom.train.idx)
        self.val = Split(dom.val.x.to(ctx["device"]), dom.val.y.to(ctx["device"]), dom.val.idx)
        self.truth_sink = ctx.get("truth_sink")
        self.run_id: str = ctx.get("run_id", "")
        self.events: list[dict] = []          # accounting events of local mechanisms (DP-SGD), sent with the next reply
        super().__init__(ctx)
        if self.privacy is not None:
            prepare_client(self)
        self.setup()

    def setup(self) -> None:
        """Build private state (models, optimizers) here."""

    def handle(self, phase: str, msg: Payload | None) -> Reply | None:
        fn = getattr(self, "on_" + phase, None)
        if fn is None:
            raise NotImplementedError(f"{type(self).__name__} has no handler on_{phase}")
        return fn(msg)

    def record_truth(self, name: str, **arrays) -> None:
        """Ground truth for scorers (never for attacks), e.g. which images went into a bank."""
        if self.truth_sink is not None:
            self.truth_sink(self.id, name, {k: np.asarray(v.cpu() if torch.is_tensor(v) else v)
                                             for k, v in arrays.items()})

    def batch_indices(self, epochs: int | None = None, steps: int | None = None, n: int | None = None
                      ) -> Iterator[torch.Tensor]:
        """Shuffled mini-batch row indices (CPU) for ``steps`` steps, else ``epochs`` epochs (params by default)."""
        p = self.params
        n = len(self.train.y) if n is None else n
        b = min(p.batch_size, n)
        steps = steps if steps is not None else (p.local_steps if epochs is None else 0)
        epochs = epochs if epochs is not None else p.local_epochs
        total = steps if steps else epochs * -(-n // b)
        done = 0
        while done < total:
            perm = torch.randperm(n, generator=self.gen)
            for i in range(0, n, b):
                if done == total:
                    return
                yield perm[i:i + b]
                done += 1

    def batches(self, epochs: int | None = None, steps: int | None = None, split: Split | None = None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled mini-batches (on the device) for ``steps`` steps, else ``epochs`` epochs (params by default)."""
        split = split or self.train
        for j in self.batch_indices(epochs, steps, len(split.y)):
            j = j.to(split.x.device)
            yield split.x[j], split.y[j]

    # A client whose ``on_<vmap_phase>`` is "load the message, fit(self.model) with plain SGD/Adam, reply" may be
    # trained in a cohort (fdg_audit.train.cohort): the engine calls vmap_begin(msg) on each, trains every
    # client's ``model`` together, then vmap_end() on each. ``vmap_ok()`` says whether this instance qualifies.
    vmap_phase: str | None = None

    def vmap_ok(self) -> bool:
        return False

    def fit(self, model: torch.nn.Module, loss_fn=None, opt=None, **kw) -> torch.nn.Module:
        """Local training: ``loss_fn(model, x, y) -> loss`` (default cross-entropy) over ``batches(**kw)``.
        With ``[privacy] dp_sgd`` it is DP-SGD (fdg_audit.privacy.dpsgd) with Poisson batches instead."""
        if self.privacy is not None and self.privacy.dp_sgd:
            return dp_fit(self, model, loss_fn, opt, **kw)
        loss_fn = loss_fn or (lambda m, x, y: F.cross_entropy(m(x), y))
        opt = opt or make_optimizer(self.params, model.parameters())
        model.train()
        for x, y in self.batches(**kw):
            opt.zero_grad(set_to_none=True)
            loss_fn(model, x, y).backward()
            opt.step()
        return model


class Server(Party):
    """The coordinating party. Holds the global model, owns no private data, talks only through ``exchange``.
    ``public``: the run's public data (``data.public``: a labelled Split of a domain outside the run, recorded on the
    ledger as one ``public_aux`` envelope) or None; ``pretrained``: the state every model it builds starts from
    (``model.pretrain_epochs`` on ``public``) or None."""

    def __init__(self, ctx: dict):
        self.clients: list[str] = ctx["clients"]
        self.active: list[str] = list(self.clients)   # this round's participants (all unless participation < 1)
        self._link = ctx["link"]
        self.public: Split | None = ctx.get("public")
        self.pretrained: dict | None = ctx.get("pretrained")
        super().__init__(ctx)
        self.model = self.new_model()
        self.setup()

    def setup(self) -> None:
        """Build the global state here (the model is already built from the server's seed)."""

    def begin(self) -> None:
        """Round 0: one-time exchanges (data sizes, banks). Default: nothing."""

    def step(self, t: int) -> None:
        """Round t >= 1 of the protocol."""
        raise NotImplementedError

    def global_model(self) -> torch.nn.Module:
        """The model the harness evaluates (override for ensembles)."""
        return self.model

    def extra_metrics(self) -> dict[str, float]:
        """Metrics of the method's own (e.g. personalised accuracy), added to each evaluated round's row of
        metrics.csv next to the harness's; called after ``global_model()`` is evaluated. Default: none."""
        return {}

    def exchange(self, phase: str, kind: str | None = None, payloads: dict[str, tuple] | None = None,
                 to: list[str] | None = None) -> dict[str, Payload | None]:
        """Send ``payloads[c] = (arrays, scalars)`` to each client ``c`` (or nothing, a control signal that
        carries no data and is not recorded), let all clients work, and return their replies."""
        to = list(payloads) if payloads is not None else (to or self.active)
        return self._link.exchange(phase, self.id, kind, {c: payloads[c] if payloads else None for c in to})

    def broadcast(self, phase: str, kind: str, arrays: dict, scalars: dict | None = None,
                  to: list[str] | None = None) -> dict[str, Payload | None]:
        """The same payload to every client: one encoding, one envelope per receiver."""
        return self._link.exchange(phase, self.id, kind, {c: (arrays, scalars) for c in (to or self.active)},
                                   same=True)

    def ask(self, phase: str, to: list[str] | None = None) -> dict[str, Payload | None]:
        return self.exchange(phase, to=to)


@torch.no_grad()
def accuracy(model, split: Split, device, batch: int = 512) -> float:
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)   # one host sync per evaluation, not per batch
    for i in range(0, len(split.y), batch):
        x, y = split.x[i:i + batch].to(device), split.y[i:i + batch].to(device)
        correct += (model(x).argmax(1) == y).sum()
    return correct.item() / max(1, len(split.y))


def load_method(name: str):
    """The method plugin ``name`` (a registered name or "module:Class", ``plugins.load``), checked to be a
    MethodPlugin with its Server, Client and name."""
    m = load("method", name)
    if not (isinstance(m, type) and issubclass(m, MethodPlugin)):
        raise UserError(f"{name!r} is not a method plugin: subclass fdg_audit.api.method.MethodPlugin (see "
                        "methods/fedavg.py)")
    missing = [a for a in ("Server", "Client") if a not in dir(m)] + ([] if m.name else ["name"])
    if missing:
        raise UserError(f"method plugin {name!r} lacks {', '.join(missing)}: see MethodPlugin's docstring")
    return m
