"""FedAvg (McMahan et al. 2017): the baseline every FedDG method extends.

Protocol (docs/methods.md §1): once, each client reports its training-set size n_k (artifact ``n_samples``).
Each round the server broadcasts the full global state (parameters and buffers), each client trains
locally and uploads its full state, and the server averages every key with p_k = n_k / sum n.
With ``participation < 1`` only the round's sample is asked and p_k is renormalised over it (McMahan et al.'s
client fraction C). Local training is plain SGD/Adam, so a cohort of clients may be trained as one stacked
model (``cohort = "vmap"``, fdg_audit.train.cohort) when no subclass changes it and there is no DP-SGD.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fdg_audit.api.method import Client, MethodPlugin, Reply, Server, TrainParams, load_arrays, state_arrays


@dataclass
class Params(TrainParams):
    weighting: str = "n_samples"     # n_samples (paper, FedDG-GA code) | uniform (CCST, FedSR code)


def weighted_average(states: list[dict], weights: list[float]) -> dict[str, torch.Tensor]:
    """Average every key; integer buffers (num_batches_tracked) are averaged and rounded back."""
    out = {}
    for k in states[0]:
        acc = sum(w * s[k].double() for s, w in zip(states, weights))
        out[k] = acc.round().to(states[0][k].dtype) if not states[0][k].is_floating_point() else acc.to(states[0][k].dtype)
    return out


def uniform_mean(params) -> float:
    """FedAvg's server: the new model is the uniform mean of the uploads (share 1) with ``weighting = "uniform"``;
    n_k weights are computed from the clients' sizes, which no mechanism bounds (inf)."""
    return 1.0 if params.weighting == "uniform" else math.inf


class FedAvgClient(Client):
    def setup(self):
        self.model = self.new_model()

    def on_hello(self, msg):
        return Reply("n_samples", scalars={"n": len(self.train.y)})

    def local_update(self):
        """Local training on the freshly loaded global state; methods override this."""
        self.fit(self.model)

    def on_train(self, msg):
        self.vmap_begin(msg)
        self.local_update()
        return self.vmap_end()

    vmap_phase = "train"

    def vmap_ok(self):
        cls = type(self)
        return (cls.local_update is FedAvgClient.local_update and cls.on_train is FedAvgClient.on_train
                and self.privacy is None)

    def vmap_begin(self, msg):
        load_arrays(self.model, msg.arrays)

    def vmap_end(self):
        return Reply("weights", state_arrays(self.model))


class FedAvgServer(Server):
    def begin(self):
        if self.params.weighting == "uniform":
            self.weights = {c: 1 / len(self.clients) for c in self.clients}
            return
        n = {c: r["n"] for c, r in self.ask("hello").items()}
        self.weights = {c: n[c] / sum(n.values()) for c in self.clients}

    def aggregate(self, replies: dict) -> dict:
        cs = list(replies)
        w = [self.weights[c] for c in cs]
        if len(cs) < len(self.clients):   # partial participation: renormalise over the round's sample
            w = [x / sum(w) for x in w]
        return weighted_average([replies[c].arrays for c in cs], w)

    def step(self, t):
        replies = self.broadcast("train", "weights", state_arrays(self.model))
        load_arrays(self.model, self.aggregate(replies))


class FedAvg(MethodPlugin):
    name = "fedavg"
    title = "FedAvg"
    Params = Params
    Server = FedAvgServer
    Client = FedAvgClient
    partial_participation = True
    kinds = ("n_samples", "weights")
    aggregate_share = staticmethod(uniform_mean)
