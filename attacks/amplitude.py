"""Attacks on FedDG/ELCFS amplitude banks (attacks.md §5.1): phase retrieval, fingerprint, attribute inference.

What FedDG sends (methods.md §2): per training image x in [0, 1], the unshifted amplitude |FFT2(x)| per channel,
client -> server (phase "bank", arrays {"amp": (N, C, H, W)}), then one relay per client (phase "bank_relay",
arrays {"<sender>/amp": ...}). A curious client reads the other clients' banks from its relay; the server (or an
eavesdropper) reads the uploads. With ``bank_content = "window"`` only a centred low-frequency crop of the
fftshifted amplitude travels (shape smaller than the image): phase retrieval does not apply then (a
``Skipped`` row says so); the fingerprint and the attribute classifier work on the same crop.

* ``PhaseRetrieval`` ("amplitude_phase_retrieval"): Fienup HIO (beta = 0.9) then ER, from random starts, over the
  whole bank as one batched tensor loop (images x channels x restarts), keeping per image-channel the restart
  with the lowest Fourier residual ||F g| - A| / |A|. Object constraints: the box [0, 1] ("box" variant; the
  FedDG setting: non-padded full-frame DFT, oversampling 1), plus a support mask ("support" variant) that the
  attacker estimates from public images (pixels that are foreground in enough of them, dilated) or takes as a
  known frame; outside the support the image is a constant background per channel (zero, or unknown constant).
  HIO is written for a general constraint projection P: keep g' where P(g') = g', else g - beta (g' - P(g'))
  (for a zero-background support this is Fienup's rule g - beta g'). Colour channels are retrieved one by one,
  then registered to channel 0 (circular shift / point inversion / contrast sign), since each channel has its
  own trivial ambiguities. Baseline: the flat image with each channel's mean intensity, read off the DC term.
  Positive control: images zero-padded 2x with the known support are recovered exactly (aligned PSNR >= 60 dB).
* ``Fingerprint`` ("amplitude_fingerprint"): psi(x) = mean-removed, L2-normalised log(1 + |FFT2(x)|), invariant to
  circular shifts and point inversion; a candidate's score is its best cosine to any of the victim's bank
  entries (one matmul). Variant "perturbed": candidates shifted by up to +-2 px (non-circular, zero fill),
  gain +-10 %, Gaussian noise sigma 0.02. Controls: exact copies give AUC 1 (positive); two disjoint sets of
  images never in the bank give AUC ~ 0.5 (negative).
* ``AttributeInference`` ("amplitude_attribute"): logistic regression on the radially averaged log-spectrum
  ("radial", orientation-free) or the whole log-amplitude ("logamp"), trained on the attacker's labelled public
  images (class; variant "public") and on its public samples of each source domain (class, variant
  "public+domain_samples"; domain, labels in ``aux.domains`` order); it predicts every bank entry. Controls: a
  linearly separable synthetic attribute is recovered (positive), random labels stay at chance (negative).

No published attack exists for these banks (attacks.md §8.1): the controls and baselines are the anchors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit import metrics as M
from fdg_audit.attack import Attack, AttackParams, Control, Predictions, Reconstruction, Scores, Skipped

KIND = "amplitude_bank"


# ------------------------------------------------------------------------------------------ bank access

def bank_entries(view, max_victims: int = 0) -> list[tuple[str, int, torch.Tensor]]:
    """(victim, round, amp (N, C, h, w)) for every other party's bank this adversary observed.

    Uploads ("amp" from a client) come first; a relay from the server to this adversary carries
    "<client>/amp" entries. A party's own bank and repeats are skipped."""
    found: dict[str, tuple[int, torch.Tensor]] = {}
    msgs = view.messages(kind=KIND)
    for m in sorted(msgs, key=lambda m: m.sender == "server"):
        if m.sender != "server":
            if m.sender != view.me and any(a["name"] == "amp" for a in m.env.arrays):
                found.setdefault(m.sender, (m.round, m.payload.arrays["amp"]))
        elif m.receiver == view.me:
            for k, v in m.payload.arrays.items():
                victim, _, name = k.rpartition("/")
                if name == "amp" and victim and victim != view.me:
                    found.setdefault(victim, (m.round, v))
    out = [(v, r, a) for v, (r, a) in sorted(found.items())]
    return out[:max_victims] if max_victims else out


