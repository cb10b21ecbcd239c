"""A learned image prior from the attacker's public data (issue 19, item 2), shared by the reconstruction attacks.

The attacker trains a small VAE on its declared public images (``aux.public``: labelled images of the held-out
domain, never a victim's) and then searches the decoder's latent space instead of pixel space: phase retrieval on
amplitudes (attacks/amplitude.py, variant "learned") and update inversion on weights (attacks/inversion.py,
``prior = "learned"``). One object serves both: ``decode(z)`` maps latents (N, d) to images (N, C, H, W) in
[0, 1], ``init_latents(n, gen)`` draws starts from the VAE's N(0, I) prior, ``encode(x)`` gives posterior means.

Model: encoder 2 strided 3x3 convs (w, 2w channels) -> linear to (mu, log sigma^2); decoder linear ->
(2w, ceil(S/4)^2) -> 2 transposed convs (x2 each) -> sigmoid, cropped to S. Loss: binary cross-entropy summed over
pixels + ``beta`` KL, Adam, mini-batches drawn from the public set. Training images are augmented by a random
rotation within +-``rotate`` degrees (generic augmentation: the attacker does not know the victims' domains; on
the rotated digits a prior that saw only the held-out angle cannot express the other domains). Everything is
seeded from ``seed`` (fdg_audit.api.seeding) under a forked global RNG, so the same data, settings and seed give
the same weights; ``learned_prior`` trains it once per (data, settings, seed) and shares it: within a process, and
across the jobs of a run folder through the view's attacker-side cache (``view.cached`` / ``view.keep``).

``fit_amplitude`` is phase retrieval through the prior: Adam on z for ||FFT2(decode(z))| - A|^2 / |A|^2 from
``restarts`` latents per image, each image stopping at its plateau (the shared rule, attacks/images.py);
``foreground`` turns its decoded images into per-image support masks, with which
attacks/amplitude.py refines them by HIO + ER in pixel space (the decoder alone cannot express a victim's digit
exactly: latent-only fits stay near its encode-decode quality, 17-19 dB on held-out real digits).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import astuple, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from fdg_audit.api import rotate, seeding

from .images import PLATEAU_TOL, PLATEAU_WINDOW, Plateau


@dataclass(frozen=True)
class PriorSettings:
    latent: int = 16          # latent dimension
    width: int = 16           # channels of the first conv (the second has twice as many)
    steps: int = 1200         # Adam steps of training
    batch: int = 32
    lr: float = 2e-3
    beta: float = 1.0         # weight of the KL term
    rotate: float = 90.0      # training augmentation: a random rotation within +-rotate degrees (0 = none)


def settings_of(p) -> PriorSettings:
    """The PriorSettings an attack's Params set through its ``prior_<field>`` fields (the rest default)."""
    return PriorSettings(**{f.name: getattr(p, f"prior_{f.name}") for f in fields(PriorSettings)
                            if hasattr(p, f"prior_{f.name}")})


class LearnedPrior(nn.Module):
    """A small convolutional VAE for images of shape (channels, size, size)."""

    def __init__(self, channels: int, size: int, s: PriorSettings):
        super().__init__()
        w, self.size, self.latent = s.width, size, s.latent
        self.s0 = math.ceil(size / 4)
        self.enc = nn.Sequential(nn.Conv2d(channels, w, 3, 2, 1), nn.ReLU(), nn.Conv2d(w, 2 * w, 3, 2, 1), nn.ReLU(),
                                 nn.Flatten(), nn.Linear(2 * w * self.s0 ** 2, 2 * s.latent))
        self.dec = nn.Sequential(nn.Linear(s.latent, 2 * w * self.s0 ** 2), nn.ReLU(),
                                 nn.Unflatten(1, (2 * w, self.s0, self.s0)),
                                 nn.ConvTranspose2d(2 * w, w, 4, 2, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(w, channels, 4, 2, 1))

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return self.dec(z)[..., :self.size, :self.size]

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Latents (N, d) -> images (N, C, H, W) in [0, 1]."""
        return torch.sigmoid(self.logits(z))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Posterior means (N, d) of images x (N, C, H, W)."""
        return self.enc(x)[:, :self.latent]

    def init_latents(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """``n`` latents drawn from the prior N(0, I), on the model's device."""
        return torch.randn(n, self.latent, generator=gen).to(next(self.parameters()).device)


def train_prior(x: torch.Tensor, s: PriorSettings = PriorSettings(), seed: int = 0) -> LearnedPrior:
    """A VAE trained on images x (N, C, H, W) in [0, 1]; deterministic in (x, s, seed); returned in eval mode with
    frozen weights."""
    gen = seeding.torch_gen(seed, "learned-prior")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seeding.seed_int(seed, "learned-prior-init"))
        net = LearnedPrior(x.shape[1], x.shape[-1], s).to(x.device)
    opt = torch.optim.Adam(net.parameters(), lr=s.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, s.steps)
    for _ in range(s.steps):
        xb = x[torch.randint(len(x), (s.batch,), generator=gen).to(x.device)]
        if s.rotate:
            xb = rotate(xb, ((2 * torch.rand(s.batch, generator=gen) - 1) * s.rotate).to(torch.float64))
        h = net.enc(xb)
        mu, logvar = h[:, :s.latent], h[:, s.latent:].clamp(-10, 10)
        z = mu + (0.5 * logvar).exp() * torch.randn(mu.shape, generator=gen).to(x.device)
        rec = F.binary_cross_entropy_with_logits(net.logits(z), xb, reduction="sum") / len(xb)
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1 - logvar).sum(1).mean()
        opt.zero_grad()
        (rec + s.beta * kl).backward()
        opt.step()
        sched.step()
    return net.eval().requires_grad_(False)


