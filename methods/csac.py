"""CSAC (Yuan et al., TKDE 2023): collaborative semantic aggregation and calibration (methods.md §3).

Protocol:
- Round 0, semantic acquisition: every client trains its own model G_h for ``acquire_epochs`` epochs with
  label-smoothed cross-entropy (eq. 2, smoothing 0.1), keeps a frozen copy as its local model L^h (it never leaves
  the client) and uploads G_h (kind ``weights``).
- Server, every round: fuse the uploaded models per state tensor (eq. 4),
  M_l = sum_h w_{h,l} G_{h,l}, w_{h,l} = ||G_{h,l} - avg_l||_2 / sum_h' ||G_{h',l} - avg_l||_2:
  a model farther from the mean gets a larger weight. If every distance is 0 the tensors are equal and one is
  copied. Integer buffers (``num_batches_tracked``) get the same weights, rounded. Broadcast M (kind ``weights``).
- Client calibration (eq. 11): a copy of M is trained on local data with CE(M(x), y) + lam * L_AL, lam = 0.6,
  L_AL = sum_{l, m in R} alpha_{l,m} MMD(Proj_l(M_l(x)), Proj_m(L^h_m(x))) (eq. 6). R = the last ``align_stages``
  trunk stages of ``Net.stages`` (the paper: the last three ResNet-18 blocks, the two convs of the MNIST CNN), plus
  the neck feature when ``align_neck``. Proj_l is one convolution per layer (shared by M's and L^h's feature of
  that layer, as eq. 5's single Proj) onto the size of the last adopted layer with ``proj_channels`` channels:
  a valid conv of kernel 1 + H_l - H_R. alpha_{l,m} = (softmax_m avg(A_l^T B_m) + softmax_m avg(A_l B_m^T)) / 2
  (eqs. 7-9; A_l, B_m: the projected features reshaped to c x (g*w); avg also runs over the batch). MMD is the
  DAN-style multi-kernel estimator with 5 Gaussian kernels, sigma^2 = a * mean pairwise squared distance of the
  joint batch, a in {3^-3, ..., 3}, equal kernel weights. Projections are created afresh every round and trained
  with the model (as the code's ``att_optimizer``); alpha is a detached weight (the code takes ``.item()``).
  The calibrated M is uploaded (kind ``weights``); repeat for ``rounds`` rounds.
- Only model states cross the wire: L^h, the projections and the attention never leave the client.

Paper vs. official code (methods.md §3); the paper is the default:
- ``alignment = "official"``: the objective the released code actually optimises. In its default ``--mode alpha``
  ``DAAttention`` returns no fused-model features, so the cross-layer sum runs zero times (L_AL = 0) and the
  projection/attention convs get no gradient; what remains is CE + 0.6 * MK-MMD(logits of L^h, logits of M)
  (the ``--addition bone`` term, not in the paper). The paper's cross-layer L_AL is the default.
- ``label_smoothing``: the paper uses 0.1 in acquisition; the code never uses its label-smoothing class (0.0).
- The code projects to 32x7x7 with separate convs for fused and local features, a 3x3 stride-2 conv where the size
  halves, and adds learnable 1x1 query/key convs in its position attention; eqs. 5 and 7 have none of these.
- The code copies a client's tensor whenever any fusion coefficient is 0; here only when all distances are 0.
- The code's ResNet-18 adds a bottleneck (Linear 512->256 + BN1d) that the paper does not describe; not added.
- ``init``: the paper starts every G_h from the same ImageNet-pretrained ResNet-18. ``"shared"`` (default) mirrors
  that for models trained from scratch: the server broadcasts its initial model in round 0 (kind ``weights``;
  with ``model.weights`` set every init is that file anyway). ``"own"``: each client starts from its own seeded
  init; per-tensor fusion of independently initialised nets then averages unaligned units.
- Budget: paper 30 acquisition epochs, 40 rounds, calibration 5 epochs (Rotated MNIST) / 10 (others); code
  SGD lr 0.01, momentum 0.5, no weight decay, optimizer re-created every round (as here). ``acquire_epochs``
  defaults to 5 for the small CNNs and small embedded domains; raise it with --set for the paper's budget.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fdg_audit.api import UserError
from fdg_audit.api.method import (Client, MethodPlugin, Reply, Server, TrainParams, load_arrays, make_optimizer,
                                 state_arrays)

KERNEL_SCALES = tuple(3.0 ** k for k in range(-3, 2))   # sigma^2 multipliers of the 5 Gaussian kernels


@dataclass
class Params(TrainParams):
    momentum: float = 0.5           # code: SGD lr 0.01, momentum 0.5, no weight decay
    weight_decay: float = 0.0
    acquire_epochs: int = 5         # paper: 30 (ResNet-18, ImageNet init)
    label_smoothing: float = 0.1    # paper eq. 2; the released code uses plain CE (0.0)
    lam: float = 0.6                # weight of the alignment loss (eq. 11)
    alignment: str = "paper"        # paper (cross-layer, attention-weighted) | official (MMD between logits)
    align_stages: int = 3           # the last N trunk stages form R (all when fewer)
    align_neck: bool = False        # also align the neck feature (projections then map to 1x1)
    proj_channels: int = 32         # channels of the common projected size (code: 32)
    init: str = "shared"            # shared (server sends one init in round 0) | own (each client's seeded init)

    def __post_init__(self):
        for key, allowed in (("alignment", ("paper", "official")), ("init", ("shared", "own"))):
            if getattr(self, key) not in allowed:
                raise UserError(f"csac {key} = {getattr(self, key)!r}: use one of {', '.join(allowed)}")
        if self.align_stages < 1 and not self.align_neck:
            raise UserError(f"csac align_stages = {self.align_stages}: use >= 1 (or set align_neck = true)")


# ------------------------------------------------------------------------------------------ server side

def fusion_weights(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Eq. 4: w_h = ||G_h - avg|| / sum ||G_h' - avg||; None when every distance is 0 (all tensors equal)."""
    stack = torch.stack([t.double() for t in tensors])
    dist = (stack - stack.mean(0)).reshape(len(tensors), -1).norm(dim=1)
    return None if dist.sum() == 0 else dist / dist.sum()