def amplitude(x: torch.Tensor, like: tuple | None = None) -> torch.Tensor:
    """|FFT2(x)| per channel, unshifted; cropped like a windowed bank when ``like`` (h, w) differs from x's size."""
    a = torch.fft.fft2(x.float()).abs()
    if like is None or tuple(like) == tuple(a.shape[-2:]):
        return a
    H, W = a.shape[-2:]
    h, w = like
    a = torch.fft.fftshift(a, dim=(-2, -1))
    return a[..., H // 2 - h // 2:H // 2 - h // 2 + h, W // 2 - w // 2:W // 2 - w // 2 + w]


def toy_images(n: int, channels: int, size: int, gen: torch.Generator, blobs: int = 4) -> torch.Tensor:
    """Random smooth images in [0, 1] (sums of Gaussian blobs per channel) for the attacks' own controls."""
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")
    c = torch.rand(n, channels, blobs, 2, generator=gen) * (size - 1)
    s = 1.0 + torch.rand(n, channels, blobs, 1, 1, generator=gen) * size / 6
    w = 0.3 + torch.rand(n, channels, blobs, 1, 1, generator=gen)
    d2 = (yy - c[..., 0, None, None]) ** 2 + (xx - c[..., 1, None, None]) ** 2
    x = (w * torch.exp(-d2 / (2 * s ** 2))).sum(2)
    return x / x.flatten(2).amax(-1).clamp_min(1e-6)[..., None, None]


# ------------------------------------------------------------------------------------------ phase retrieval

def fourier_residual(g: torch.Tensor, amp: torch.Tensor) -> torch.Tensor:
    """||FFT2(g)| - A| / |A| per leading index (over the last two axes)."""
    return (torch.fft.fft2(g).abs() - amp).flatten(-2).norm(dim=-1) / amp.flatten(-2).norm(dim=-1).clamp_min(1e-12)


def project(g: torch.Tensor, support: torch.Tensor | None, background: str) -> torch.Tensor:
    """The object constraints: outside ``support`` (bool (H, W)) a constant background (0, or the mean there),
    everything in the box [0, 1]."""
    if support is not None:
        if background == "zero":
            g = g * support
        else:
            out = ~support
            c = (g * out).sum((-2, -1), keepdim=True) / out.sum().clamp_min(1)
            g = torch.where(support, g, c)
    return g.clamp(0, 1)


def retrieve(amp: torch.Tensor, support: torch.Tensor | None = None, background: str = "constant",
             hio: int = 300, er: int = 100, restarts: int = 4, beta: float = 0.9, tol: float = 1e-3,
             gen: torch.Generator | None = None, init: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched HIO + ER phase retrieval of real images from |FFT2| (B, H, W): returns (images, residual (B,)).

    All B x restarts problems run as one (restarts*B, H, W) tensor; each keeps its best restart by residual.
    ``init`` (B, H, W) replaces the random start of the first restart."""
    B, H, W = amp.shape
    dev = amp.device
    A = amp.repeat(restarts, 1, 1)                         # (R*B, H, W), restart-major
    Ar = A[..., :W // 2 + 1]                               # rfft layout of a real image's spectrum
    g = torch.rand(restarts * B, H, W, generator=gen).to(dev, amp.dtype)
    if init is not None:
        g[:B] = init.to(g)
    g = project(g, support, background)
    out = (~support).to(g.dtype) if support is not None and background == "constant" else None
    for it in range(hio + er):
        G = torch.fft.rfft2(g)
        gp = torch.fft.irfft2(G * (Ar / G.abs().clamp_min(1e-12)), s=(H, W))   # measured magnitude, current phase
        pg = project(gp, support, background)
        if it < hio:
            g = torch.where(pg == gp, gp, g - beta * (gp - pg))
            if out is not None:  # unknown constant background: its level follows the projection (BCL form of HIO)
                g = g + out * ((pg - g) * out).sum((-2, -1), keepdim=True) / out.sum()
        else:
            g = pg
        if it >= hio and (it - hio) % 50 == 49 and bool((fourier_residual(g, A) < tol).all()):
            break
    res = fourier_residual(g, A).view(restarts, B)
    best = res.argmin(0)
    g = g.view(restarts, B, H, W)[best, torch.arange(B, device=dev)]
    return g, res.min(0).values


def register_channels(x: torch.Tensor) -> torch.Tensor:
    """Move each channel by the circular shift / point inversion (and contrast sign) that best matches channel 0."""
    N, C, H, W = x.shape
    if C == 1:
        return x
    mean = x.mean((-2, -1), keepdim=True)
    xm = (x - mean).reshape(N * C, 1, H, W)
    ref = (x - mean)[:, :1].expand(N, C, H, W).reshape(N * C, 1, H, W)
    pos, neg = M.aligned(xm, ref), -M.aligned(-xm, ref)    # most correlated / most anti-correlated placement
    cp, cn = (pos * ref).flatten(1).sum(1), -(neg * ref).flatten(1).sum(1)
    best = torch.where((cp >= cn).view(-1, 1, 1, 1), pos, neg)
    return best.view(N, C, H, W) + mean


def estimate_support(x: torch.Tensor, frac: float = 0.02, thresh: float = 0.25, dilate: int = 1) -> torch.Tensor:
    """Pixels (bool (H, W)) that are foreground in at least ``frac`` of images x (N, C, H, W): foreground = a
    channel differs from the image's border median by more than ``thresh`` times that image's largest such
    difference; then dilated by ``dilate`` px."""
    border = torch.cat([x[..., 0, :], x[..., -1, :], x[..., :, 0], x[..., :, -1]], -1)
    dev = (x - border.median(-1).values[..., None, None]).abs().amax(1)          # (N, H, W)
    fg = (dev > thresh * dev.flatten(1).amax(1).clamp_min(1e-6)[:, None, None]).float().mean(0) >= frac
    if dilate:
        k = 2 * dilate + 1
        fg = F.max_pool2d(fg[None, None].float(), k, 1, dilate)[0, 0] > 0
    return fg


@dataclass
class PRParams(AttackParams):
    adversary_view: str = "client"    # client (curious client, reads its relay) | server | eavesdropper (uploads)
    variants: list = field(default_factory=lambda: ["box", "support"])
    hio: int = 300                    # HIO iterations (beta below), then ER iterations; attacks.md: 1000 + 200
    er: int = 100
    restarts: int = 4                 # random starts per image-channel; attacks.md: 8
    beta: float = 0.9
    tol: float = 1e-3                 # stop ER once every residual is below this
    max_images: int = 64              # bank entries attacked per victim (0 = all); CPU budget
    support: str = "public"           # public (estimated from aux.public) | frame (known border of frame_px)
    frame_px: int = 4
    support_frac: float = 0.02        # foreground in >= this fraction of public images
    support_dilate: int = 1
    background: str = "constant"      # outside the support: "zero" or an unknown constant per channel
    control_n: int = 8                # images in the padded positive control
    seed: int = 0


class PhaseRetrieval(Attack):
    name = "amplitude_phase_retrieval"
    consumes = (KIND,)
    adversary = "client"
    aux = ("public",)
    target = "reconstruction"
    Params = PRParams

    def __init__(self, params=None, device: str = "cpu"):
        super().__init__(params, device)
        self.adversary = self.p.adversary_view

    def _support(self, aux, C, H, W) -> torch.Tensor:
        if self.p.support == "frame":
            s = torch.zeros(H, W, dtype=torch.bool)
            f = self.p.frame_px
            s[f:H - f, f:W - f] = True
        else:
            s = estimate_support(aux.public.x, self.p.support_frac, dilate=self.p.support_dilate)
        return s.to(self.device)

    def attack_bank(self, amp: torch.Tensor, support, gen) -> torch.Tensor:
        """Images (N, C, H, W) from a bank (N, C, H, W) of full amplitudes."""
        N, C, H, W = amp.shape
        p = self.p
        g, _ = retrieve(amp.reshape(N * C, H, W), support, p.background, p.hio, p.er, p.restarts, p.beta, p.tol, gen)
        return register_channels(g.view(N, C, H, W))

    def run(self, view, aux):
        c, size, _ = view.shape
        gen = torch.Generator().manual_seed(self.p.seed)
        outs = []
        for victim, rnd, amp in bank_entries(view, self.p.max_victims):
            if tuple(amp.shape[-2:]) != (size, size):
                outs.append(Skipped(victim, KIND, rnd, f"bank holds a {tuple(amp.shape[-2:])} window of the "
                                    f"{size}x{size} spectrum: phase retrieval needs the full amplitude"))
                continue
            rows = np.arange(min(len(amp), self.p.max_images or len(amp)))
            a = amp[rows].to(self.device, torch.float32)
            base = (a[..., 0, 0] / (size * size)).clamp(0, 1)[..., None, None].expand_as(a)  # DC = sum of pixels
            for v in self.p.variants:
                sup = None if v == "box" else self._support(aux, c, size, size)
                rec = self.attack_bank(a, sup, gen)
                outs.append(Reconstruction(victim, KIND, rnd, rec, truth="amp", rows=rows, aligned=True,
                                           variant=v, baseline=base))
        return outs

    def control(self):
        """Positive control: 2x zero-padded toy images with the known support come back exactly."""
        gen = torch.Generator().manual_seed(self.p.seed)
        n, s = self.p.control_n, 16
        x = toy_images(n, 1, s, gen)
        xp = F.pad(x, (0, s, 0, s)).to(self.device)
        sup = torch.zeros(2 * s, 2 * s, dtype=torch.bool, device=self.device)
        sup[:s, :s] = True
        g, _ = retrieve(torch.fft.fft2(xp[:, 0]).abs(), sup, "zero", max(self.p.hio, 300), max(self.p.er, 200),
                        max(self.p.restarts, 4), self.p.beta, 0.0, gen)
        ps = M.aligned_psnr(g[:, None].cpu(), xp.cpu())
        return [Control("padded 2x, known support: median aligned PSNR", "psnr", float(ps.median()), 60.0)]
