"""COPA: collaborative optimization and aggregation (Wu & Gong, ICCV 2021), docs/methods.md §4. No official code
exists; everything follows the paper (its Sec. 3, Alg. 1, Sec. 4.1) and the choices below.

Model: a global feature extractor F (the harness's Net without its head) and one classifier head C_i per source
client (``Linear(feature_dim, C)``, each initialised separately by the server). Protocol, every round t:
1. ``heads``: the server broadcasts ALL heads to every client (kind ``head``, arrays ``"<client>/weight"``,
   ``"<client>/bias"``), so each client receives the other domains' classifiers.
2. ``train``: the server broadcasts F_t (kind ``weights``, the Net state without ``head.*``). Client i sets
   F_i <- F_t and C_i <- its own head, keeps the others C'_j frozen, and trains F_i and C_i (``local_epochs``, the
   paper's m = 1) on  CE(C_i(F_i(x)), y) + sum_{j != i} CE(C'_j(F_i(A(x))), y)  (eq. 5), then uploads F_i
   (kind ``weights``).
3. ``head``: the client uploads its head C_i (kind ``head``).
4. The server sets F_{t+1} = (1/n) sum_i F_i (alpha_i = 1/n, the paper's DG setting; every key, HBIN/BN running
   statistics included: whether the paper aggregates them is not stated [unverified]) and optionally adds white
   Gaussian noise of std ``agg_noise`` to every averaged parameter (not to buffers): "a white noise can be added to
   Eq. (6)". The noise is added at the server after aggregation, so the uploads in the ledger are noise-free.
   Heads are not averaged: C_i is replaced by client i's upload.
Inference (``global_model()``): F_t followed by the ensemble of all heads, the average of their softmax
probabilities (the module returns its log). The paper does not say how the heads are combined for DG
(eq. 7 sums the heads' predictions for pseudo-labels) [unverified choice].

A (a deviation): the paper uses RandAugment (+ Cutout on PACS), which needs torchvision/PIL per image. We use a
cheap batched stand-in on the device: a random integer translation by up to ``aug_shift`` pixels (zero fill),
random contrast and brightness (factor 1 +- ``aug_jitter``, offset +- ``aug_jitter``/2), optional horizontal flips
(``aug_flip``; off by default since digits are not flip-invariant) and Gaussian noise of std ``aug_noise``, then
clipped to [0, 1]. No rotations, so rotated-digit targets are not seen through A. C_i sees un-augmented images (the
paper's "standard augmentation").

HBIN (``norm_layer = "hbin"``, the paper's default): every BatchNorm2d/GroupNorm of F is replaced by a hybrid
batch-instance norm (eq. 2-4): mean = w_bn mu_bn + w_in mu_in, var = w'_bn var_bn + w'_in var_in with
(w_bn, w_in) = softmax(lambda), (w'_bn, w'_in) = softmax(lambda'), lambda and lambda' learnable, ONE pair per
layer (per layer or per channel is not stated [unverified]; init 0 = equal mix), eps = 1e-5, the affine gamma and
beta copied from the replaced layer. mu_bn/var_bn are the batch statistics in training (eq. 3) and running averages
(momentum 0.1) at test time, as BatchNorm. ``norm_layer = "model"`` keeps the model's own norm layers
(``model.norm``). HBIN uses batch statistics, so it does not combine with per-sample DP-SGD (Opacus refuses BN).
``model.norm = "none"`` has no layer to replace: hbin then raises a UserError.

Other deviations: lr schedule (paper: cosine per round, lr 0.002, batch 30), optimizer (SGD, re-created each
round) and the model come from the shared settings; no UDA steps (2 and 4 of Alg. 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fdg_audit.api import UserError
from fdg_audit.api.method import (Client, MethodPlugin, Party, Reply, Server, TrainParams, default_build, load_arrays,
                                 state_arrays)

from .fedavg import weighted_average

NORM_LAYERS = ("hbin", "model")


@dataclass
class Params(TrainParams):
    norm_layer: str = "hbin"         # hbin (paper) | model (keep model.norm)
    agg_noise: float = 0.0           # std of white noise added to the aggregated F (0 = off)
    aug_shift: int = 2               # A: max translation in pixels
    aug_jitter: float = 0.3          # A: contrast/brightness jitter
    aug_noise: float = 0.05          # A: Gaussian pixel noise std
    aug_flip: bool = False           # A: random horizontal flips

    def __post_init__(self):
        if self.norm_layer not in NORM_LAYERS:
            raise UserError(f"copa norm_layer = {self.norm_layer!r}: use one of {', '.join(NORM_LAYERS)}")
        if self.agg_noise < 0 or self.aug_shift < 0 or self.aug_jitter < 0 or self.aug_noise < 0:
            raise UserError("copa agg_noise, aug_shift, aug_jitter and aug_noise must be >= 0")


class HBIN(nn.Module):
    """Hybrid batch-instance normalisation (COPA eq. 2-4) for (B, C, H, W) maps."""

    def __init__(self, channels: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.mean_logits = nn.Parameter(torch.zeros(2))      # (bn, in) for the mean
        self.var_logits = nn.Parameter(torch.zeros(2))       # (bn, in) for the variance
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mu_in = h.mean((2, 3), keepdim=True)
        var_in = h.var((2, 3), keepdim=True, unbiased=False)
        if self.training:
            mu_bn = mu_in.mean(0, keepdim=True)
            var_bn = (var_in + mu_in ** 2).mean(0, keepdim=True) - mu_bn ** 2
            with torch.no_grad():
                n = h.numel() / h.shape[1]
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(m * mu_bn.flatten())
                self.running_var.mul_(1 - m).add_(m * var_bn.flatten() * n / max(n - 1, 1))
        else:
            mu_bn, var_bn = self.running_mean.view(1, -1, 1, 1), self.running_var.view(1, -1, 1, 1)
        w, v = torch.softmax(self.mean_logits, 0), torch.softmax(self.var_logits, 0)
        mean = w[0] * mu_bn + w[1] * mu_in
        var = v[0] * var_bn + v[1] * var_in
        return (h - mean) / torch.sqrt(var + self.eps) * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


def to_hbin(module: nn.Module) -> int:
    """Replace every BatchNorm2d/GroupNorm below ``module`` by HBIN (affine copied); returns how many."""
    n = 0
    for name, child in module.named_children():
        if isinstance(child, (nn.BatchNorm2d, nn.GroupNorm)):
            ch = child.num_features if isinstance(child, nn.BatchNorm2d) else child.num_channels
            new = HBIN(ch, eps=1e-5)
            if getattr(child, "weight", None) is not None:
                new.weight.data.copy_(child.weight.data)
                new.bias.data.copy_(child.bias.data)
            if isinstance(child, nn.BatchNorm2d) and child.running_mean is not None:
                new.running_mean.copy_(child.running_mean)
                new.running_var.copy_(child.running_var)
            setattr(module, name, new)
            n += 1
        else:
            n += to_hbin(child)
    return n


def build(party: Party) -> nn.Module:
    net = default_build(party)
    if party.params.norm_layer == "hbin":
        if to_hbin(net.trunk) + to_hbin(net.neck) == 0:
            raise UserError("copa norm_layer = \"hbin\" replaces the model's norm layers but model.norm = \"none\" "
                            "has none: set model.norm = \"batch\" or \"group\", or copa norm_layer = \"model\"")
    return net.to(party.device)


def augment(x: torch.Tensor, gen: torch.Generator, p: Params) -> torch.Tensor:
    """A(x): batched random translation, contrast/brightness, optional flip, Gaussian noise (on x's device)."""
    b, _, h, w = x.shape
    dev = x.device
    rand = lambda *s: torch.rand(*s, generator=gen).to(dev)  # noqa: E731
    if p.aug_shift:
        s = torch.randint(-p.aug_shift, p.aug_shift + 1, (b, 2), generator=gen).to(dev).float()
        theta = torch.zeros(b, 2, 3, device=dev)
        theta[:, 0, 0] = theta[:, 1, 1] = 1
        theta[:, 0, 2], theta[:, 1, 2] = s[:, 0] * 2 / w, s[:, 1] * 2 / h
        x = F.grid_sample(x, F.affine_grid(theta, list(x.shape), align_corners=False), align_corners=False)
    if p.aug_jitter:
        c = 1 + p.aug_jitter * (2 * rand(b, 1, 1, 1) - 1)
        m = x.mean((1, 2, 3), keepdim=True)
        x = (x - m) * c + m + p.aug_jitter / 2 * (2 * rand(b, 1, 1, 1) - 1)
    if p.aug_flip:
        x = torch.where(rand(b, 1, 1, 1) < 0.5, x.flip(-1), x)
    if p.aug_noise:
        x = x + p.aug_noise * torch.randn(x.shape, generator=gen).to(dev)
    return x.clamp(0, 1)


def copa_loss(model, x, y, xa, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Eq. 5: CE of the own head on x + sum over the frozen heads (W: (J, C, D), b: (J, C)) of CE on A(x)."""
    loss = F.cross_entropy(model(x), y)
    if len(W):
        logits = torch.einsum("bd,jcd->jbc", model.features(xa), W) + b[:, None]
        loss = loss + len(W) * F.cross_entropy(logits.flatten(0, 1), y.repeat(len(W)))
    return loss


def head_arrays(model) -> dict:
    return {"weight": model.head.weight.detach(), "bias": model.head.bias.detach()}


def trunk_arrays(model) -> dict:
    """F: the state without the head."""
    return {k: v for k, v in state_arrays(model).items() if not k.startswith("head.")}


class HeadEnsemble(nn.Module):
    """F followed by every head; the log of the heads' average softmax."""

    def __init__(self, net, W: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.net = net
        self.register_buffer("W", W)
        self.register_buffer("b", b)

    def forward(self, x):
        logits = torch.einsum("bd,jcd->jbc", self.net.features(x), self.W) + self.b[:, None]
        return torch.softmax(logits, -1).mean(0).log()


class COPAClient(Client):
    new_model = build

    def setup(self):
        self.model = self.new_model()

    def on_heads(self, msg):
        load_arrays(self.model.head, msg.group(self.id))
        others = sorted({k.split("/")[0] for k in msg.arrays} - {self.id})
        self.W = torch.stack([msg[f"{c}/weight"] for c in others]).to(self.device) if others else \
            torch.zeros(0, *self.model.head.weight.shape, device=self.device)
        self.b = torch.stack([msg[f"{c}/bias"] for c in others]).to(self.device) if others else \
            torch.zeros(0, self.shape[3], device=self.device)

    def on_train(self, msg):
        load_arrays(self.model, {**msg.arrays, **{f"head.{k}": v for k, v in head_arrays(self.model).items()}})
        self.fit(self.model, lambda m, x, y: copa_loss(m, x, y, augment(x, self.gen, self.params), self.W, self.b))
        return Reply("weights", trunk_arrays(self.model))

    def on_head(self, msg):
        return Reply("head", head_arrays(self.model))


class COPAServer(Server):
    new_model = build

    def setup(self):
        self.heads = {}
        for c in self.clients:
            h = nn.Linear(self.model.feature_dim, self.shape[3])
            self.heads[c] = {"weight": h.weight.detach().to(self.device), "bias": h.bias.detach().to(self.device)}

    def step(self, t):
        self.broadcast("heads", "head", {f"{c}/{k}": v for c in self.clients for k, v in self.heads[c].items()})
        feats = self.broadcast("train", "weights", trunk_arrays(self.model))
        heads = self.ask("head")
        avg = weighted_average([feats[c].arrays for c in self.clients], [1 / len(self.clients)] * len(self.clients))
        if self.params.agg_noise:
            params = {k for k, _ in self.model.named_parameters()}
            avg = {k: v + self.params.agg_noise * torch.randn(v.shape, generator=self.gen) if k in params else v
                   for k, v in avg.items()}
        load_arrays(self.model, {**avg, **{f"head.{k}": v for k, v in head_arrays(self.model).items()}})
        self.heads = {c: {k: v.to(self.device) for k, v in heads[c].arrays.items()} for c in self.clients}

    def global_model(self):
        W = torch.stack([self.heads[c]["weight"] for c in self.clients])
        b = torch.stack([self.heads[c]["bias"] for c in self.clients])
        return HeadEnsemble(self.model, W, b)


class COPA(MethodPlugin):
    # why plan refuses privacy.dp_sgd (fdg_audit/privacy/dpsgd.py refuse): no per-example objective
    dp_sgd_refused = ("its HBIN layers normalise with batch statistics,"
                      " coupling the examples of a batch")
    build = staticmethod(build)     # the model attacks rebuild from the ledger
    name = "copa"
    title = "COPA"
    Params = Params
    Server = COPAServer
    Client = COPAClient
    kinds = ("weights", "head")
    participation_note = ("every round each client trains against the ensemble of all clients' heads and the server "
                          "replaces every head; a sampled round would leave stale heads the paper does not define")