_CACHE: dict = {}


def prior_key(x: torch.Tensor, s: PriorSettings, seed: int) -> str:
    """The name of a trained prior: a hash of the public images (bytes and shape), the settings and the seed."""
    h = hashlib.sha1(x.detach().cpu().float().contiguous().numpy().tobytes())
    h.update(repr((tuple(x.shape), astuple(s), seed)).encode())
    return f"learned_prior-{h.hexdigest()[:20]}"


def learned_prior(x: torch.Tensor, s: PriorSettings = PriorSettings(), seed: int = 0, view=None) -> LearnedPrior:
    """``train_prior`` once per (bytes of x, settings, seed): from this process's cache (the last 4 kept), else
    from the attacker-side cache of the run folder through ``view.cached(key)`` (a state_dict of float arrays that
    another job of the same attack kept), else trained here and shared with ``view.keep(key, arrays)``. A view
    without ``cached``/``keep`` (or None) uses the process cache only."""
    key = prior_key(x, s, seed)
    if (key, str(x.device)) in _CACHE:
        return _CACHE[key, str(x.device)]
    arrays = getattr(view, "cached", lambda k: None)(key)
    if arrays is not None:
        net = LearnedPrior(x.shape[1], x.shape[-1], s)
        net.load_state_dict({k: torch.as_tensor(v) for k, v in arrays.items()})
        net = net.to(x.device).eval().requires_grad_(False)
    else:
        net = train_prior(x, s, seed)
        if hasattr(view, "keep"):
            view.keep(key, {k: v.detach().cpu().float().numpy() for k, v in net.state_dict().items()})
    while len(_CACHE) >= 4:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key, str(x.device)] = net
    return net


def fit_amplitude(prior: LearnedPrior, amp: torch.Tensor, restarts: int, steps: int, gen: torch.Generator,
                  lr: float = 0.05, window: int = PLATEAU_WINDOW, tol: float = PLATEAU_TOL
                  ) -> tuple[torch.Tensor, torch.Tensor, Plateau]:
    """Phase retrieval in the prior's latent space: for amplitudes ``amp`` (N, C, H, W), the decoded images
    (restarts, N, C, H, W) of ``restarts`` latents per image after at most ``steps`` Adam steps (cosine step size)
    on the relative squared Fourier residual, those residuals (restarts, N), and the Plateau (steps and CPU seconds
    per image). All restarts x images run as one batch; an image whose best residual over its restarts plateaus
    (attacks/images.py ``Plateau``: relative improvement < ``tol`` over ``window`` steps) keeps its latents of that
    moment while the others go on."""
    N = len(amp)
    A = amp.repeat(restarts, 1, 1, 1)
    norm = A.pow(2).flatten(1).sum(1).clamp_min(1e-12)
    z = prior.init_latents(restarts * N, gen).requires_grad_()
    opt = torch.optim.Adam([z], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, steps))
    plat, final = Plateau(N, window, tol), z.detach().clone()
    best = torch.full((restarts * N,), float("inf"), device=z.device)

    def residual(z):
        return (torch.fft.fft2(prior.decode(z)).abs() - A).pow(2).flatten(1).sum(1) / norm

    for _ in range(steps):
        opt.zero_grad()
        r = residual(z)
        best = torch.minimum(best, r.detach())
        r.sum().backward()
        opt.step()
        sched.step()
        if plat.due():
            u = plat.active
            _, done = plat.check(best.view(restarts, N).min(0).values[u.to(z.device)])
            rows = torch.zeros(N, dtype=torch.bool)
            rows[u[done]] = True
            rows = rows.repeat(restarts).to(z.device)
            final[rows] = z.detach()[rows]
            if not len(plat.active):
                break
    rows = torch.zeros(N, dtype=torch.bool)
    rows[plat.active] = True
    rows = rows.repeat(restarts).to(z.device)
    final[rows] = z.detach()[rows]
    plat.finish()
    with torch.no_grad():
        return prior.decode(final).view(restarts, N, *amp.shape[1:]), residual(final).view(restarts, N), plat


def foreground(x: torch.Tensor, thresh: float = 0.25, dilate: int = 0) -> torch.Tensor:
    """Per image of x (N, C, H, W), the pixels (bool (N, H, W)) where some channel differs from the image's border
    median by more than ``thresh`` times the image's largest such difference, dilated by ``dilate`` px."""
    border = torch.cat([x[..., 0, :], x[..., -1, :], x[..., :, 0], x[..., :, -1]], -1)
    dev = (x - border.median(-1).values[..., None, None]).abs().amax(1)
    fg = dev > thresh * dev.flatten(1).amax(1).clamp_min(1e-6)[:, None, None]
    return F.max_pool2d(fg[:, None].float(), 2 * dilate + 1, 1, dilate)[:, 0] > 0 if dilate else fg
