"""FPL: federated prototype learning (Huang et al., CVPR 2023), docs/methods.md §9.

Protocol, every round t (official ``models/fpl.py``):
1. If the server holds cluster prototypes (from round 2 on), it broadcasts them (phase ``global_protos``, kind
   ``prototypes``, arrays ``{"proto": (M, D), "classes": (M,)}``, several rows per class possible).
2. FedAvg: the global state goes down, each client trains and uploads its full state (phase ``train``).
   Local loss per batch: CE + (1/B) sum over samples whose class has prototypes of
   [InfoNCE(f; positives = the cluster prototypes of its class, negatives = all cluster prototypes of the other
   classes; cosine / tau, tau = 0.02) + MSE(f, unbiased prototype of its class)], where f = ``model.features(x)``
   and the unbiased prototype is the mean of the class's cluster prototypes. MSE is ``nn.MSELoss`` (mean over
   dimensions; the paper writes a sum). The regulariser is active only once prototypes exist (round 2 on).
3. During the last local epoch the client collects its training-mode features per class and uploads the per-class
   means of the classes it has (phase ``local_protos``, kind ``prototypes``, arrays ``{"proto": (C_present, D),
   "classes": (C_present,)}``). Truth: ``proto`` (``idx`` of the training images, ``y``, ``counts`` per class over
   all classes) and ``proto_c<c>`` (the ids of class c's images), so a scorer can match a class's reconstruction to
   that class's images.
4. The server, per class: FINCH (cosine, first-neighbour clustering) over the client prototypes, the coarsest
   partition it returns, the mean of each cluster = the cluster prototypes of the next round. Then the n_k-weighted
   FedAvg of the model (FPL's "weight" averaging; n_k is sent once, as in FedAvg).

Degeneracy (docs/methods.md §9): FINCH's first partition links every point to its first neighbour, so every cluster has
at least two points: with <= 3 clients a class always forms ONE cluster, its cluster prototype equals the unbiased
prototype, InfoNCE has a single positive and the MSE pulls to the same point. The paper's real multi-cluster
behaviour needs several clients per domain (its experiments use 10 clients over 4 domains).

Observed here (embedded digits, cnn_small from scratch, 3 local epochs): with the official tau = 0.02 the
InfoNCE term (gradients ~ 1/tau) takes over as soon as it starts in round 2 and training collapses to chance;
tau = 0.5 trains as well as FedAvg. The official setting trains a ResNet-10 for 10 local epochs before the first
prototypes exist.

Deviations: local epochs, lr and optimizer come from the shared TrainParams (FPL: SGD lr 0.01, momentum 0.9,
wd 1e-5, 10 epochs); with ``local_steps`` > 0 the prototypes are the means over the last ceil(n/B) steps (a subset).
"""
from __future__ import annotations

from dataclasses import dataclass

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.api import UserError, records
from fdg_audit.api.method import MethodPlugin, Reply, load_arrays, state_arrays

from .fedavg import FedAvgClient, FedAvgServer, uniform_mean
from .fedavg import Params as FedAvgParams


@dataclass
class Params(FedAvgParams):
    tau: float = 0.02                # InfoNCE temperature (official infoNCET)

    def __post_init__(self):
        if self.tau <= 0:
            raise UserError(f"fpl tau = {self.tau!r}: use a positive temperature, e.g. 0.02")


# ------------------------------------------------------------------------------------------ FINCH

def finch(x) -> list[np.ndarray]:
    """FINCH partitions (Sarfraz et al., CVPR 2019; the authors' package ``finch-clust``, cosine distance), finest
    first, each a label per row of x (n, D). Partition 0 groups first neighbours; each later one groups the previous
    clusters' means. (On 200 random inputs of 2 to 40 points each, the package's partitions equal those of the
    hand-written version this replaces, and of ``ensure_early_exit = False``.)"""
    with warnings.catch_warnings():          # the package warns at import that its optional ANN backend is absent
        warnings.simplefilter("ignore")
        from finch import FINCH
    c, _, _ = FINCH(np.asarray(x, dtype=np.float64), distance="cosine", verbose=False)
    c = np.asarray(c).reshape(len(x), -1)
    return [c[:, j].astype(np.int64) for j in range(c.shape[1])]


