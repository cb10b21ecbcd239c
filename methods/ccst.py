"""CCST: cross-client style transfer (Chen, Jiang, Dou, Chen; WACV 2023), methods.md §7.

Protocol:
- Round 0: every client computes its style with a frozen public encoder phi and uploads it (phase ``style``,
  kind ``style_bank``, arrays ``{"mean": (J, D), "std": (J, D)}``). ``style = "overall"`` (paper default, J = 1):
  the channel mean and std of phi's features pooled over all pixels of all local training images, std =
  sqrt(E[f^2] - E[f]^2 + 1e-5) (``mean_std_computation_effcientMem.py``). ``style = "single"``: the per-image
  (mean, std) of ``bank_size`` J training images drawn with the client's seeded rng (0 = every image), std =
  sqrt(unbiased var + 1e-5) as AdaIN's ``calc_mean_std``; the truth ``style`` lists their image ids in row order.
- The server relays the whole bank to every client in one message (phase ``bank``, kind ``style_bank``, arrays
  ``"<client>/mean"``, ``"<client>/std"``, own style included).
- Offline augmentation, once: for each training image the client draws K domains without replacement from the
  source list, itself included (``K`` = the paper's L; 0 = all sources). Its own domain keeps the original image;
  another domain l gives AdaIN(phi(x), s_l) decoded back to an image (single mode: one of l's styles drawn at
  random). The augmented set has N_k x K images.
- Then FedAvg on the augmented sets with uniform weights (the CCST code; no n_k is sent), ``local_epochs``
  (CCST: 1) per round.

The encoder (a deviation: the pretrained VGG-19 cannot be downloaded). ``encoder = "linear"`` (default): D random
k x k filters, circular convolution, weights drawn from the public ``encoder_seed`` (He-normal). Any party can
rebuild it, so the attacker and the clients share it, as everyone shares the public AdaIN VGG. Its channel
statistics are D random projections of the images' mean colour and local k x k patch covariance: a low-level
"style", much smaller than VGG relu4_1's 512 channels. ``encoder = "relu"``: a deeper stand-in, three random 3x3
conv + ReLU layers (the last at half resolution, ``encoder_width`` channels). ``encoder_weights``: a local VGG-19
state_dict (torchvision's ``vgg19().features`` keys, with or without the ``features.`` prefix), cut at relu4_1,
ImageNet-normalised input, grey images replicated to RGB; needs torchvision.

The decoder (a deviation: CCST decodes AdaIN(content, style) with AdaIN's public trained decoder, which we do not
have). We decode without a learned decoder: the stylised image is argmin_x ||phi(x) - t||^2 for the AdaIN target t,
the objective AdaIN's decoder is trained to approximate (its content loss). For the linear encoder this is solved
exactly and cheaply per frequency (least squares through the FFT: ``decode(encode(x)) == x``), which is why it is
the default. For nonlinear encoders it is ``decode_steps`` Adam steps from the content image (slow on CPU).
Other deviations: no 512 px resize (images are encoded at their own size), no random flips.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fdg_audit.data import Split
from fdg_audit.errors import UserError
from fdg_audit.federation import Reply

from .fedavg import FedAvgClient, FedAvgServer
from .fedavg import Params as FedAvgParams

EPS = 1e-5
ENCODERS = ("linear", "relu")


@dataclass
class Params(FedAvgParams):
    weighting: str = "uniform"       # CCST code: uniform average (n_samples: FedAvg's n_k weights)
    style: str = "overall"           # overall (one style per client) | single (J per-image styles)
    bank_size: int = 32              # J for style = "single"; 0 = every training image (unverified default)
    K: int = 0                       # domains drawn per image, own included (paper's L); 0 = all sources
    encoder: str = "linear"          # linear | relu (random, from encoder_seed); ignored with encoder_weights
    encoder_width: int = 64          # D, the style has 2 x D numbers
    encoder_kernel: int = 5          # linear encoder's filter size
    encoder_seed: int = 2023         # public seed of the random encoder
    encoder_weights: str = ""        # local VGG-19 state_dict (torchvision layout): relu4_1 encoder
    decode_steps: int = 30           # nonlinear encoders: Adam steps of the decoder-free inversion
    decode_lr: float = 0.05

    def __post_init__(self):
        if self.style not in ("overall", "single"):
            raise UserError(f"ccst style = {self.style!r}: use \"overall\" or \"single\"")
        if self.encoder not in ENCODERS:
            raise UserError(f"ccst encoder = {self.encoder!r}: use one of {', '.join(ENCODERS)}")
        if self.bank_size < 0 or self.K < 0 or self.encoder_width < 1 or self.encoder_kernel < 1:
            raise UserError("ccst bank_size, K >= 0 and encoder_width, encoder_kernel >= 1 are required: "
                            "e.g. bank_size = 32, K = 0 (all sources), encoder_width = 64, encoder_kernel = 5")


# ------------------------------------------------------------------------------------------ encoder

class LinearEncoder(nn.Module):
    """D random k x k filters with circular padding; linear, so AdaIN targets decode exactly (least squares)."""

    def __init__(self, channels: int, width: int, kernel: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(width, channels, kernel, kernel, generator=g) * (2.0 / (channels * kernel * kernel)) ** 0.5
        self.register_buffer("weight", w)
        self.linear = True

    def forward(self, x):
        p = self.weight.shape[-1] // 2
        q = self.weight.shape[-1] - 1 - p
        return F.conv2d(F.pad(x, (p, q, p, q), mode="circular"), self.weight)

    def transfer(self, h: int, w: int) -> torch.Tensor:
        """phi's frequency response (h, w//2+1, D, C): rfft2(phi(x))[..., d] = sum_c T[d, c] rfft2(x)[c]
        (the spectra of its responses to a unit impulse in each input channel)."""
        C = self.weight.shape[1]
        delta = torch.zeros(C, C, h, w, device=self.weight.device)
        delta[torch.arange(C), torch.arange(C), 0, 0] = 1.0
        return torch.fft.rfft2(self(delta)).permute(2, 3, 1, 0)


def _relu_encoder(channels: int, width: int, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    layers, c_in = [], channels
    for i, c_out in enumerate((width // 2, width, width)):
        conv = nn.Conv2d(c_in, c_out, 3, padding=1, padding_mode="reflect")
        with torch.no_grad():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * (2.0 / (c_in * 9)) ** 0.5)
            conv.bias.zero_()
        layers += [conv, nn.ReLU()] + ([nn.AvgPool2d(2)] if i == 1 else [])
        c_in = c_out
    return nn.Sequential(*layers)


class _VGGEncoder(nn.Module):
    def __init__(self, path: str):
        super().__init__()
        try:
            import torchvision
        except Exception:
            raise UserError("ccst encoder_weights needs torchvision (pip install 'fdg_audit[vision]'): "
                            "or leave encoder_weights empty for the random public encoder") from None
        f = Path(path).expanduser()
        if not f.is_file():
            raise UserError(f"ccst encoder_weights file {f} not found: give a local VGG-19 state_dict "
                            "or leave it empty")
        sd = torch.load(f, map_location="cpu", weights_only=True)
        sd = {k.removeprefix("features."): v for k, v in sd.items() if not k.startswith("classifier.")}
        net = torchvision.models.vgg19(weights=None).features[:21]    # up to relu4_1
        keep = {k: v for k, v in sd.items() if k.split(".")[0].isdigit() and int(k.split(".")[0]) < 21}
        try:
            net.load_state_dict(keep)
        except RuntimeError as e:
            raise UserError(f"ccst encoder_weights {f} is not a torchvision VGG-19 state_dict ({e}): "
                            "save torchvision.models.vgg19().state_dict()") from None
        self.net = net
        self.register_buffer("mu", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("sd", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x):
        x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
        return self.net((x - self.mu) / self.sd)


def build_encoder(p, channels: int, device="cpu") -> nn.Module:
    """The public style encoder phi of params ``p`` (a Params or its dict, e.g. ``view.params``), frozen."""
    get = (lambda k: p[k]) if isinstance(p, dict) else (lambda k: getattr(p, k))
    if get("encoder_weights"):
        enc = _VGGEncoder(get("encoder_weights"))
    elif get("encoder") == "linear":
        enc = LinearEncoder(channels, get("encoder_width"), get("encoder_kernel"), get("encoder_seed"))
    else:
        enc = _relu_encoder(channels, get("encoder_width"), get("encoder_seed"))
    return enc.to(device).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------ styles

def image_styles(enc: nn.Module, x: torch.Tensor, chunk: int = 256, grad: bool = False):
    """Per-image style (mean, std), each (N, D): std = sqrt(unbiased var + 1e-5) (AdaIN's calc_mean_std)."""
    means, stds = [], []
    with torch.set_grad_enabled(grad):
        for i in range(0, len(x), chunk):
            f = enc(x[i:i + chunk]).flatten(2)
            means.append(f.mean(-1))
            stds.append((f.var(-1) + EPS).sqrt())
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def overall_style(enc: nn.Module, x: torch.Tensor, chunk: int = 256):
    """One style (1, D) pooled over all pixels of all images (running sums, population variance + 1e-5)."""
    s = s2 = 0.0
    n = 0
    for i in range(0, len(x), chunk):
        f = enc(x[i:i + chunk]).double().transpose(0, 1).flatten(1)
        s, s2, n = s + f.sum(1), s2 + (f * f).sum(1), n + f.shape[1]
    m = s / n
    return m[None].float(), (s2 / n - m * m + EPS).sqrt()[None].float()


def adain_target(f: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """AdaIN(f, style): per image and channel, f's own statistics replaced by (mean, std) (N, D) (alpha = 1)."""
    fl = f.flatten(2)
    m, s = fl.mean(-1), (fl.var(-1) + EPS).sqrt()
    return ((f - m[..., None, None]) / s[..., None, None]) * std[..., None, None] + mean[..., None, None]


def decode(enc: nn.Module, t: torch.Tensor, init: torch.Tensor, steps: int = 30, lr: float = 0.05,
           ridge: float = 1e-6) -> torch.Tensor:
    """argmin_x ||phi(x) - t||^2 in [0, 1]: exact least squares per frequency for the linear encoder, else Adam
    steps from ``init`` (the content images)."""
    h, w = init.shape[-2:]
    if getattr(enc, "linear", False):
        T = enc.transfer(h, w)                                            # (h, w', D, C)
        A = T.conj().transpose(-1, -2)                                    # (h, w', C, D)
        G = A @ T + ridge * torch.eye(T.shape[-1], device=T.device)
        P = torch.linalg.solve(G, A)                                      # (h, w', C, D)
        X = torch.einsum("hwcd,ndhw->nchw", P, torch.fft.rfft2(t))
        return torch.fft.irfft2(X, s=(h, w)).clamp(0, 1)
    x = init.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ((enc(x) - t) ** 2).mean().backward()
        opt.step()
        with torch.no_grad():
            x.clamp_(0, 1)
    return x.detach()


def stylize(enc: nn.Module, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, steps: int = 30,
            lr: float = 0.05, chunk: int = 256) -> torch.Tensor:
    """Images x (N, C, H, W) re-rendered with per-row target styles (N, D): decode(AdaIN(phi(x), style))."""
    out = []
    for i in range(0, len(x), chunk):
        xi = x[i:i + chunk]
        with torch.no_grad():
            t = adain_target(enc(xi), mean[i:i + chunk], std[i:i + chunk])
        out.append(decode(enc, t, xi, steps, lr))
    return torch.cat(out) if out else x[:0]


# ------------------------------------------------------------------------------------------ parties

class CCSTClient(FedAvgClient):
    def setup(self):
        super().setup()
        self.encoder = build_encoder(self.params, self.shape[0], self.device)
        self.aug = self.train

    def on_style(self, msg):
        p, x = self.params, self.train.x
        if p.style == "overall":
            mean, std = overall_style(self.encoder, x)
        else:
            n = len(self.train.y)
            rows = np.arange(n) if p.bank_size == 0 or p.bank_size >= n else \
                np.sort(self.rng.choice(n, p.bank_size, replace=False))
            mean, std = image_styles(self.encoder, x[torch.as_tensor(rows, device=x.device)])
            self.record_truth("style", idx=self.train.idx[rows])
        return Reply("style_bank", {"mean": mean.contiguous(), "std": std.contiguous()})

    def on_bank(self, msg):
        """Build the augmented set once: K domains per image (own = original, other = stylised)."""
        p, dev = self.params, self.device
        doms = sorted({k.rpartition("/")[0] for k in msg.arrays})
        if self.id not in doms:
            raise UserError(f"ccst: the style bank relayed to {self.id} lacks its own style; use the ccst server")
        K = len(doms) if p.K == 0 else min(p.K, len(doms))
        n = len(self.train.y)
        pick = np.argsort(self.rng.random((n, len(doms))), axis=1)[:, :K]          # K domains per image, no repeats
        rows, dom = np.repeat(np.arange(n), K), pick.reshape(-1)
        own = dom == doms.index(self.id)
        sizes = np.array([len(msg.arrays[f"{d}/mean"]) for d in doms])
        # the style of domain l: its only entry (overall) or a random one of its J (single)
        flat = np.concatenate([[0], np.cumsum(sizes)[:-1]])[dom] + self.rng.integers(0, sizes[dom])
        means = torch.cat([msg.arrays[f"{d}/mean"] for d in doms]).to(dev)
        stds = torch.cat([msg.arrays[f"{d}/std"] for d in doms]).to(dev)
        x = self.train.x[torch.as_tensor(rows, device=dev)].clone()
        sel = torch.as_tensor(np.flatnonzero(~own), device=dev)
        if len(sel):
            f = torch.as_tensor(flat, device=dev)[sel]
            x[sel] = stylize(self.encoder, x[sel], means[f], stds[f], p.decode_steps, p.decode_lr)
        r = torch.as_tensor(rows, device=dev)
        self.aug = Split(x, self.train.y[r], self.train.idx[rows])
        self.aug_domain = dom

    def local_update(self):
        self.fit(self.model, split=self.aug)


class CCSTServer(FedAvgServer):
    def begin(self):
        super().begin()
        styles = self.ask("style")
        bank = {}
        for c in self.clients:
            bank[f"{c}/mean"], bank[f"{c}/std"] = styles[c]["mean"], styles[c]["std"]
        self.broadcast("bank", "style_bank", bank)


class CCST:
    name = "ccst"
    Params = Params
    Server = CCSTServer
    Client = CCSTClient
    kinds = ("style_bank", "weights")
