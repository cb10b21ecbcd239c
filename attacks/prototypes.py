"""Attacks on FPL's class prototypes (docs/attacks.md §5.4, table row P1).

What FPL sends (methods/fpl.py): every round each client uploads the per-class means of its training features
(kind ``prototypes``, arrays ``{"proto": (C_present, D), "classes": (C_present,)}``) next to its model (kind
``weights``); the server (default adversary) sees both, and the global model it broadcast.

* ``PrototypeInversion`` ("prototype_inversion"): for each uploaded prototype p of class c, Adam on pixels
  minimising ||e(x) - p||^2 / ||p||^2 + tv * TV(x) (+ ``prior`` * ||x - m_c||^2), batched over all prototypes of a
  message, with e = ``features`` of the model the client uploaded in the same round (``model = "upload"``, the
  closest to the last-epoch features the prototype averages) or the global model the server broadcast
  (``"broadcast"``). Start: m_c, the attacker's public mean image of class c (the public mean if c is absent
  there); ``resolution`` > 0 optimises a resolution x resolution image upsampled bilinearly (a smoothness prior).
  Output: one reconstruction per class, variant ``c<class>``, scored against the victim's images of that class
  (truth ``proto_c<class>``, Hungarian = the best-matching one); baseline m_c. The number of images behind each
  prototype is in the truth ``proto`` (``counts``): small counts make the prototype one image's feature vector.
  Positive control: with an injective feature map (a wide conv layer, flattened) a one-image prototype is
  inverted to >= 25 dB. For the small CNNs' 64/128-d features the feature loss reaches ~0 while the pixels stay
  far from the source (many images share a feature vector): that negative result is only meaningful next to
  the passing control.
* ``ClassPresence`` ("prototype_classes"): the classes a client has are exactly the rows of its prototype
  message. Estimate ``label_counts``: n_k / |present| on each present class when the client's n_k was sent
  (FPL's n_k-weighted FedAvg sends it), else 1; the scorer's existence F1 is the headline, count accuracy is the
  uniform-over-present guess. Control: a synthetic message's classes come back exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fdg_audit.api import Net, records
from fdg_audit.api import metrics as M
from fdg_audit.api.attack import Attack, AttackParams, Control, Estimate, Reconstruction, sample_victims

from .images import total_variation

KIND = "prototypes"


def prototype_uploads(view, rnd: int = -1, max_victims: int = 0) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """(victim, round, proto (C', D), classes (C',)) of the clients' uploads this adversary saw, in round ``rnd``
    (-1 = each victim's last, 0 = every round)."""
    msgs = [m for m in view.messages(kind=KIND) if m.sender != "server" and m.sender != view.me]
    by_victim: dict[str, list] = {}
    for m in msgs:
        by_victim.setdefault(m.sender, []).append(m)
    out = []
    for v in sample_victims(view, sorted(by_victim), max_victims):
        ms = sorted(by_victim[v], key=lambda m: m.round)
        ms = ms[-1:] if rnd == -1 else ms if rnd == 0 else [m for m in ms if m.round == rnd]
        for m in ms:
            a = m.payload.arrays
            out.append((v, m.round, a["proto"].float(), a["classes"].long()))
    return out


def sent_n(view, victim: str) -> float | None:
    """The client's n_k if it reported it (kind ``n_samples``) and this adversary saw it."""
    for m in view.messages(kind="n_samples", sender=victim):
        return float(m.payload["n"])
    return None


def invert_features(model, target: torch.Tensor, init: torch.Tensor, steps: int, lr: float, tv: float,
                    prior: float = 0.0, resolution: int = 0) -> torch.Tensor:
    """Images whose ``model.features`` match ``target`` (N, D): Adam (cosine-decayed lr) on pixels in [0, 1], or on
    a low-resolution image upsampled bilinearly; per image ||e(x) - p||^2 / ||p||^2 + tv TV + prior ||x - init||^2."""
    h, w = init.shape[-2:]

    def up(z):
        return F.interpolate(z, size=(h, w), mode="bilinear", align_corners=False) if resolution else z
    z = (F.interpolate(init, size=(resolution, resolution), mode="bilinear", align_corners=False) if resolution
         else init).clone().requires_grad_(True)
    opt = torch.optim.Adam([z], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, steps))
    norm = (target ** 2).sum(1).clamp_min(1e-12)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x = up(z)
        loss = ((model.features(x) - target) ** 2).sum(1) / norm + tv * total_variation(x)
        if prior:
            loss = loss + prior * ((x - init) ** 2).flatten(1).mean(1)
        loss.sum().backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            z.clamp_(0, 1)
    return up(z).detach()


