"""The generic attack's controls: FedAvg plus a data-independent random vector (negative) or the training images as
they are (positive), and ``control_run``, the attack end to end on a small federation of 8x8 digits."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from attacks.generic import GenericArtifact, Params, _sub
from fdg_audit.api import DataConfig, ModelConfig, Split, load_data, load_method
from fdg_audit.api.attack import Reconstruction, Scores, federate
from fdg_audit.api.method import MethodPlugin, Reply


class NoiseClient(load_method("fedavg").Client):
    def on_noise(self, msg):
        """A vector drawn from the client's random stream: nothing of its data."""
        return Reply("scalar", {"z": torch.randn(32, generator=self.gen)})


class RawClient(load_method("fedavg").Client):
    def on_noise(self, msg):
        """The positive control's artifact: the training images as they are."""
        return Reply("scalar", {"x": self.train.x})


class NoiseServer(load_method("fedavg").Server):
    def begin(self):
        super().begin()
        self.ask("noise")


class NoiseMethod(MethodPlugin):
    """The negative control's method: FedAvg plus one data-independent random vector per client in round 0."""
    name = "generic_noise_control"
    Params = load_method("fedavg").Params
    Server, Client = NoiseServer, NoiseClient
    kinds = ("n_samples", "scalar", "weights")


class RawMethod(NoiseMethod):
    """The decoder's positive control: FedAvg plus each client's training images sent as they are in round 0."""
    name = "generic_raw_control"
    Client = RawClient


def control_run(method: str, kind: str, p: Params) -> dict:
    """The attack end to end on a small federation of ``method`` on 8x8 digits: 4 clients of 6 images, candidates of
    6 members and 6 non-members each; the link AUC over all candidates, and how often a decoded image's nearest
    candidate is a member ("reid"), with its chance (the members' share)."""
    from fdg_audit.api import metrics
    data = load_data(DataConfig(dataset="digits", family="rotated", per_domain=60, split_seed=3))
    doms = data.domains[:4]
    k, shape = data.num_classes, (data.channels, data.size, data.num_classes)
    rng = np.random.default_rng(0)
    clients, cands, members, samples = {}, {}, {}, {}
    for d in doms:
        tr, va = d.train, d.val
        mem = rng.choice(len(tr.y), 6, replace=False)
        non = rng.choice(len(va.y), 6, replace=False)
        clients[d.name] = (_sub(tr, mem), _sub(va, non))
        order = rng.permutation(12)
        both = Split(torch.cat([tr.x[mem], va.x[non]]), torch.cat([tr.y[mem], va.y[non]]), np.arange(12))
        cands[d.name], members[d.name] = _sub(both, order), (order < 6).astype(float)
        rest = np.setdiff1d(np.arange(len(tr.y)), mem)
        samples[d.name] = _sub(tr, rest[:40])
    params = load_method(method).Params(rounds=1, local_epochs=1, batch_size=8, lr=0.05)
    view = federate(method, params, ModelConfig(), clients, k, seed=1, run_id="generic-control", until_round=0)
    view.shape = shape
    from fdg_audit.api.attack import Aux
    aux = Aux(public=samples[doms[-1].name], domain_samples=samples, candidates=cands, num_classes=k,
              domains=[d.name for d in doms])
    atk = GenericArtifact(dataclasses.replace(p, kinds=[kind],
                                              pairs=16, max_size=6, steps=200))
    outs = atk.run(view, aux)
    sc = [o for o in outs if isinstance(o, Scores)]
    auc = metrics.auc(np.concatenate([o.scores for o in sc]), np.concatenate([members[o.victim] for o in sc]))
    hits, chance = [], []   # a decoded image's nearest candidate is a member (chance: the members' share)
    for o in outs:
        if isinstance(o, Reconstruction):
            cx = cands[o.victim].x.flatten(1).float()
            near = ((cx[None] - o.images.flatten(1).float()[:, None]) ** 2).mean(-1).argmin(1).numpy()
            hits += list(members[o.victim][near])
            chance += [members[o.victim].mean()] * len(near)
    return dict(auc=float(auc), reid=float(np.mean(hits)) if hits else 0.0,
                chance=float(np.mean(chance)) if chance else 1.0)