def fuse(states: list[dict]) -> dict[str, torch.Tensor]:
    """Per-tensor divergence-weighted fusion of full model states (parameters and buffers)."""
    out = {}
    for k, ref in states[0].items():
        w = fusion_weights([s[k] for s in states])
        if w is None:
            out[k] = ref.clone()
            continue
        acc = sum(wh * s[k].double() for wh, s in zip(w, states))
        out[k] = acc.to(ref.dtype) if ref.is_floating_point() else acc.round().to(ref.dtype)
    return out


class CSACServer(Server):
    def begin(self):
        if self.params.init == "shared":
            replies = self.broadcast("acquire", "weights", state_arrays(self.model))
        else:
            replies = self.ask("acquire")
        self.fuse(replies)

    def fuse(self, replies):
        load_arrays(self.model, fuse([replies[c].arrays for c in replies]))   # the round's participants

    def step(self, t):
        self.fuse(self.broadcast("calibrate", "weights", state_arrays(self.model)))


# ------------------------------------------------------------------------------------------ client side

def mk_mmd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Multi-kernel MMD^2 between two equal-size batches (n, ...), DAN's quadratic estimator: within-set means
    over i != j, minus twice the cross mean; bandwidths from the detached mean squared distance of the joint batch.
    (The code's estimator adds the constant 2/(n-1), which changes no gradient; left out.)"""
    n = len(a)
    if n < 2:
        return a.new_zeros(())
    z = torch.cat([a.flatten(1), b.flatten(1)])
    d2 = torch.cdist(z, z).pow(2)
    base = d2.detach().mean().clamp_min(1e-12)
    k = sum(torch.exp(-d2 / (2 * s * base)) for s in KERNEL_SCALES)
    off = 1 - torch.eye(n, device=z.device, dtype=z.dtype)
    within = ((k[:n, :n] * off).sum() + (k[n:, n:] * off).sum()) / (n * (n - 1))
    return within - 2 * k[:n, n:].mean()


def attention_weights(fm: list[torch.Tensor], fl: list[torch.Tensor]) -> torch.Tensor:
    """alpha[l, m] (eqs. 7-9) from projected features (B, c, g, w) of the fused (fm) and local (fl) model."""
    pos = torch.zeros(len(fm), len(fl), device=fm[0].device)
    chan = torch.zeros_like(pos)
    for i, a in enumerate(fm):
        a = a.flatten(2)                                               # A_l: (B, c, d)
        for j, b in enumerate(fl):
            b = b.flatten(2)                                           # B_m: (B, c, d)
            pos[i, j] = torch.bmm(a.transpose(1, 2), b).mean()         # avg(A_l^T B_m), a d x d map
            chan[i, j] = torch.bmm(a, b.transpose(1, 2)).mean()        # avg(A_l B_m^T), a c x c map
    return (pos.softmax(dim=1) + chan.softmax(dim=1)) / 2


def projections(shapes: list[torch.Size], channels: int) -> nn.ModuleList:
    """One valid convolution per layer onto (channels, H_R, W_R), the spatial size of the last layer in R."""
    hr, wr = shapes[-1][-2:]
    return nn.ModuleList(nn.Conv2d(s[0], channels, (1 + s[-2] - hr, 1 + s[-1] - wr)) for s in shapes)


class CSACClient(Client):
    def layers(self, net, x):
        """Logits and the features of the layers in R, each (B, C, H, W) (the neck as (B, D, 1, 1))."""
        outs = net.stages(x)
        feat = net.neck(outs[-1])
        chosen = outs[-self.params.align_stages:] if self.params.align_stages > 0 else []
        if self.params.align_neck:
            chosen = chosen + [feat[:, :, None, None]]
        return net.head(feat), chosen

    def on_acquire(self, msg):
        """Semantic acquisition: train G_h alone, keep it frozen as L^h, upload it."""
        model = self.new_model()
        if msg is not None:
            load_arrays(model, msg.arrays)
        ls = self.params.label_smoothing
        self.fit(model, lambda m, x, y: F.cross_entropy(m(x), y, label_smoothing=ls),
                 epochs=self.params.acquire_epochs)
        self.local = copy.deepcopy(model).eval().requires_grad_(False)
        return Reply("weights", state_arrays(model))

    def calibration_loss(self, model, x, y):
        p = self.params
        logits, fm = self.layers(model, x)
        with torch.no_grad():
            local_logits, fl = self.layers(self.local, x)
        loss = F.cross_entropy(logits, y)
        if p.alignment == "official":
            return loss + p.lam * mk_mmd(local_logits, logits)
        fm = [proj(f) for proj, f in zip(self.proj, fm)]
        fl = [proj(f) for proj, f in zip(self.proj, fl)]
        with torch.no_grad():
            alpha = attention_weights(fm, fl)
        align = sum(alpha[i, j] * mk_mmd(a, b) for i, a in enumerate(fm) for j, b in enumerate(fl))
        return loss + p.lam * align

    def on_calibrate(self, msg):
        model = load_arrays(self.new_model(), msg.arrays)
        params = list(model.parameters())
        if self.params.alignment == "paper":
            with torch.no_grad():
                shapes = [f.shape[1:] for f in self.layers(self.local, self.train.x[:2])[1]]
            self.proj = projections(shapes, self.params.proj_channels).to(self.device)
            params += list(self.proj.parameters())
        self.fit(model, self.calibration_loss, opt=make_optimizer(self.params, params))
        return Reply("weights", state_arrays(model))


class CSAC(MethodPlugin):
    # why plan refuses privacy.dp_sgd (fdg_audit/privacy/dpsgd.py refuse): no per-example objective
    dp_sgd_refused = ("its MK-MMD alignment compares the batch's feature distribution,"
                      " coupling the examples of a batch")
    name = "csac"
    Params = Params
    Server = CSACServer
    Client = CSACClient
    kinds = ("weights",)
    partial_participation = True   # a sampled round fuses its sample's models (the fusion takes any set of models)
