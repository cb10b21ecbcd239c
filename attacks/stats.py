"""Attacks on normalization statistics and on the dataset size (docs/attacks.md §5.3, §5.6, table row S4 / L1).

* ``NormStatsDomain`` ("norm_stats_domain"), server: which source domain a client holds, from the BatchNorm running
  statistics inside the weights it uploads (only with ``model.norm = "batch"``; GroupNorm models carry none, a
  ``skipped`` row says so). Victim feature: its uploaded running means and variances of every BN layer minus the
  ones the server broadcast that round (local training moves them towards the client's batch statistics by an
  EMA). Shadow features: the attacker passes ``shadow_batches`` random batches (the protocol's batch size) of its
  labelled samples of each source domain (``domain_samples``) through the broadcast model in training mode and
  records the per-batch BN statistics, minus the same broadcast buffers. Every coordinate is scaled by the shadow
  spread; the prediction is the domain whose shadow centroid has the highest cosine with the victim's feature
  (cosine, because the EMA shrinks the victim's shift by an unknown factor). Output: ``Predictions(domain)`` per
  victim. Positive control: three synthetic domains, one local epoch each, all three recovered.
* ``DatasetSize`` ("dataset_size"), server: n_k. Variant ``sent``: read exactly from the ``n_samples`` message
  (FedAvg-style weighting sends it). Otherwise from the round-``round`` update, in order: ``bn_steps``: a BN
  model's ``num_batches_tracked`` grows by one per local step, so steps = upload - broadcast and, with E local
  epochs of batch B, n is in ((steps/E - 1) B, steps/E B]: we report the midpoint (steps/E - 1/2) B;
  ``update_norm``: the attacker trains the broadcast model on its public data with the protocol's optimizer
  settings, records ||theta_s - theta_0|| after every step s, takes the first s whose norm reaches the victim's
  ||delta|| and reports (s/E - 1/2) B (public data stand in for the client's, so gradient scales differ).
  With ``local_steps`` > 0 the step count carries no size information: ``skipped``. CCST clients train on their
  augmented set of N x K images; the estimate is divided by K (the protocol is public).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fdg_audit.api import ModelConfig, build_model, records
from fdg_audit.api import metrics as M
from fdg_audit.api.attack import Attack, AttackParams, Control, Estimate, Predictions, Skipped, sample_victims
from fdg_audit.api.method import TrainParams, make_optimizer

STAT_KEYS = ("running_mean", "running_var")


def bn_vector(arrays: dict) -> torch.Tensor | None:
    """All BN running means and variances of a state, concatenated (None when the model has no BatchNorm)."""
    keys = sorted(k for k in arrays if k.rsplit(".", 1)[-1] in STAT_KEYS)
    return torch.cat([arrays[k].double().flatten() for k in keys]) if keys else None


def weights_pair(view, victim: str, rnd: int) -> tuple[dict, dict] | None:
    """(broadcast state, uploaded state) of one client in round ``rnd``, as the server saw them."""
    down = view.messages(kind="weights", sender="server", receiver=victim, round=rnd)
    up = view.messages(kind="weights", sender=victim, round=rnd)
    return (down[0].payload.arrays, up[0].payload.arrays) if down and up else None


def weight_rounds(view, victim: str, rnd: int) -> list[int]:
    rounds = sorted({m.round for m in view.messages(kind="weights", sender=victim)})
    if not rounds:
        return []
    return rounds if rnd == 0 else [rounds[-1]] if rnd == -1 else [r for r in rounds if r == rnd]


@torch.no_grad()
def batch_stats(model: nn.Module, x: torch.Tensor, batch: int, n_batches: int, gen: torch.Generator) -> torch.Tensor:
    """BN statistics of ``n_batches`` random batches of x through model (train mode), (n_batches, F)."""
    m = copy.deepcopy(model).train()
    for mod in m.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.momentum = 1.0              # running stats := this batch's statistics
    out = []
    for _ in range(n_batches):
        idx = torch.randperm(len(x), generator=gen)[:min(batch, len(x))].to(x.device)
        m(x[idx])
        out.append(bn_vector(m.state_dict()))
    return torch.stack(out)


def nearest_centroid_cosine(shadow: torch.Tensor, labels: np.ndarray, query: torch.Tensor) -> np.ndarray:
    """Scale coordinates by the shadow spread (floored at its median, so near-constant coordinates cannot dominate);
    predict the label whose centroid has the highest cosine."""
    sd = shadow.std(0)
    sd = sd + sd.median().clamp_min(1e-12)
    z, q = shadow / sd, query / sd
    ks = np.unique(labels)
    cent = torch.stack([z[torch.as_tensor(labels == k)].mean(0) for k in ks])
    return ks[(F.normalize(q, dim=-1) @ F.normalize(cent, dim=-1).T).argmax(-1).numpy()]


@dataclass
class NormStatsParams(AttackParams):
    round: int = -1               # -1 = the last round, 0 = every round, t = round t
    shadow_batches: int = 16
    seed: int = 0


class NormStatsDomain(Attack):
    name = "norm_stats_domain"
    consumes = ("weights",)
    adversary = "server"
    aux = ("domain_samples",)
    outputs = {"": "the BatchNorm running statistics in the upload, against shadow batches of public samples of each "
                   "source domain through the broadcast model"}
    knows = ("architecture", "bn_statistics")
    Params = NormStatsParams

    def cost(self) -> dict:   # the cost guard (fdg_audit.audit.coverage.estimate): its own CPU s per run, main job's
        return {"run": 0.5}

    @staticmethod
    def classify(model, glob: torch.Tensor, victims: torch.Tensor, samples: list[torch.Tensor], batch: int,
                 n_batches: int, gen) -> np.ndarray:
        shadow = torch.cat([batch_stats(model, x, batch, n_batches, gen) - glob for x in samples])
        labels = np.repeat(np.arange(len(samples)), n_batches)
        return nearest_centroid_cosine(shadow, labels, victims - glob)

    def run(self, view, aux):
        gen = torch.Generator().manual_seed(self.p.seed)
        samples = [aux.domain_samples[d].x.to(self.device) for d in aux.domains]
        outs = []
        for victim in sample_victims(view, view.clients, self.p.max_victims):
            for rnd in weight_rounds(view, victim, self.p.round):
                down, up = weights_pair(view, victim, rnd)
                glob, mine = bn_vector(down), bn_vector(up)
                if glob is None:
                    outs.append(Skipped(victim, "weights", rnd, "the model has no BatchNorm statistics "
                                        "(model.norm = \"batch\" shares them)"))
                    continue
                model = view.model(down)
                pred = self.classify(model, glob.to(self.device), mine.to(self.device)[None], samples,
                                     int(view.settings.batch_size), self.p.shadow_batches, gen)
                outs.append(Predictions(victim, "weights", rnd, "domain", pred, len(aux.domains), records.TRAIN,
                                        np.zeros(1, dtype=int)))
        return outs

    def control(self):
        """Three synthetic colour domains; a client trains one epoch from a shared BN model; its domain is found."""
        gen = torch.Generator().manual_seed(self.p.seed)
        torch.manual_seed(self.p.seed)
        model = build_model(ModelConfig(arch="cnn_small", norm="batch"), 3, 4, 16).to(self.device)
        base = torch.rand(3 * 64, 3, 16, 16, generator=gen) * 0.3
        tint = torch.tensor([[0.6, 0, 0], [0, 0.6, 0], [0, 0, 0.6]]).repeat_interleave(64, 0)[..., None, None]
        x = (base + tint).clamp(0, 1).to(self.device)
        y = torch.randint(0, 4, (3 * 64,), generator=gen).to(self.device)
        glob = bn_vector(model.state_dict())
        found = []
        for d in range(3):
            m = copy.deepcopy(model).train()
            opt = make_optimizer(TrainParams(lr=0.05), m.parameters())
            xd, yd = x[d * 64:(d + 1) * 64][:48], y[d * 64:(d + 1) * 64][:48]
            for i in range(0, 48, 16):
                opt.zero_grad()
                F.cross_entropy(m(xd[i:i + 16]), yd[i:i + 16]).backward()
                opt.step()
            shadow = [x[k * 64 + 48:(k + 1) * 64] for k in range(3)]
            pred = self.classify(model.eval(), glob, bn_vector(m.state_dict())[None], shadow, 16, 4, gen)
            found.append(int(pred[0] == d))
        return [Control("three synthetic domains from BN buffers: accuracy", "accuracy", float(np.mean(found)), 1.0)]


# ------------------------------------------------------------------------------------------ dataset size

def augmentation_factor(view) -> int:
    """Images a client trains on per own image: CCST's K (0 = every source), else 1."""
    if view.method == "ccst":
        k = int(view.settings.K)
        return min(k, len(view.clients)) if k else len(view.clients)
    return 1


