"""CSAC (Yuan et al., TKDE 2023): collaborative semantic aggregation and calibration (docs/methods.md §3).

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

Paper vs. official code (docs/methods.md §3); the paper is the default:
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
- ``fusion = "dp"`` (a deviation, for client-level DP under a trusted aggregator; not in the paper or the code):
  eq. 4's weights depend on every upload and are unbounded, so one client could move the fused model arbitrarily
  and central DP cannot cover it. Here each client sends with its model the per-tensor distances to the model it
  received, ||G_{h,l} - M_l|| (``stat/distance``: a function of its own update only; client-level DP clips them
  with the update and adds noise ``stat_noise`` of their own), and the server weighs tensor l by those distances as
  eq. 4 does, moved into [1 / (rho K), rho / K] and summing to 1 (``box_weights``, rho = ``fusion_share``). The
  distance to the received global replaces the distance to the mean of the uploads (which depends on every
  client). ``aggregate_share`` tells client-level DP the bound rho, so central mode scales each client's noise
  by rho and the fused model carries at least the configured noise multiplier.
- Budget: paper 30 acquisition epochs, 40 rounds, calibration 5 epochs (Rotated MNIST) / 10 (others); code
  SGD lr 0.01, momentum 0.5, no weight decay, optimizer re-created every round (as here). ``acquire_epochs``
  defaults to 5 for the small CNNs and small embedded domains; raise it with --set for the paper's budget.
"""
from __future__ import annotations

import copy
import math
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
    fusion: str = "paper"           # paper (eq. 4) | dp (bounded weights from privatized distances; a deviation)
    fusion_share: float = 2.0       # dp: rho, every weight in [1 / (rho K), rho / K]

    def __post_init__(self):
        if not self.fusion_share >= 1:
            raise UserError(f"csac fusion_share = {self.fusion_share}: use a number >= 1 (1 = the uniform mean)")
        for key, allowed in (("alignment", ("paper", "official")), ("init", ("shared", "own")),
                             ("fusion", ("paper", "dp"))):
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


def box_weights(d: torch.Tensor, rho: float) -> torch.Tensor:
    """The DP fusion's weights of one tensor: proportional to the clients' (noised) distances d as eq. 4 would make
    them, moved into [1 / (rho K), rho / K] and summing to 1: clamp(lam * d, lo, hi) with lam found by bisection."""
    k = len(d)
    lo, hi = 1 / (rho * k), rho / k
    v = d.double().clamp(min=0) + 1e-12 * (float(d.abs().max()) + 1e-12)   # every weight can reach hi
    a, b = 0.0, hi / float(v.min())
    for _ in range(100):
        lam = (a + b) / 2
        a, b = (lam, b) if float((lam * v).clamp(lo, hi).sum()) < 1 else (a, lam)
    w = (b * v).clamp(lo, hi)
    return w / w.sum()


def fuse_dp(states: list[dict], dist: list[torch.Tensor], rho: float) -> dict[str, torch.Tensor]:
    """``fusion = "dp"``: each float tensor fused with ``box_weights`` of the clients' privatized distances (one per
    float tensor, in state order); integer buffers averaged uniformly and rounded."""
    out, j, d = {}, 0, torch.stack([t.double() for t in dist])
    for k, ref in states[0].items():
        if ref.is_floating_point():
            w, j = box_weights(d[:, j], rho), j + 1
        else:
            w = torch.full((len(states),), 1 / len(states), dtype=torch.float64)
        acc = sum(wh * s[k].double() for wh, s in zip(w, states))
        out[k] = acc.to(ref.dtype) if ref.is_floating_point() else acc.round().to(ref.dtype)
    return out


def distances(model: nn.Module, received: dict) -> torch.Tensor:
    """Per float tensor of the state: ||G_l - M_l||, M what the client received (zero where nothing was)."""
    return torch.stack([(v.double() - received[k].to(v.device).double() if k in received else v.double()).norm()
                        for k, v in model.state_dict().items() if v.is_floating_point()])


class CSACServer(Server):
    def begin(self):
        if self.params.init == "shared":
            replies = self.broadcast("acquire", "weights", state_arrays(self.model))
        else:
            replies = self.ask("acquire")
        self.fuse(replies)

    def fuse(self, replies):
        states = [{k: v for k, v in replies[c].arrays.items() if not k.startswith("stat/")} for c in replies]
        if self.params.fusion == "dp":   # the round's participants
            load_arrays(self.model, fuse_dp(states, [replies[c]["stat/distance"] for c in replies],
                                            self.params.fusion_share))
        else:
            load_arrays(self.model, fuse(states))

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
        return self.upload(model, {} if msg is None else msg.arrays)

    def upload(self, model, received):
        stats = {"stat/distance": distances(model, received)} if self.params.fusion == "dp" else {}
        return Reply("weights", state_arrays(model) | stats)

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
        return self.upload(model, msg.arrays)


class CSAC(MethodPlugin):
    # why plan refuses privacy.dp_sgd (fdg_audit/privacy/dpsgd.py refuse): no per-example objective
    dp_sgd_refused = ("its MK-MMD alignment compares the batch's feature distribution,"
                      " coupling the examples of a batch")
    name = "csac"
    title = "CSAC"
    Params = Params
    Server = CSACServer
    Client = CSACClient
    kinds = ("weights",)
    partial_participation = True   # a sampled round fuses its sample's models (the fusion takes any set of models)

    @staticmethod
    def aggregate_share(params) -> float:
        return params.fusion_share if params.fusion == "dp" else math.inf

    @staticmethod
    def update_stats(params) -> bool:
        return params.fusion == "dp"
