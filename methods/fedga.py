"""FedGA: FedAvg with generalization adjustment (Zhang et al., CVPR 2023), docs/methods.md §8.

Protocol (every round t; the server starts from a_k = 1/K, uniform, so no n_k is sent; the code's 1/3 each, which
sums to 1 only for K = 3):
0. Round 0 (``sync``): the server broadcasts the initial global state (kind ``weights``).
1. ``train`` (a control signal, nothing on the wire): each client trains from the global state it holds (the one
   it received in the previous ``after``/``sync`` phase) and uploads its full state (kind ``weights``).
2. ``before`` (control signal): each client reports its metric of its LOCAL model (kind ``metric``, scalar
   ``before``).
3. The server aggregates theta = sum_k a_k theta_k and broadcasts theta (phase ``after``, kind ``weights``); each
   client loads it, measures the same metric on it and reports it (kind ``metric``, scalar ``after``). The
   client trains from this theta next round, so the model goes down once per round, as in FedAvg.
4. The server sets gap_k = after_k - before_k and updates the weights for the next round (``ga_update``).
Per round and client: one model down, one model and two scalar ``metric`` envelopes up.

``variant = "paper"`` (default; the paper as a survey blog post, not in the repository, summarises it):
    G_k = gap_k with the metric = mean cross-entropy of the model on the client's TRAINING split
          (risk of the global model - risk of the local model),
    a_k += d_t * (G_k - mu) / max_l (G_l - mu),  mu = mean_l G_l,  d_t = (1 - t/T) * d,
    then a_k >= 0 (the paper's constraint; enforced by clipping at 0) and a /= sum(a).
    The denominator is max_l (G_l - mu) as the paper writes it (positive whenever the gaps differ), not
    max_l |G_l - mu|; the two differ only when the most negative deviation is the largest in size.
``variant = "official"`` (``utils/weight_adjust.py``, ``train_pacs_GA.py``, fair = 'acc'):
    metric = accuracy on the client's VALIDATION split, sign = -1 (a fall in accuracy raises the weight),
    no mean-centring: a_k += sign * gap_k / max_l |gap_l| * d_t / 3, then every a_k is clipped to [0, 1] and
    a /= sum(a). The 1/3 is the code's literal constant (``step_size = 1./3. * step_size``), written for its three
    PACS sources; the rule is defined for any K and this variant applies it as released, so with K != 3 sources
    the step is still d_t / 3 (not d_t / K: with K = 4, 5 the weights then move 4/3, 5/3 times as far as 1/K
    would; the paper variant has no such factor).
    Rounds: the code's loop is ``for i in range(comm + 1)`` with d_i = d - (i - 1) * d / comm, and every pass
    ends with a weight update, so a run with ``--comm T`` trains T + 1 rounds and updates the weights T + 1 times
    (steps d + d/T, d, ..., d/T). Here ``rounds`` counts training rounds, so ``rounds = T + 1`` reproduces
    ``--comm T``: round t = 1..rounds uses i = t - 1 and T = rounds - 1 (rounds >= 2).
Both: step_size d = 0.2 (the code's default; the paper's value is unverified); a zero denominator (paper: all
gaps equal; code: all gaps 0, where the code would divide by zero) leaves the weights unchanged. Note that the
code, having no centring, still moves the weights when all gaps are equal and non-zero.
Other deviations: local epochs, lr and optimizer come from the shared TrainParams (code: 5 epochs, SGD lr 1e-3,
StepLR, persistent optimizer); the model from the harness.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.api import UserError
from fdg_audit.api.method import MethodPlugin, Reply, load_arrays, state_arrays

from .fedavg import FedAvgClient, FedAvgServer, weighted_average
from .fedavg import Params as FedAvgParams

VARIANTS = ("paper", "official")


@dataclass
class Params(FedAvgParams):
    weighting: str = "uniform"       # a_k starts at 1/K (the code); "n_samples" starts from FedAvg's n_k weights
    variant: str = "paper"           # paper | official (see the module docstring)
    step_size: float = 0.2           # d

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise UserError(f"fedga variant = {self.variant!r}: use one of {', '.join(VARIANTS)}")
        if self.variant == "official" and self.rounds < 2:
            raise UserError(f"fedga variant = \"official\" needs rounds >= 2 (the code's comm = rounds - 1), "
                            f"got rounds = {self.rounds}")
        if not 0 <= self.step_size <= 1:
            raise UserError(f"fedga step_size = {self.step_size!r}: use a value in [0, 1], e.g. 0.2")


def step_size(p: Params, t: int) -> float:
    """d_t for round t = 1..T."""
    if p.variant == "official":                  # the code's d - (i - 1) d / comm, i = t - 1, comm = rounds - 1
        return p.step_size - (t - 2) * p.step_size / (p.rounds - 1)
    return (1 - t / p.rounds) * p.step_size


def ga_update(a: np.ndarray, gap: np.ndarray, d: float, variant: str = "paper") -> np.ndarray:
    """New aggregation weights from the old ones ``a`` and the per-client gaps (after - before)."""
    a, gap = np.asarray(a, np.float64).copy(), np.asarray(gap, np.float64)
    if variant == "official":
        scale = np.abs(gap).max()
        if scale > 0:
            a += -1.0 * gap / scale * d / 3.0          # the code's literal 1/3, whatever K (module docstring)
        a = np.clip(a, 0.0, 1.0)
    else:
        dev = gap - gap.mean()
        scale = dev.max()
        if scale > 0:
            a += d * dev / scale
        a = np.clip(a, 0.0, None)
    return a / a.sum() if a.sum() > 0 else np.full(len(a), 1 / len(a))


class FedGAClient(FedAvgClient):
    @torch.no_grad()
    def metric(self) -> float:
        """Paper: mean CE on the training split; official: accuracy on the validation split."""
        official = self.params.variant == "official"
        split = self.val if official else self.train
        self.model.eval()
        total = 0.0
        for i in range(0, len(split.y), 512):
            out = self.model(split.x[i:i + 512])
            y = split.y[i:i + 512]
            total += ((out.argmax(1) == y).sum() if official else F.cross_entropy(out, y, reduction="sum")).item()
        self.model.train()
        return total / max(1, len(split.y))

    def on_sync(self, msg):
        load_arrays(self.model, msg.arrays)

    def on_train(self, msg):
        self.local_update()
        return Reply("weights", state_arrays(self.model))

    def on_before(self, msg):
        return Reply("metric", scalars={"before": self.metric()})

    def on_after(self, msg):
        load_arrays(self.model, msg.arrays)
        return Reply("metric", scalars={"after": self.metric()})


class FedGAServer(FedAvgServer):
    def begin(self):
        super().begin()
        self.broadcast("sync", "weights", state_arrays(self.model))

    def aggregate(self, replies: dict) -> dict:
        return weighted_average([replies[c].arrays for c in self.clients], [self.weights[c] for c in self.clients])

    def step(self, t):
        replies = self.ask("train")
        before = self.ask("before")
        load_arrays(self.model, self.aggregate(replies))
        after = self.broadcast("after", "weights", state_arrays(self.model))
        gap = np.array([after[c]["after"] - before[c]["before"] for c in self.clients])
        a = ga_update([self.weights[c] for c in self.clients], gap, step_size(self.params, t), self.params.variant)
        self.weights = dict(zip(self.clients, a.tolist()))


class FedGA(MethodPlugin):
    # why plan refuses privacy.dp_sgd (fdg_audit/privacy/dpsgd.py refuse): no per-example objective
    dp_sgd_refused = ("it sends its training loss (the generalization gap's input), a statistic of the whole split,"
                      " in the clear")
    name = "fedga"
    title = "FedGA"
    Params = Params
    Server = FedGAServer
    Client = FedGAClient
    participation_note = ("its generalization adjustment re-weights every client from all clients' generalization "
                          "gaps each round; an unsampled client has no gap that round")
    kinds = ("n_samples", "weights", "metric")   # n_samples only with weighting = "n_samples"