def _flat(arrays: dict) -> torch.Tensor:
    return torch.cat([v.double().flatten() for k, v in arrays.items() if v.is_floating_point() and
                      k.rsplit(".", 1)[-1] not in STAT_KEYS])


# how ``estimate_size`` found n_k, by the variant it names
SIZE_WORDS = {"sent": "reads the value the client sent",
              "bn_steps": "n_k from BatchNorm's step counter in the upload and the public epochs and batch size "
                          "(within one batch)",
              "update_norm": "n_k from the update norm against the attacker's own training of the broadcast model on "
                             "public images (its gradient scale stands in for the client's)"}


@dataclass
class SizeParams(AttackParams):
    round: int = 1
    max_steps: int = 200          # update_norm: longest shadow run (steps)
    seed: int = 0


def size_from_steps(steps: float, view) -> float:
    p = view.settings
    return max(1.0, (steps / max(1, p.local_epochs) - 0.5) * p.batch_size) / augmentation_factor(view)


def shadow_norms(view, down: dict, public, max_steps: int, gen, stop: float = float("inf")) -> np.ndarray:
    """The attacker's calibration: train the broadcast model on public data with the protocol's optimizer and
    record ||theta_s - theta_0|| (parameters only) after every step; stop after the first step whose norm
    reaches ``stop`` (the curve's running maximum is all the estimator reads, so later steps change nothing)."""
    p = view.settings
    model = view.model(down).train().requires_grad_(True)
    opt = make_optimizer(p, model.parameters())   # the protocol's lr, optimizer, momentum and weight decay
    x, y = public.x.to(view.device), public.y.to(view.device)
    b = min(int(p.batch_size), len(y))
    start = _flat(dict(model.state_dict()))
    norms = []
    for _ in range(max_steps):
        idx = torch.randperm(len(y), generator=gen)[:b].to(view.device)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        norms.append(float((_flat(dict(model.state_dict())) - start).norm()))
        if norms[-1] >= stop:
            break
    return np.maximum.accumulate(np.array(norms))


