"""The attack plugin contract, beside the method contract (protocol.py); plugins import it as
``fdg_audit.api.attack`` (with ``fdg_audit.api``).

An attack plugin is a subclass of ``Attack`` with
  ``name``; ``consumes`` (artifact kinds, or ``("*",)``: every kind but those in ``ignores``); ``adversary`` ("server" | "client" | "eavesdropper");
  ``aux`` (a subset of "public", "domain_samples", "candidates", "layout"); ``Params`` (a dataclass extending
  ``AttackParams``); ``outputs`` ({output variant: what that variant assumes, in words}: the report's threat-model
  column reads it, so the core keeps no word list about attacks);
  ``run(view, aux) -> list[Output]`` (Reconstruction | Scores | Predictions | Estimate | Audit, or Skipped with a
  reason) and ``control() -> list[Control]`` (positive controls that must succeed and negative controls that
  must stay at chance, on data the attack builds itself; any failed control turns the attack's numbers into
  "not measurable").
Optional threat-model declarations (defaults: nothing declared), read by the metadata probe into attacks.json for the
scorecard's ``prior``, ``budget`` and ``capabilities`` columns (``Attack.threat``):
  ``priors`` ({output variant: one of ``PRIORS``}; key "*" = every variant): the image prior of a reconstruction
  output. "none": box/smoothness only; "layout": the data set's public support or frame; "learned": a generative model
  trained on the attacker's declared public data; "oracle": the data set's own generator (an upper bound, never the
  scorecard's headline). ``budget`` ({output variant or "*": (iteration params, restart param)}): the names of the
  ``Params`` fields whose sum is the iteration count (a cap where a plateau rule, ``Reconstruction.plateau``, may stop
  earlier) and the one that counts restarts ("" = one start), e.g. ``{"*": (("iterations",), "restarts")}``; declared
  by every attack that optimises (nothing is inferred from field names; none declared: budget "—"). ``knows``: the
  capabilities (``CAPABILITIES``, the gradient-inversion SoK's vocabulary as LeakPro encodes it) the attack uses
  beyond what ``aux`` and its priors imply. ``rows`` ({output variant: setting in words}): outputs the scorecard
  reports in a row of their own (a weaker attacker's setting, e.g. perturbed copies), never competing with the
  attack's other outputs for the harm's headline.
It sees only the ``AdversaryView`` (what that adversary received or sent) and the ``Aux`` it declared. Ground
truth never reaches ``run``: the scorer (fdg_audit.audit.scoring) joins outputs with truth, and the metric registry
(fdg_audit.metrics.registry) says which harm each scored metric measures. An attack applies to a run when its
adversary observed a kind it ``consumes``. attacks/README.md is the how-to.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from . import records, seeding
from .data.base import Split
from .errors import UserError
from .models import ModelConfig
from .plugins import load
from .protocol import load_arrays, load_method
from .store.ledger import Ledger
from .vocab import ADVERSARIES, AUX, CAPABILITIES, IMPLIED, ORACLE, PRIORS, AttackParams  # noqa: F401  (vocabulary)


def sample_victims(view, items: list, max_victims: int, key=lambda v: v) -> list:
    """At most ``max_victims`` of ``items`` (victim names, or tuples whose ``key`` is the victim), in their order:
    all when ``max_victims`` is 0 or not exceeded, else the victims with the lowest priorities drawn from a RNG seeded
    by the run id (which holds the run's seed) and the victim's name, so every attack on a run samples the same
    victims among those it can see, and many clients are not cut down to the first few by name."""
    names = list(dict.fromkeys(key(i) for i in items))
    if not max_victims or len(names) <= max_victims:
        return list(items)
    prio = {v: seeding.rng(view.run_id, v, seeding.VICTIMS).random() for v in names}
    chosen = set(sorted(names, key=lambda v: (prio[v], v))[:max_victims])
    return [i for i in items if key(i) in chosen]


# ------------------------------------------------------------------------------------------- outputs

@dataclass
class Reconstruction:
    """Images an attack rebuilt from an artifact. ``truth`` names the ground-truth record the rows refer
    to (a name of ``fdg_audit.api.records``): a truth file written by the victim (e.g. the bank's image ids) or
    "train" (match against the victim's whole training set with the Hungarian algorithm; the baseline images are
    matched on their own, so they get the same advantage). With truth "train", ``victim`` may join several clients
    with "+" (an aggregate of their data, e.g. what a curious client sees)."""
    victim: str
    artifact: str
    round: int
    images: torch.Tensor          # (N, C, H, W) in [0, 1]
    truth: str = records.TRAIN    # a name of fdg_audit.records
    rows: Any = None              # indices into the truth record, aligned with images; None = match
    aligned: bool = False         # score with aligned PSNR (Fourier ambiguities: shifts, point inversion)
    variant: str = ""
    baseline: torch.Tensor | None = None   # the attack's own trivial baseline images, same rows
    flat_baseline: bool = False   # instead: the scorer's flat image at each true image's channel means (what an
    #                               un-noised DC term gives; so a noised artifact's baseline is its un-noised content's)
    labels: Any = None            # predicted class per image, scored as label_acc (after matching)
    cpu_seconds: float = float("nan")   # process CPU seconds the attack spent on this output (time.process_time)
    iterations: int = 0           # optimisation steps actually run (per restart; fewer than the cap at a plateau)
    plateau: str = ""             # the stopping rule that ended the optimisation, in words ("" = fixed budget)


@dataclass
class Scores:
    """Membership scores (higher = member) for ``aux.candidates[victim]`` in its order."""
    victim: str
    artifact: str
    round: int
    scores: np.ndarray
    variant: str = ""
    victims: list | None = None   # set by the harness when it pools several victims' scores (in this order)


@dataclass
class Predictions:
    """Predicted attribute ("class" | "domain") per row of a truth record (as in Reconstruction)."""
    victim: str
    artifact: str
    round: int
    attribute: str
    pred: np.ndarray
    n_classes: int
    truth: str = records.TRAIN
    rows: Any = None
    variant: str = ""


@dataclass
class Estimate:
    """A quantity of the victim's data: "n_samples" (scalar) or "label_counts" (per class)."""
    victim: str
    artifact: str
    round: int
    quantity: str
    value: np.ndarray
    variant: str = ""


@dataclass
class Audit:
    """A DP audit: one score per canary slot of the truth record ``truth`` (higher = inserted), scored as empirical
    ε lower bounds next to the audited mechanism's accountant ε (fdg_audit.privacy.audit)."""
    victim: str
    artifact: str
    round: int
    scores: np.ndarray
    delta: float
    epsilon: float = float("inf")   # the accountant's ε of the audited mechanism (inf: no mechanism)
    independent: bool = False     # the canaries are independent trials (independent noise per canary row)
    truth: str = records.CANARIES
    variant: str = ""


@dataclass
class Skipped:
    """A victim's artifact the attack could not use, with the reason (one ``skipped`` row in leakage.csv)."""
    victim: str
    artifact: str
    round: int
    reason: str
    variant: str = ""


OUTPUTS = (Reconstruction, Scores, Predictions, Estimate, Audit, Skipped)   # what ``run`` may return, in one place


@dataclass
class Control:
    name: str
    metric: str
    value: float
    threshold: float
    positive: bool = True         # positive: must reach threshold; negative: must stay at or below it

    @property
    def passed(self) -> bool:
        return self.value >= self.threshold if self.positive else self.value <= self.threshold


class Attack:
    name = ""
    consumes: tuple = ()          # artifact kinds; ("*",): every kind, less ``ignores``
    ignores: tuple = ()
    adversary = "server"
    aux: tuple = ()
    outputs: dict = {}            # output variant -> what it assumes, in words ("" = the attack's main output)
    priors: dict = {}             # output variant ("*": all) -> one of PRIORS (reconstructions; module doc)
    budget: dict = {}             # output variant ("*": all) -> (iteration params, restart param); {} = none
    knows: tuple = ()             # CAPABILITIES used beyond those aux and priors imply
    rows: dict = {}               # output variant -> a setting the scorecard reports in a row of its own
    cache = ""                    # the attack cache its jobs share (``AdversaryView.keep``/``cached``): "" = its own
                                  # name; attacks that can reuse each other's arrays name the same one
    Params = AttackParams

    def __init__(self, params=None, device: str = "cpu"):
        self.p = params or self.Params()
        self.device = torch.device(device)

    def run(self, view: "AdversaryView", aux: "Aux") -> list:
        raise NotImplementedError

    def control(self) -> list[Control]:
        return []

    def cost(self) -> dict:
        """Optional, for the cost guard (fdg_audit.audit.coverage.estimate): the attack's estimated CPU seconds per
        victim (``"victim"``) and per image of a victim (``"image"``, counted up to ``"max_images"`` images; 0 or
        absent = all), from its per-iteration cost (bench/attack_cost.py) and its budget parameters. {}: not
        estimated."""
        return {}

    def threat(self) -> dict:
        """The declarations above resolved against the parameters, as plain values for attacks.json:
        {"priors": {variant: prior}, "budget": {variant: [iterations, restarts]}, "knows": [...], "rows": {...}}."""
        fields = dataclasses.asdict(self.p)
        total = lambda names: int(sum(sum(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
                                      for v in (fields[n] for n in names)))
        budget = {v: [total(its), int(fields[r]) if r else 1] for v, (its, r) in self.budget.items() if its}
        return dict(priors={str(k): str(v) for k, v in self.priors.items()}, budget=budget,
                    knows=[str(k) for k in self.knows], rows={str(k): str(v) for k, v in self.rows.items()})


def load_attack(name: str):
    """The attack plugin ``name`` (a registered name or "module:Class", ``plugins.load``), checked to be an Attack."""
    a = load("attack", name)
    if not (isinstance(a, type) and issubclass(a, Attack)):
        raise UserError(f"{name!r} is not an attack plugin: subclass fdg_audit.api.attack.Attack (see "
                        "attacks/README.md)")
    return a


# ------------------------------------------------------------------------------------------- views

@dataclass
class Message:
    env: Any
    _ledger: Any

    def __getattr__(self, k):
        return getattr(self.env, k)

    @property
    def payload(self):
        """The decoded payload, without a method's update statistics (arrays ``stat/<name>``, noised apart by
        client-level DP): what the attacks read is model state, banks and scalars."""
        p = self._ledger.payload(self.env)
        return type(p)({k: v for k, v in p.arrays.items() if not k.startswith("stat/")}, p.scalars)


@dataclass
class Merged(Message):
    """A message of a partial-state kind (``MethodPlugin.partial_state``, e.g. adapters) read as kind ``weights``:
    its envelope with that kind, its payload the newest full state (``weights``) the adversary observed before it with
    the message's arrays on top. The original message stays in the view under its own kind."""
    part: Any = None
    base: Any = None

    @property
    def payload(self):
        p = self.part.payload
        return type(p)({**self.base.payload.arrays, **p.arrays}, p.scalars)


def merged_states(msgs: list, kinds) -> list:
    """A ``Merged`` copy of each message of the partial-state ``kinds`` that has a full state before it."""
    out, base = [], None
    for m in sorted(msgs, key=lambda m: m.seq):
        if m.kind == "weights":
            base = m
        elif m.kind in kinds and base is not None:
            out.append(Merged(dataclasses.replace(m.env, kind="weights"), m._ledger, m, base))
    return out


def view_envelopes(ledger: Ledger, run_id: str, adversary: str, me: str) -> list:
    """The envelopes of run ``run_id`` that ``me`` observed: all for an eavesdropper, else those it sent or got."""
    envs = ledger.select(run=run_id)
    return envs if adversary == "eavesdropper" else [e for e in envs if me in (e.sender, e.receiver)]


class AdversaryView:
    """What one adversary observed in one run, plus the public protocol description (Kerckhoffs).

    Messages whose payload the run did not keep (its ``store``/``store_rounds`` policy) are left out; a payload
    that was kept but is now missing or altered is an error (the run folder is damaged), never a silent gap.
    Messages of the method's ``partial_state`` kinds (e.g. adapters) are also listed as kind ``weights``, merged
    onto the newest full state observed before them (``Merged``), so attacks on weights read them as whole models."""

    def __init__(self, ledger: Ledger, run: dict, adversary: str, me: str, device):
        self.run_id, self.method, self.params = run["run_id"], run["plugin"], run["params"]
        cfg = run["model_cfg"]
        self.model_cfg = ModelConfig(**cfg) if isinstance(cfg, dict) else cfg
        self.shape, self.device = tuple(run["shape"]), device
        self.clients = list(run["clients"])
        self.me = me
        self._msgs = [Message(e, ledger) for e in view_envelopes(ledger, self.run_id, adversary, me)
                      if ledger.stored(e)]
        if any(m.kind == "weights" for m in self._msgs):   # partial states read as full ones (Merged)
            self._msgs += merged_states(self._msgs, self._partial_kinds())

    def _partial_kinds(self) -> tuple:
        """The method's ``partial_state`` kinds; none when its plugin cannot be loaded here (an attack that needs
        the model then meets the plugin's own error)."""
        try:
            return tuple(getattr(self.protocol, "partial_state", ()))
        except UserError:
            return ()

    def messages(self, **match) -> list[Message]:
        """Observed messages whose envelope fields equal the given values (lists mean any of)."""
        return [m for m in self._msgs if all(getattr(m.env, k) in v if isinstance(v, (list, tuple, set))
                                             else getattr(m.env, k) == v for k, v in match.items())]

    def kinds(self) -> set[str]:
        return {m.kind for m in self._msgs}

    @property
    def protocol(self):
        """The method's plugin class: its public protocol pieces (Kerckhoffs), e.g. a style function, a class code
        or a generator architecture that the method exposes as class attributes. Attacks use this route, never the
        method's module internals, so a third-party method can expose the same pieces."""
        return load_method(self.method)

    @property
    def settings(self):
        """The run's method settings, typed: the method's ``Params`` built from ``params`` (read ``settings.lr``,
        not ``params["lr"]``; ``params`` stays the plain record, e.g. to re-run the protocol)."""
        return self.protocol.Params(**self.params)

    def new_model(self) -> torch.nn.Module:
        """The protocol's model: the method's ``build(party)`` (``MethodPlugin.build``), for a party of this run."""
        c, s, k = self.shape
        party = SimpleNamespace(params=self.settings, shape=(c, s, s, k), model_cfg=self.model_cfg, device=self.device)
        return self.protocol.build(party).to(self.device)

    def model(self, arrays: dict) -> torch.nn.Module:
        return load_arrays(self.new_model(), arrays).eval()

    def cached(self, key: str) -> dict[str, np.ndarray] | None:
        """The arrays an earlier job of this attack kept under ``key`` (``keep``), read-only; None if none yet
        (e.g. a learned prior trained once per data set, seed and aux, reused by later runs' jobs)."""
        path = os.path.join(getattr(self, "cache_dir", "") or "", f"{key}.npz")
        if not getattr(self, "cache_dir", "") or "/" in key or key.startswith(".") or not os.path.isfile(path):
            return None
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    def keep(self, key: str, arrays: dict) -> None:
        """Queue plain float or integer arrays to be kept under ``key`` for later jobs of this attack (``cached``).
        The harness checks them when the job ends (key of A-Z a-z 0-9 _ . -, at most 100 characters; numeric arrays;
        a size cap; a bad one fails the job) and stores them on the attacker's side of the run folder."""
        if "_kept" not in self.__dict__:
            self._kept = {}
        self._kept[key] = {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
                           for k, v in dict(arrays).items()}


@dataclass
class Aux:
    """Auxiliary knowledge the attack declared. ``public``: labelled images of the held-out domain (not a
    victim's). ``domain_samples``: labelled public samples of each source domain, disjoint from all
    training data. ``candidates[victim]``: a shuffled pool of that victim's members and non-members, with
    class labels (membership withheld). ``layout``: how the dataset's images are made, public knowledge of the
    dataset (the embedded rotated digits: 8x8 digits lifted to 20x20 in a 28x28 canvas, rotated by the domain's
    angle); empty where the dataset has no such recipe."""
    public: Split | None = None
    domain_samples: dict = field(default_factory=dict)
    candidates: dict = field(default_factory=dict)
    num_classes: int = 0
    domains: list = field(default_factory=list)
    layout: dict = field(default_factory=dict)   # "layout": the public recipe of each domain (DomainSet.layout)
