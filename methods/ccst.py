"""CCST: cross-client style transfer (Chen, Jiang, Dou, Chen; WACV 2023), docs/methods.md §7.

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

The encoder (a deviation: the pretrained VGG-19 cannot be downloaded). ``encoder = "learned"`` (default): a real
learned feature extractor standing in for AdaIN's public VGG, trained in the package on public data only: a small
conv autoencoder (phi = three 3x3 conv + ReLU layers, the last ``encoder_width`` channels at half resolution, like
a VGG relu2_1; a mirrored decoder) fitted for ``encoder_steps`` Adam steps to random crops of scikit-learn's two
bundled sample photographs (``load_sample_images``: natural images, disjoint from every dataset here, the
ImageNet of this testbed), seeded by the public ``encoder_seed`` (seconds on a CPU, cached per process). The
server trains it and sends it once to every client (phase ``encoder``, kind ``encoder``), so the run's ledger
holds the exact weights that produced the styles, and the attacker, by Kerckhoffs, uses the same encoder.
``encoder = "linear"``: D random k x k filters, circular convolution, weights drawn from ``encoder_seed``
(He-normal); every style mean is then the image mean times a constant per filter and the stds are random
projections of the local k x k autocovariance, far less than VGG relu4_1's statistics, so leakage measured with
it is a lower bound. ``encoder = "relu"``: three random 3x3 conv + ReLU layers (the last at half resolution,
``encoder_width`` channels): also a lower bound. ``encoder_weights``: a local VGG-19
state_dict (torchvision's ``vgg19().features`` keys, with or without the ``features.`` prefix), cut at relu4_1,
ImageNet-normalised input, grey images replicated to RGB; needs torchvision. The style attacks name the encoder in
their output variants (``encoder_label``). "Lower bound" is relative to VGG relu4_1 (the argument above), not to the
learned stand-in: on appearance digits (per-image banks of every training image, one seed) the learned encoder gave
perturbed-copy membership AUC 0.66 against the linear one's 0.96, class balanced accuracy 0.17 against 0.26, pixel
inversion 9.3 dB against 11.0 (mean-image baseline 5.0); both found the domain every time. The learned encoder is a
real feature extractor, but small (half its channels are near-constant on digits), so its numbers bound a VGG's
leak from below too.

The decoder (a deviation: CCST decodes AdaIN(content, style) with AdaIN's public trained decoder, which we do not
have). The learned encoder brings its own decoder (trained to reconstruct, not with AdaIN's style loss): the
stylised image is dec(AdaIN(phi(x), s)), in [0, 1] by its sigmoid. For the linear encoder the stylised image is
the unconstrained least-squares argmin_x ||phi(x) - t||^2 for the AdaIN target t (AdaIN's decoder is trained to
approximate this content loss), solved per frequency through the FFT (``decode(encode(x)) == x``), and then
clamped to [0, 1]; the clamp moves a sizeable share of the pixels of images stylised to another domain (about a
quarter in issue 13's count), so the result is not the minimiser over valid images. For other nonlinear encoders
(relu, VGG) it is ``decode_steps`` Adam steps from the content image, clamped to [0, 1] after each step (slow on
CPU).
Other deviations: no 512 px resize (images are encoded at their own size), no random flips.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fdg_audit.api import Split, UserError, records
from fdg_audit.api.method import MethodPlugin, Reply, register_kind

from .fedavg import FedAvgClient, FedAvgServer, uniform_mean
from .fedavg import Params as FedAvgParams

EPS = 1e-5
register_kind("encoder")
ENCODERS = ("learned", "linear", "relu")


@dataclass
class Params(FedAvgParams):
    weighting: str = "uniform"       # CCST code: uniform average (n_samples: FedAvg's n_k weights)
    style: str = "overall"           # overall (one style per client) | single (J per-image styles)
    bank_size: int = 32              # J for style = "single"; 0 = every training image (unverified default)
    K: int = 0                       # domains drawn per image, own included (paper's L); 0 = all sources
    encoder: str = "learned"         # learned (autoencoder on public photos) | linear | relu (random: lower bounds)
    encoder_width: int = 64          # D, the style has 2 x D numbers
    encoder_kernel: int = 5          # linear encoder's filter size
    encoder_seed: int = 2023         # public seed of the encoder (its weights, and the learned one's training)
    encoder_steps: int = 300         # learned: Adam steps of the public autoencoder's training
    encoder_weights: str = ""        # local VGG-19 state_dict (torchvision layout): relu4_1 encoder
    decode_steps: int = 30           # nonlinear encoders: Adam steps of the decoder-free inversion
    decode_lr: float = 0.05

    def __post_init__(self):
        if self.style not in ("overall", "single"):
            raise UserError(f"ccst style = {self.style!r}: use \"overall\" or \"single\"")
        if self.encoder not in ENCODERS:
            raise UserError(f"ccst encoder = {self.encoder!r}: use one of {', '.join(ENCODERS)}")
        if self.bank_size < 0 or self.K < 0 or self.encoder_width < 1 or self.encoder_kernel < 1 or \
                self.encoder_steps < 1:
            raise UserError("ccst bank_size, K >= 0 and encoder_width, encoder_kernel >= 1 are required: "
                            "e.g. bank_size = 32, K = 0 (all sources), encoder_width = 64, encoder_kernel = 5; "
                            "encoder_steps >= 1")


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


class LearnedEncoder(nn.Module):
    """The public learned encoder and its decoder (AdaIN's pair in miniature): phi = conv3x3 -> ReLU -> conv3x3 /2
    -> ReLU -> conv3x3 -> ReLU (``width`` channels at half resolution, a "relu2_1"-like layer), and a mirrored
    decoder (conv, nearest x2 upsampling, conv, conv, sigmoid) that maps phi's features back to an image."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        w = 8, 16
        pad = dict(padding=1, padding_mode="reflect")
        self.enc = nn.Sequential(nn.Conv2d(channels, w[0], 3, **pad), nn.ReLU(), nn.Conv2d(w[0], w[1], 3, 2, **pad),
                                 nn.ReLU(), nn.Conv2d(w[1], width, 3, **pad), nn.ReLU())
        self.dec = nn.Sequential(nn.Conv2d(width, w[1], 3, **pad), nn.ReLU(), nn.Upsample(scale_factor=2),
                                 nn.Conv2d(w[1], w[0], 3, **pad), nn.ReLU(), nn.Conv2d(w[0], channels, 3, **pad),
                                 nn.Sigmoid())

    def forward(self, x):
        return self.enc(x)

    def decode(self, f: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        x = self.dec(f)
        return x if x.shape[-2:] == size else F.interpolate(x, size=size, mode="bilinear", align_corners=False)


def public_photos(channels: int, size: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random crops (side 24 to 160 px, random flips, shuffled and inverted channels) of scikit-learn's two
    bundled sample photographs, resized to ``size`` and in [0, 1]; grey (the channel mean) for one channel. Public,
    and disjoint from every dataset here."""
    from sklearn.datasets import load_sample_images
    photos = [torch.tensor(im, dtype=torch.float32).permute(2, 0, 1) / 255 for im in load_sample_images().images]
    out = []
    for i in range(n):
        im = photos[i % len(photos)]
        side = int(torch.randint(24, 161, (1,), generator=gen))
        r = int(torch.randint(0, im.shape[1] - side + 1, (1,), generator=gen))
        c = int(torch.randint(0, im.shape[2] - side + 1, (1,), generator=gen))
        crop = im[:, r:r + side, c:c + side]
        out.append(crop.flip(-1) if torch.rand(1, generator=gen) < 0.5 else crop)
    x = torch.stack([F.interpolate(c[None], size=(size, size), mode="area")[0] for c in out])
    x = x.mean(1, keepdim=True) if channels == 1 else x[:, :channels]
    # colour augmentation (channel order, per-channel inversion): natural photos alone carry too little chroma for
    # the decoder to render saturated colours (colour digits: reconstruction error 0.61 of their variance without,
    # 0.08 with, at 200 steps)
    perm = torch.stack([torch.randperm(x.shape[1], generator=gen) for _ in range(n)])
    x = torch.gather(x, 1, perm[:, :, None, None].expand_as(x))
    return torch.where(torch.rand(n, x.shape[1], 1, 1, generator=gen) < 0.5, 1 - x, x)


@lru_cache(maxsize=8)
def _train_learned(channels: int, width: int, seed: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = LearnedEncoder(channels, width)
    x = public_photos(channels, 16, 512, gen)      # fully convolutional: 16 px crops train it for any image size
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for _ in range(steps):
        b = x[torch.randint(len(x), (32,), generator=gen)]
        opt.zero_grad(set_to_none=True)
        F.mse_loss(net.decode(net(b), b.shape[-2:]), b).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def learned_encoder(channels: int, width: int, seed: int, steps: int) -> dict:
    """The public learned encoder's state (trained on ``public_photos`` from ``seed``; cached per process): the
    CCST server trains it once and sends it to every client (kind ``encoder``), so the run's ledger holds it."""
    return dict(_train_learned(channels, width, seed, steps))


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


def build_encoder(p, channels: int, device="cpu", arrays: dict | None = None) -> nn.Module:
    """The public style encoder phi of params ``p`` (a Params or its dict, e.g. ``view.params``), frozen. The
    learned encoder takes its weights from ``arrays`` (the run's ``encoder`` message) when given, else trains them
    on the public photos (seconds; cached per process)."""
    get = (lambda k: p.get(k, getattr(Params, k))) if isinstance(p, dict) else (lambda k: getattr(p, k))
    if get("encoder_weights"):
        enc = _VGGEncoder(get("encoder_weights"))
    elif get("encoder") == "learned":
        enc = LearnedEncoder(channels, get("encoder_width"))
        enc.load_state_dict(arrays if arrays is not None else learned_encoder(
            channels, get("encoder_width"), get("encoder_seed"), get("encoder_steps")))
    elif get("encoder") == "linear":
        enc = LinearEncoder(channels, get("encoder_width"), get("encoder_kernel"), get("encoder_seed"))
    else:
        enc = _relu_encoder(channels, get("encoder_width"), get("encoder_seed"))
    return enc.to(device).eval().requires_grad_(False)


def encoder_label(p) -> str:
    """Which encoder produced a style bank, for attack outputs: a random encoder's numbers are lower bounds."""
    get = (lambda k: p.get(k, getattr(Params, k))) if isinstance(p, dict) else (lambda k: getattr(p, k))
    if get("encoder_weights"):
        return "vgg19-relu4_1-encoder"
    return "learned-encoder" if get("encoder") == "learned" else f"random-{get('encoder')}-encoder-lower-bound"


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
    """An image whose features approximate ``t``: the learned encoder's decoder; for the linear encoder the
    unconstrained least-squares argmin_x ||phi(x) - t||^2 per frequency, then clamped to [0, 1] (not the minimiser
    over [0, 1] images); else Adam steps from ``init`` (the content images), clamped after each step."""
    h, w = init.shape[-2:]
    if isinstance(enc, LearnedEncoder):
        return enc.decode(t, (h, w))
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

def sends_encoder(p) -> bool:
    """Whether the server trains the public encoder and sends it once (the learned encoder), rather than every party
    building it from its public description (random encoders from the seed, VGG from the user's file)."""
    return p.encoder == "learned" and not p.encoder_weights


class CCSTClient(FedAvgClient):
    def setup(self):
        super().setup()
        self.encoder = None if sends_encoder(self.params) else build_encoder(self.params, self.shape[0], self.device)
        self.aug = self.train

    def on_encoder(self, msg):
        self.encoder = build_encoder(self.params, self.shape[0], self.device, msg.arrays)

    def on_style(self, msg):
        p, x = self.params, self.train.x
        if p.style == "overall":
            mean, std = overall_style(self.encoder, x)
        else:
            n = len(self.train.y)
            rows = np.arange(n) if p.bank_size == 0 or p.bank_size >= n else \
                np.sort(self.rng.choice(n, p.bank_size, replace=False))
            mean, std = image_styles(self.encoder, x[torch.as_tensor(rows, device=x.device)])
            self.record_truth(records.STYLE, idx=self.train.idx[rows])
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
        p = self.params
        if sends_encoder(p):
            self.broadcast("encoder", "encoder", learned_encoder(self.shape[0], p.encoder_width, p.encoder_seed,
                                                                 p.encoder_steps))
        styles = self.ask("style")
        bank = {}
        for c in self.clients:
            bank[f"{c}/mean"], bank[f"{c}/std"] = styles[c]["mean"], styles[c]["std"]
        self.broadcast("bank", "style_bank", bank)


class CCST(MethodPlugin):
    dp_sgd_refused = ("it trains on a derived split (several style-transferred rows per image,"   # no per-example
                      " styles mixed across images)")   # objective: plan refuses privacy.dp_sgd (privacy/dpsgd.py)
    name = "ccst"
    title = "CCST"
    Params = Params
    Server = CCSTServer
    Client = CCSTClient
    partial_participation = True   # the style bank is shared once (round 0, every client); the rounds are FedAvg's
    kinds = ("encoder", "style_bank", "weights")     # encoder: once, down, with the learned encoder only
    aggregate_share = staticmethod(uniform_mean)   # FedAvg's server
    # the public protocol pieces (Kerckhoffs) attacks reach through ``view.protocol``
    build_encoder = staticmethod(build_encoder)
    encoder_label = staticmethod(encoder_label)
    image_styles = staticmethod(image_styles)
    overall_style = staticmethod(overall_style)
    stylize = staticmethod(stylize)