def estimate_size(view, victim: str, rnd: int, public=None, max_steps: int = 200, gen=None):
    """(n_k estimate, variant) from what the server saw, or (None, reason)."""
    for m in view.messages(kind="n_samples", sender=victim):
        return float(m.payload["n"]), "sent"
    if view.settings.local_steps:
        return None, "local_steps > 0: the step count does not depend on n_k"
    pair = weights_pair(view, victim, rnd)
    if pair is None:
        return None, f"no weights of {victim} in round {rnd}"
    down, up = pair
    nbt = [k for k in up if k.endswith("num_batches_tracked")]
    if nbt:
        return size_from_steps(float(up[nbt[0]] - down[nbt[0]]), view), "bn_steps"
    if public is None:
        return None, "no n_samples, no BN step counter and no public data for the update-norm calibration"
    target = float((_flat(up) - _flat(down)).norm())
    curve = shadow_norms(view, down, public, max_steps, gen or torch.Generator().manual_seed(0), target)
    steps = int(np.searchsorted(curve, target)) + 1
    return size_from_steps(min(steps, max_steps), view), "update_norm"


class DatasetSize(Attack):
    name = "dataset_size"
    consumes = ("n_samples", "weights")
    adversary = "server"
    aux = ("public",)
    outputs = SIZE_WORDS
    knows = ("architecture", "local_hyperparams")   # the update-norm estimate replays local training on public data
    Params = SizeParams

    def cost(self) -> dict:   # the cost guard: its own CPU s per run (the main job's)
        return {"run": 0.5}

    def run(self, view, aux):
        gen = torch.Generator().manual_seed(self.p.seed)
        outs = []
        for victim in sample_victims(view, view.clients, self.p.max_victims):
            rnds = weight_rounds(view, victim, self.p.round) or [0]
            n, how = estimate_size(view, victim, rnds[0], aux.public, self.p.max_steps, gen)
            if n is None:
                outs.append(Skipped(victim, "weights", rnds[0], how))
            else:
                art = "n_samples" if how == "sent" else "weights"
                outs.append(Estimate(victim, art, 0 if how == "sent" else rnds[0], "n_samples", np.array([n]), how))
        return outs

    def control(self):
        """BN step counting on a simulated client: 3 epochs over 100 images, batch 16 -> within one batch."""
        class V:
            method, clients = "fedavg", ["a"]
            settings = TrainParams(local_epochs=3, batch_size=16, local_steps=0)
        steps = 3 * -(-100 // 16)
        err = M.relative_error(size_from_steps(steps, V), 100)
        return [Control("BN step count, n = 100: relative error", "rel_error", float(err), 0.08, positive=False)]