def _model(view, victim: str, rnd: int, which: str):
    up = view.messages(kind="weights", sender=victim, round=rnd)
    down = view.messages(kind="weights", sender="server", receiver=victim, round=rnd)
    m = (up or down) if which == "upload" else (down or up)
    return view.model(m[0].payload.arrays).requires_grad_(False) if m else None


@dataclass
class InversionParams(AttackParams):
    model: str = "upload"        # upload (the client's model of the same round) | broadcast (the global model)
    round: int = -1              # -1 = the last round, 0 = every round, t = round t
    steps: int = 600
    lr: float = 0.05
    tv: float = 0.02
    prior: float = 0.0
    resolution: int = 0          # > 0: optimise at this resolution, upsampled (smoothness prior)
    seed: int = 0


class PrototypeInversion(Attack):
    name = "prototype_inversion"
    consumes = (KIND,)
    adversary = "server"
    aux = ("public",)
    # one variant per class c ("c0", "c1", ...): the number of classes is the run's, so the entry names the pattern
    outputs = {"c<class>": "pixels optimised from the public mean image of the class until the feature extractor (the "
                           "client's uploaded model, or the broadcast one) maps them onto the class's prototype"}
    priors, knows = {"*": "none"}, ("architecture",)   # box + TV only; the public class mean is the start
    budget = {"*": (("steps",), "")}
    Params = InversionParams

    def run(self, view, aux):
        p = self.p
        gen = torch.Generator().manual_seed(p.seed)
        px, py = aux.public.x.to(self.device), aux.public.y.to(self.device)
        means = torch.stack([px[py == c].mean(0) if (py == c).any() else px.mean(0) for c in range(aux.num_classes)])
        outs = []
        for victim, rnd, proto, classes in prototype_uploads(view, p.round, p.max_victims):
            model = _model(view, victim, rnd, p.model)
            if model is None:
                continue
            base = means[classes.to(self.device)]
            init = (base + 0.02 * torch.randn(base.shape, generator=gen).to(self.device)).clamp(0, 1)
            rec = invert_features(model, proto.to(self.device), init, p.steps, p.lr, p.tv, p.prior, p.resolution)
            for i, c in enumerate(classes.tolist()):
                outs.append(Reconstruction(victim, KIND, rnd, rec[i:i + 1], truth=records.PROTO_CLASS.format(c=c),
                                           rows=None, variant=f"c{c}", baseline=base[i:i + 1]))
        return outs

    def control(self):
        """A one-image prototype through an injective feature map (wide conv layer, flattened) comes back."""
        gen = torch.Generator().manual_seed(self.p.seed)
        torch.manual_seed(self.p.seed)
        size = 16
        dim = 16 * size * size
        net = Net([nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())], nn.Flatten(), nn.Linear(dim, 2), dim)
        net = net.to(self.device).eval().requires_grad_(False)
        from .style import _toy_images
        x = _toy_images(8, gen, size).to(self.device)
        with torch.no_grad():
            proto = net.features(x)
        rec = invert_features(net, proto, torch.full_like(x, 0.5), max(self.p.steps, 300), self.p.lr, 0.0)
        ps = M.psnr(rec.cpu(), x.cpu())
        return [Control("one-image prototype, injective features: median PSNR", "psnr", float(ps.median()), 25.0)]


@dataclass
class PresenceParams(AttackParams):
    round: int = -1


class ClassPresence(Attack):
    name = "prototype_classes"
    consumes = (KIND,)
    adversary = "server"
    aux = ()
    outputs = {"": "reads the classes off the rows of the prototype message; the counts split the n_k the client sent "
                   "evenly over them (1 each if it sent none)"}
    Params = PresenceParams

    @staticmethod
    def estimate(classes: torch.Tensor, num_classes: int, n: float | None) -> np.ndarray:
        v = np.zeros(num_classes)
        c = np.unique(classes.numpy())
        v[c] = (n / len(c)) if n else 1.0
        return v

    def run(self, view, aux):
        C = view.shape[2]
        return [Estimate(victim, KIND, rnd, "label_counts", self.estimate(classes, C, sent_n(view, victim)))
                for victim, rnd, _, classes in prototype_uploads(view, self.p.round, self.p.max_victims)]

    def control(self):
        true = np.array([5, 0, 3, 0, 0, 9, 0, 0, 1, 0])
        est = self.estimate(torch.as_tensor(np.flatnonzero(true)), len(true), float(true.sum()))
        return [Control("synthetic prototype message: existence F1", "f1", M.existence_f1(est, true), 1.0)]