def cluster_prototypes(protos: list[torch.Tensor], classes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class: FINCH over the clients' prototypes, its coarsest partition, the cluster means.
    Returns (proto (M, D), classes (M,))."""
    P, c = torch.cat(protos).double(), torch.cat(classes).long()
    out_p, out_c = [], []
    for k in torch.unique(c).tolist():
        pk = P[c == k]
        lab = torch.as_tensor(finch(pk.numpy())[-1]) if len(pk) > 1 else torch.zeros(1, dtype=torch.long)
        for g in torch.unique(lab).tolist():
            out_p.append(pk[lab == g].mean(0))
            out_c.append(k)
    return torch.stack(out_p).float(), torch.tensor(out_c, dtype=torch.int64)


def prototype_loss(f: torch.Tensor, y: torch.Tensor, P: torch.Tensor, pc: torch.Tensor, tau: float) -> torch.Tensor:
    """FPL's regulariser, batched: (1/B) sum over samples whose class has prototypes of InfoNCE + MSE to the
    unbiased prototype (mean of the class's cluster prototypes)."""
    has = (y[:, None] == pc[None]).any(1)
    if not has.any():
        return f.sum() * 0
    fy, yy = f[has], y[has]
    sim = F.normalize(fy, dim=1) @ F.normalize(P, dim=1).T / tau                         # (b, M)
    pos = yy[:, None] == pc[None]
    infonce = torch.logsumexp(sim, 1) - torch.logsumexp(sim.masked_fill(~pos, float("-inf")), 1)
    unbiased = (pos.float() @ P) / pos.sum(1, keepdim=True)                                # (b, D)
    mse = ((fy - unbiased) ** 2).mean(1)
    return (infonce + mse).sum() / len(y)


# ------------------------------------------------------------------------------------------ parties

class FPLClient(FedAvgClient):
    def setup(self):
        super().setup()
        self.P = self.pc = None
        self.truth_done = False

    def on_global_protos(self, msg):
        self.P, self.pc = msg["proto"].to(self.device), msg["classes"].to(self.device)

    def local_update(self):
        p, n = self.params, len(self.train.y)
        per_epoch = -(-n // min(p.batch_size, n))
        total = p.local_steps or p.local_epochs * per_epoch
        C = self.shape[3]
        sums = torch.zeros(C, self.model.feature_dim, device=self.device)
        counts = torch.zeros(C, device=self.device)
        step = [0]

        def loss_fn(model, x, y):
            f = model.features(x)
            loss = F.cross_entropy(model.head(f), y)
            if self.P is not None:
                loss = loss + prototype_loss(f, y, self.P, self.pc, p.tau)
            if step[0] >= total - per_epoch:               # the last local epoch: collect training-mode features
                sums.index_add_(0, y, f.detach())
                counts.index_add_(0, y, torch.ones_like(y, dtype=counts.dtype))
            step[0] += 1
            return loss

        self.fit(self.model, loss_fn)
        self.sums, self.counts = sums, counts

    def on_local_protos(self, msg):
        present = torch.nonzero(self.counts > 0).flatten()
        if not self.truth_done:
            y = self.train.y.cpu().numpy()
            self.record_truth(records.PROTO, idx=self.train.idx, y=y, counts=self.counts.cpu().long())
            for c in present.tolist():
                self.record_truth(records.PROTO_CLASS.format(c=c), idx=self.train.idx[y == c])
            self.truth_done = True
        proto = self.sums[present] / self.counts[present, None]
        return Reply("prototypes", {"proto": proto.contiguous(), "classes": present.cpu()})


class FPLServer(FedAvgServer):
    def setup(self):
        self.protos = None

    def step(self, t):
        if self.protos is not None:
            self.broadcast("global_protos", "prototypes", {"proto": self.protos[0], "classes": self.protos[1]})
        replies = self.broadcast("train", "weights", state_arrays(self.model))
        local = self.ask("local_protos")
        self.protos = cluster_prototypes([local[c]["proto"] for c in local],   # the round's participants
                                         [local[c]["classes"] for c in local])
        load_arrays(self.model, self.aggregate(replies))


class FPL(MethodPlugin):
    # why plan refuses privacy.dp_sgd (fdg_audit/privacy/dpsgd.py refuse): no per-example objective
    dp_sgd_refused = ("its prototype losses use class prototypes,"
                      " statistics of the client's whole data and of other clients")
    name = "fpl"
    title = "FPL"
    Params = Params
    Server = FPLServer
    Client = FPLClient
    partial_participation = True   # a sampled round clusters the prototypes of its sample and averages its models
    kinds = ("n_samples", "weights", "prototypes")
    aggregate_share = staticmethod(uniform_mean)   # FedAvg's server
