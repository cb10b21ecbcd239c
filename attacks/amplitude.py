"""Attacks on FedDG/ELCFS amplitude banks (docs/attacks.md §5.1): phase retrieval, fingerprint, attribute inference.

What FedDG sends (docs/methods.md §2): per training image x in [0, 1], the unshifted amplitude |FFT2(x)| per channel,
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
  Each image stops at its own plateau (the rule every reconstruction shares, attacks/images.py ``Plateau``): HIO
  until the best Fourier residual of its restarts improved by < ``plateau_tol`` (relative) over ``plateau_window``
  iterations (or ``hio`` iterations), then ER until the next plateau (or ``er`` iterations, or a residual below
  ``tol``); each output records its iterations (the most any of its images ran), CPU seconds (its images' shares of
  the batch) and the rule. ``plateau_tol`` = 0 turns the rule off (fixed budget).
  Positive control: images zero-padded 2x with the known support are recovered exactly (aligned PSNR >= 60 dB).
  Variant "learned" (opt-in): a VAE trained on the attacker's public images (attacks/prior.py) first fits latents to
  each amplitude, then HIO + ER refine every restart's decoded image inside its own dilated foreground, at the
  same iterations x restarts as "box" (``learned_steps`` of the HIO iterations become latent Adam steps).
* ``Fingerprint`` ("amplitude_fingerprint"): psi(x) = mean-removed, L2-normalised log(1 + |FFT2(x)|), invariant to
  circular shifts and point inversion; a candidate's score is its best cosine to any of the victim's bank
  entries (one matmul). Variant "perturbed": candidates shifted by up to +-2 px (non-circular: edges repeat),
  gain +-10 %, Gaussian noise sigma 0.02 (``perturb``, attacks/images.py). Controls: exact copies give AUC 1
  (positive); two disjoint sets of images never in the bank give AUC ~ 0.5 (negative).
* ``AttributeInference`` ("amplitude_attribute"): logistic regression on the radially averaged log-spectrum
  ("radial", orientation-free) or the whole log-amplitude ("logamp"), trained on the attacker's labelled public
  images (class; variant "public") and on its public samples of each source domain (class, variant
  "public+domain_samples"; domain, labels in ``aux.domains`` order); it predicts every bank entry. Controls: a
  linearly separable synthetic attribute is recovered (positive), random labels stay at chance (negative).

No published attack exists for these banks (docs/attacks.md §7): the controls and baselines are the anchors.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.api import UserError, place, records, rotate
from fdg_audit.api import metrics as M
from fdg_audit.api.attack import (Attack, AttackParams, Control, Predictions, Reconstruction, Scores, Skipped,
                                  sample_victims)

from .images import PLATEAU_TOL, PLATEAU_WINDOW, Plateau, perturb, plateau_rule
from .prior import fit_amplitude, foreground, learned_prior, settings_of

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
    return sample_victims(view, out, max_victims, key=lambda e: e[0])


class _BankAttack(Attack):
    """An attack on the amplitude banks, from the view ``adversary_view`` names, with its ``variants`` (where it has
    them) checked against ``outputs``."""
    consumes = (KIND,)
    adversary = "client"

    def __init__(self, params=None, device: str = "cpu"):
        super().__init__(params, device)
        self.adversary = self.p.adversary_view
        bad = [v for v in getattr(self.p, "variants", ()) if v not in self.outputs]
        if bad:
            raise UserError(f"{self.name}: unknown variant {bad[0]!r}: use {', '.join(self.outputs)}")

    def cost(self) -> dict:   # the cost guard (fdg_audit.audit.coverage.estimate): its own CPU s per run, main job's
        return {"run": 3.0}


def amplitude(x: torch.Tensor, like: tuple | None = None) -> torch.Tensor:
    """|FFT2(x)| per channel, unshifted; cropped like a windowed bank when ``like`` (h, w) differs from x's size."""
    a = torch.fft.fft2(x.float()).abs()
    if like is None or tuple(like) == tuple(a.shape[-2:]):
        return a
    (H, W), (h, w) = a.shape[-2:], like
    a = torch.fft.fftshift(a, dim=(-2, -1))
    return a[..., H // 2 - h // 2:H // 2 - h // 2 + h, W // 2 - w // 2:W // 2 - w // 2 + w]


def toy_images(n: int, channels: int, size: int, gen: torch.Generator, rects: int = 5) -> torch.Tensor:
    """Random piecewise-constant images in [0, 1] (sums of random rectangles per channel) for the controls."""
    ar = torch.arange(size)
    a = torch.randint(0, size, (n, channels, rects, 2, 2), generator=gen).sort(-1).values   # [y0 y1], [x0 x1]
    inside = lambda k, t: (t >= a[..., k, 0, None, None]) & (t <= a[..., k, 1, None, None])  # noqa: E731
    m = inside(0, ar.view(size, 1)) & inside(1, ar.view(1, size))
    x = (torch.rand(n, channels, rects, 1, 1, generator=gen) * m).sum(2)
    return x / x.flatten(2).amax(-1).clamp_min(1e-6)[..., None, None]


# ------------------------------------------------------------------------------------------ phase retrieval

def fourier_residual(g: torch.Tensor, amp: torch.Tensor) -> torch.Tensor:
    """||FFT2(g)| - A| / |A| per leading index (over the last two axes)."""
    return (torch.fft.fft2(g).abs() - amp).flatten(-2).norm(dim=-1) / amp.flatten(-2).norm(dim=-1).clamp_min(1e-12)


def project(g: torch.Tensor, support: torch.Tensor | None, background: str) -> torch.Tensor:
    """The object constraints: outside ``support`` (bool (H, W), or one mask per problem (B, H, W); all True =
    box only) a constant background (0, or the mean there), everything in the box [0, 1]."""
    if support is not None:
        if background == "zero":
            g = g * support
        else:
            out = ~support
            c = (g * out).sum((-2, -1), keepdim=True) / out.sum((-2, -1), keepdim=True).clamp_min(1)
            g = torch.where(support, g, c)
    return g.clamp(0, 1)


def retrieve(amp: torch.Tensor, support: torch.Tensor | None = None, background: str = "constant",
             hio: int = 300, er: int = 100, restarts: int = 4, beta: float = 0.9, tol: float = 1e-3,
             gen: torch.Generator | None = None, init: torch.Tensor | None = None, window: int = PLATEAU_WINDOW,
             plateau_tol: float = PLATEAU_TOL, cpu_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, Plateau]:
    """Batched HIO + ER phase retrieval of real images from |FFT2| (B, H, W): returns (images, residual (B,),
    the Plateau with each image's iterations and CPU seconds).

    All B x restarts problems run as one (restarts*B, H, W) tensor; each keeps its best restart by residual.
    Each image (all its restarts together) runs HIO until the best Fourier residual of its restarts plateaus
    (``Plateau``: relative improvement < ``plateau_tol`` over ``window`` iterations; 0 = no plateau) or ``hio``
    iterations, then ER until the next plateau, ``er`` more iterations or every restart's residual below ``tol``;
    a finished image stays as it is while the others run. ``init`` (B, H, W) replaces the random start of the
    first restart."""
    (B, H, W), dev = amp.shape, amp.device
    A = amp.repeat(restarts, 1, 1)                         # (R*B, H, W), restart-major
    if support is not None and support.dim() == 3:         # one mask per problem: repeat like the amplitudes
        support = support.repeat(restarts, 1, 1)
    Ar = A[..., :W // 2 + 1]                               # rfft layout of a real image's spectrum
    Ar_norm = Ar.flatten(1).norm(dim=1).clamp_min(1e-12)
    g = torch.rand(restarts * B, H, W, generator=gen).to(dev, amp.dtype)
    if init is not None:
        g[:B] = init.to(g)
    g = project(g, support, background)
    out = (~support).to(g.dtype) if support is not None and background == "constant" else None
    out_n = None if out is None else out.sum((-2, -1), keepdim=True).clamp_min(1)
    plat = Plateau(B, window, plateau_tol, 2, cpu_cap)
    stage = torch.zeros(restarts * B, 1, 1, dtype=torch.long, device=dev)   # per row: 0 HIO, 1 ER, 2 done
    er_end = torch.full((B,), hio + er)                                     # host: the iteration ER stops at
    best = torch.full((restarts * B,), float("inf"), device=dev)
    for it in range(hio + er):
        G = torch.fft.rfft2(g)
        best = torch.minimum(best, (G.abs() - Ar).flatten(1).norm(dim=1) / Ar_norm)   # the residual of g
        gp = torch.fft.irfft2(G * (Ar / G.abs().clamp_min(1e-12)), s=(H, W))   # measured magnitude, current phase
        pg = project(gp, support, background)
        h = torch.where(pg == gp, gp, g - beta * (gp - pg))
        if out is not None:  # unknown constant background: its level follows the projection (BCL form of HIO)
            h = h + out * ((pg - h) * out).sum((-2, -1), keepdim=True) / out_n
        g = torch.where(stage == 0, h, torch.where(stage == 1, pg, g))
        due = plat.due()
        if due or it + 1 == hio or bool((er_end[plat.active] == it + 1).any()):
            if due:   # plateaus: HIO -> ER, ER -> done; an ER residual below tol -> done
                bu, u = best.view(restarts, B).min(0).values.cpu(), plat.active
                moved, _ = plat.check(bu[u])
                er_end[u[moved & (plat.stage[u] == 1)]] = it + 1 + er
                u = plat.active
                plat.advance((plat.stage[u] == 1) & (bu[u] < tol))
            u = plat.active
            if it + 1 == hio:   # HIO's cap: the rest move to ER
                er_end[u[plat.stage[u] == 0]] = it + 1 + er
                plat.advance(plat.stage[u] == 0)
            u = plat.active
            plat.advance(er_end[u] <= it + 1)   # ER's cap
            stage = plat.stage.to(dev).repeat(restarts).view(-1, 1, 1)
            if not len(plat.active):
                break
    plat.finish()
    res = fourier_residual(g, A).view(restarts, B)
    best = res.argmin(0)
    g = g.view(restarts, B, H, W)[best, torch.arange(B, device=dev)]
    return g, res.min(0).values, plat


def render_fit(amp: torch.Tensor, angles: torch.Tensor, restarts: int, keep: int, steps: list,
               gen: torch.Generator) -> torch.Tensor:
    """Phase retrieval through the rotated digits' public recipe: find z in [0, 1]^(8x8) whose rendering
    x = rotate(place(z), angle) (fdg_audit.api) has |FFT2(x)| closest to ``amp`` (N, H, W), by projected
    Adam on ||FFT2(x)| - A|^2 / |A|^2. Stage 1 runs ``restarts`` random latents per image at a constant step,
    stage 2 continues the ``keep`` best of them with a cosine step; returns the best rendering (N, 1, H, W).
    64 unknowns against H x W / 2 measurements: the fit is overdetermined, and a zero residual is the image
    (or its point reflection, which has the same amplitude)."""
    N, dev = len(amp), amp.device

    def residual(z, A, ang):
        x = rotate(place(z), ang)
        return ((torch.fft.fft2(x[:, 0]).abs() - A) ** 2).sum((-2, -1)) / (A ** 2).sum((-2, -1)).clamp_min(1e-12), x

    def descend(z, reps, n, cosine):
        A, ang = amp.repeat(reps, 1, 1), angles.repeat(reps)
        z = z.clone().requires_grad_()
        opt = torch.optim.Adam([z], lr=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, n)) if cosine else None
        for _ in range(n):
            loss = residual(z, A, ang)[0].sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched:
                sched.step()
            with torch.no_grad():
                z.clamp_(0, 1)
        with torch.no_grad():
            res, x = residual(z, A, ang)
        return z.detach(), res.view(reps, N), x

    z = torch.rand(restarts * N, 1, 8, 8, generator=gen).to(dev, amp.dtype)
    z, res, _ = descend(z, restarts, steps[0], False)
    k = min(keep, restarts)
    top = res.topk(k, 0, largest=False).indices                               # (k, N)
    z = z.view(restarts, N, 1, 8, 8)[top, torch.arange(N, device=dev)].reshape(k * N, 1, 8, 8)
    _, res, x = descend(z, k, steps[1], True)
    return x.view(k, N, *x.shape[1:])[res.argmin(0), torch.arange(N, device=dev)]


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
    fg = foreground(x, thresh).float().mean(0) >= frac
    if dilate:
        k = 2 * dilate + 1
        fg = F.max_pool2d(fg[None, None].float(), k, 1, dilate)[0, 0] > 0
    return fg


@dataclass
class PRParams(AttackParams):
    adversary_view: str = "client"    # client (curious client, reads its relay) | server | eavesdropper (uploads)
    variants: list = field(default_factory=lambda: ["box", "support", "support_domain", "support_frame", "render"])
    hio: int = 1000                   # HIO iterations (beta below), then ER iterations (docs/attacks.md §5.1 budget)
    er: int = 200
    restarts: int = 8                 # random starts per image-channel (docs/attacks.md §5.1)
    beta: float = 0.9
    tol: float = 1e-3                 # stop an image's ER once its best residual is below this
    plateau_window: int = PLATEAU_WINDOW   # the plateau rule (attacks/images.py Plateau), per image: HIO until its
    plateau_tol: float = PLATEAU_TOL       # best residual plateaus (or hio its), then ER until the next (or er its);
    #                                        0 = no plateau (fixed budget)
    max_cpu_seconds: float = 0.0      # CPU-seconds cap per image-channel (its share of the batch; 0 = none)
    max_images: int = 16              # bank entries attacked per victim (0 = all); CPU budget
    support_frac: float = 0.02        # support = foreground in >= this fraction of the attacker's images ...
    support_dilate: int = 1           # ... dilated by this many pixels
    frame_px: int = 4                 # "support_frame": a known background border of this width
    background: str = "constant"      # outside the support: "zero" or an unknown constant per channel
    control_n: int = 8                # images in the padded positive control
    render_restarts: int = 32         # "render": random latents per image, of which the best ...
    render_keep: int = 4              # ... keep (lowest residual after the first stage) for the second
    render_steps: list = field(default_factory=lambda: [300, 700])   # Adam steps of the two stages
    learned_steps: int = 250          # "learned" (opt-in): latent Adam steps, taken out of the hio iterations ...
    learned_dilate: int = 3           # ... then HIO + ER inside the decoded image's foreground dilated by this
    prior_latent: int = 16            # the VAE on aux.public (attacks/prior.py PriorSettings): latent dimension,
    prior_steps: int = 1200           # training steps,
    prior_rotate: float = 90.0        # rotation augmentation (+- degrees)
    seed: int = 0


class PhaseRetrieval(_BankAttack):
    """Variants: "box" (no support), "support" (mask estimated from aux.public, the held-out domain),
    "support_domain" (estimated from aux.domain_samples of the victim's own domain, i.e. same-site public
    images), "support_frame" (a known border of frame_px pixels), "render" (the rotated digits' public recipe,
    aux.layout: fit the 8 x 8 digit behind each amplitude, ``render_fit``; other datasets: skipped).

    The frame is the layout prior of the upright embedded digits (each digit scaled into the central 20 x 20 box
    of the 28 x 28 canvas, a 4 px empty border): public knowledge of how the dataset is made, never read off the
    victim's images. Rotated domains break it: a digit rotated by 15 deg about the centre reaches past that box
    near the corners, so on rot15 the frame zeroes true pixels. Measured on 16 rot15 training images (1000 HIO +
    200 ER, 8 restarts, zero background): 24.0 dB mean aligned PSNR with the 4 px frame, 28.3 dB with the exact
    rotated 20 x 20 box (which does contain every digit); 3000 + 600 iterations with the rotated box give no more
    (the failed images stagnate at a Fourier residual near 1e-3, not for lack of iterations). On rot0 the frame
    is exact and the per-image PSNR is bimodal (24 - 93 dB): some images come back exactly, others stagnate.

    "render" uses all the public knowledge of how these images are made (the frame uses only the box): 64 unknowns
    per image. Measured on 16 training images per angle (32 restarts, best 4 continued, 300 + 700 Adam steps,
    one thread, ~20 s): rot15 77.9 dB mean aligned PSNR (12 of 16 exact), another 16 at rot0/rot15/rot60:
    59.8/63.5/65.6 dB mean (half exact; the others stagnate at 25-34 dB)."""
    name = "amplitude_phase_retrieval"
    aux = ("public", "domain_samples", "layout")
    outputs = {"box": "box constraint only",
               "support": "support mask from public images",
               "support_domain": "support mask from same-site public images",
               "support_frame": "known-layout frame (the upright 20x20 digit box)",
               "render": "oracle: the dataset's public recipe (8x8 digit, bilinear to 20x20, rotated by the domain's "
                         "angle), 64 unknowns per image; an upper bound, not what a typical attacker knows",
               "learned": "learned prior: a VAE trained on the attacker's public images of the held-out domain "
                          "(another domain than the victim's, rotation-augmented); latent fit, then HIO + ER inside "
                          "the decoded image's dilated foreground"}
    Params = PRParams
    priors = {"box": "none", "support_frame": "layout", "render": "oracle", "learned": "learned", "*": "layout"}
    budget = {"*": (("hio", "er"), "restarts"), "render": (("render_steps",), "render_restarts")}

    def __init__(self, params=None, device: str = "cpu"):
        super().__init__(params, device)
        if len(self.p.render_steps) != 2 or min(self.p.render_steps) < 0:
            raise UserError(f"{self.name}.render_steps = {self.p.render_steps!r}: give two step counts, e.g. [300, 700]")
        p = self.p
        self.outputs = {**self.outputs, "learned": self.outputs["learned"] + f"; budget {p.hio + p.er} iterations "
                        f"({min(p.learned_steps, p.hio)} latent + {max(p.hio - p.learned_steps, 0)} HIO + {p.er} ER) "
                        f"x {p.restarts} restarts"}

    def cost(self) -> dict:   # the cost guard: per image, iteration, restart and variant; the learned prior per run
        p = self.p
        return {"run": 25.0 * p.prior_steps / 1e3 * ("learned" in p.variants), "max_images": p.max_images,
                "image": 0.066 / 1e3 * (p.hio + p.er) * p.restarts * len(p.variants) + 0.025 * len(p.variants)}

    def _support(self, variant: str, aux, victim: str, size: int) -> torch.Tensor | None:
        if variant == "box":
            return None
        if variant == "support_frame":
            s, f = torch.zeros(size, size, dtype=torch.bool), self.p.frame_px
            s[f:size - f, f:size - f] = True
            return s.to(self.device)
        x = aux.public.x if variant == "support" else aux.domain_samples[victim].x
        return estimate_support(x.to(self.device), self.p.support_frac, dilate=self.p.support_dilate)

    def rule(self, learned: bool = False) -> str:
        """``Reconstruction.plateau`` of this attack's HIO + ER (and, ``learned``, its latent fit first)."""
        p = self.p
        hio = max(p.hio - p.learned_steps, 0) if learned else p.hio
        stages = (f"latent fit until a plateau or {min(p.learned_steps, p.hio)} steps, then " if learned else "") + \
            f"HIO until a plateau or {hio} its, then ER until a plateau, {p.er} its or residual < {p.tol:g}"
        return plateau_rule(p.plateau_window, p.plateau_tol, f"{p.hio + p.er} its per image", stages,
                            p.max_cpu_seconds)

    def attack_bank(self, amp: torch.Tensor, support, gen) -> torch.Tensor:
        """Images (N, C, H, W) from a bank (N, C, H, W) of full amplitudes; ``support``: None, one (H, W) mask, or
        one mask per image (N, H, W)."""
        p, (N, C, H, W) = self.p, amp.shape
        if support is not None and support.dim() == 3:
            support = support.repeat_interleave(C, 0)
        g, _, plat = retrieve(amp.reshape(N * C, H, W), support, p.background, p.hio, p.er, p.restarts, p.beta, p.tol,
                              gen, None, p.plateau_window, p.plateau_tol, p.max_cpu_seconds)
        self.cost = plat.its.view(N, C).amax(1), plat.cpu.view(N, C).sum(1)   # per image: iterations, CPU s
        return register_channels(g.view(N, C, H, W))

    def attack_learned(self, amp: torch.Tensor, public: torch.Tensor, gen, view=None) -> torch.Tensor:
        """Images (N, C, H, W) from full amplitudes through the learned prior: every restart's latent fit is refined
        by HIO + ER from its decoded image inside that image's dilated foreground; the lowest residual is kept."""
        p, (N, C, H, W) = self.p, amp.shape
        prior = learned_prior(public.to(self.device), settings_of(p), p.seed, view)
        x0, _, fit = fit_amplitude(prior, amp, p.restarts, min(p.learned_steps, p.hio), gen, window=p.plateau_window,
                                   tol=p.plateau_tol)                                # (R, N, C, H, W)
        sup = foreground(x0.flatten(0, 1), dilate=p.learned_dilate).repeat_interleave(C, 0)
        g, res, plat = retrieve(amp.repeat(p.restarts, 1, 1, 1).flatten(0, 1), sup, p.background,
                                max(p.hio - p.learned_steps, 0), p.er, 1, p.beta, p.tol, gen, x0.flatten(0, 2),
                                p.plateau_window, p.plateau_tol, p.max_cpu_seconds)
        its, cpu = plat.its.view(p.restarts, N, C), plat.cpu.view(p.restarts, N, C)   # per image: latent + pixel
        self.cost = fit.its + its.amax((0, 2)), fit.cpu + cpu.sum((0, 2))
        best = res.view(p.restarts, N, C).sum(-1).argmin(0)
        return g.view(p.restarts, N, C, H, W)[best, torch.arange(N, device=amp.device)]

    def run(self, view, aux):
        """Every victim's bank under every variant goes through one batched retrieval (one tensor op per
        iteration for the whole attack); "box" is the all-True mask."""
        size = view.shape[1]
        gen = torch.Generator().manual_seed(self.p.seed)
        outs, jobs, renders, learned = [], [], [], []
        for victim, rnd, amp in bank_entries(view, self.p.max_victims):
            if tuple(amp.shape[-2:]) != (size, size):
                outs.append(Skipped(victim, KIND, rnd, f"the bank holds a {tuple(amp.shape[-2:])} window of the "
                                    f"{size}x{size} spectrum; phase retrieval needs the full amplitude"))
                continue
            rows = np.arange(min(len(amp), self.p.max_images or len(amp)))
            a = amp[rows].to(self.device, torch.float32)
            for v in self.p.variants:
                if v == "render":
                    angle = aux.layout.get("angle", {}).get(victim.split("/")[0])
                    if aux.layout.get("render") != "digits-rotated" or angle is None or a.shape[1] != 1:
                        outs.append(Skipped(victim, KIND, rnd, "variant render: the dataset publishes no recipe "
                                            "for this domain (aux.layout; only the embedded rotated digits have one)"))
                    else:
                        renders.append((victim, rnd, rows, a, float(angle)))
                    continue
                if v == "learned":
                    learned.append((victim, rnd, rows, a))
                    continue
                s = self._support(v, aux, victim, size)
                s = torch.ones(size, size, dtype=torch.bool, device=self.device) if s is None else s
                jobs.append((victim, rnd, rows, a, v, s))
        done = []
        if jobs:
            amp = torch.cat([a for *_, a, _, _ in jobs])
            sup = torch.cat([s.expand(len(a), size, size) for *_, a, _, s in jobs])
            sizes = [len(j[3]) for j in jobs]
            rec = zip(self.attack_bank(amp, sup, gen).split(sizes), *(c.split(sizes) for c in self.cost))
            done += [(victim, rnd, rows, a, v, r, int(its.max()), float(cpu.sum()), self.rule())
                     for (victim, rnd, rows, a, v, _), (r, its, cpu) in zip(jobs, rec)]
        if renders:      # every rendered victim in one batched fit
            amp = torch.cat([a[:, 0] for *_, a, _ in renders])
            ang = torch.cat([torch.full((len(a),), g) for *_, a, g in renders]).to(amp)
            t0, n = time.process_time(), len(amp)
            rec = render_fit(amp, ang, self.p.render_restarts, self.p.render_keep, self.p.render_steps,
                             gen).split([len(j[3]) for j in renders])
            cpu = (time.process_time() - t0) / n   # a fixed budget: every image's share is alike
            done += [(victim, rnd, rows, a, "render", r, sum(self.p.render_steps), cpu * len(a), "")
                     for (victim, rnd, rows, a, _), r in zip(renders, rec)]
        if learned:      # every victim through one prior, one batched fit
            sizes = [len(j[3]) for j in learned]
            rec = self.attack_learned(torch.cat([a for *_, a in learned]), aux.public.x, gen, view).split(sizes)
            done += [(*j, "learned", r, int(its.max()), float(cpu.sum()), self.rule(learned=True))
                     for j, r, its, cpu in zip(learned, rec, *(c.split(sizes) for c in self.cost))]
        for victim, rnd, rows, a, v, r, its, cpu, rule in done:   # baseline: the flat image at the un-noised DC term
            r = r.clamp(0, 1)   # the pixels' contract: rounding can leave -3e-8
            outs.append(Reconstruction(victim, KIND, rnd, r, truth=records.AMP, rows=rows, aligned=True, variant=v,
                                       flat_baseline=True, iterations=its, cpu_seconds=cpu, plateau=rule))
        return outs

    def control(self):
        """Positive control: 2x zero-padded toy images with the known support come back exactly."""
        gen = torch.Generator().manual_seed(self.p.seed)
        n, s = self.p.control_n, 16
        xp = F.pad(toy_images(n, 1, s, gen), (0, s, 0, s)).to(self.device)
        sup = torch.zeros(2 * s, 2 * s, dtype=torch.bool, device=self.device)
        sup[:s, :s] = True
        # docs/attacks.md §5.1 settings (1000 HIO + 200 ER, 8 restarts): the control checks the algorithm, not budget
        g, *_ = retrieve(torch.fft.fft2(xp[:, 0]).abs(), sup, "zero", 1000, 200, 8, self.p.beta, 0.0, gen, None,
                         self.p.plateau_window, self.p.plateau_tol)
        ps = M.aligned_psnr(g[:, None].cpu(), xp.cpu())
        out = [Control("2x zero-padded toy images, known support: median aligned PSNR", "psnr", float(ps.median()),
                       60.0)]
        if "render" in self.p.variants:    # random latents through the recipe at 15 deg: exact solutions are found
            z = torch.rand(16, 1, 8, 8, generator=gen).to(self.device)
            x = rotate(place(z), 15.0)
            d = PRParams()      # the default budget: the control checks the algorithm, not the budget
            r = render_fit(torch.fft.fft2(x[:, 0]).abs(), torch.full((16,), 15.0, device=self.device),
                           d.render_restarts, d.render_keep, d.render_steps, gen)
            exact = (M.aligned_psnr(r.cpu(), x.cpu()) >= 60).float().mean()
            out.append(Control("render: random 8x8 latents rotated 15 deg, share recovered exactly (>= 60 dB)",
                               "share", float(exact), 0.2))
        return out


# ------------------------------------------------------------------------------------------ fingerprint

def fingerprint(amp: torch.Tensor) -> torch.Tensor:
    """psi = log(1 + A), mean-removed and L2-normalised per entry: (N, C, h, w) -> (N, C*h*w)."""
    f = torch.log1p(amp.float()).flatten(1)
    f = f - f.mean(1, keepdim=True)
    return f / f.norm(dim=1, keepdim=True).clamp_min(1e-12)


def best_match(cand: torch.Tensor, amp: torch.Tensor) -> torch.Tensor:
    """Score of each candidate image (M, C, H, W): its best fingerprint cosine to any bank entry (N, C, h, w)."""
    return (fingerprint(amplitude(cand, amp.shape[-2:])) @ fingerprint(amp).T).amax(1)


@dataclass
class FPParams(AttackParams):
    adversary_view: str = "client"
    variants: list = field(default_factory=lambda: ["exact", "perturbed"])
    shift: int = 2                    # "perturbed": non-circular shift up to +-shift px,
    gain: float = 0.1                 # gain within +-gain,
    noise: float = 0.02               # Gaussian noise of this sigma
    control_n: int = 64
    seed: int = 0


class Fingerprint(_BankAttack):
    """Membership / linkage: is a candidate image in the victim's bank? Variants "exact" (candidates as held)
    and "perturbed" (the attacker holds slightly different copies)."""
    name = "amplitude_fingerprint"
    aux = ("candidates",)
    outputs = {"exact": "exact copies of the candidates (the attacker holds the same image files)",
               "perturbed": "perturbed copies of the candidates"}
    Params = FPParams
    rows = {"perturbed": "perturbed copies of the candidates"}

    def run(self, view, aux):
        gen, outs = torch.Generator().manual_seed(self.p.seed), []
        for victim, rnd, amp in bank_entries(view, self.p.max_victims):
            if victim not in aux.candidates:
                continue
            amp, x = amp.to(self.device), aux.candidates[victim].x.to(self.device)
            for v in self.p.variants:
                c = perturb(x, gen, self.p.shift, self.p.gain, self.p.noise) if v == "perturbed" else x
                outs.append(Scores(victim, KIND, rnd, best_match(c, amp).cpu().numpy(), variant=v))
        return outs

    def control(self):
        """Exact copies of bank images are found (AUC 1); images never in the bank score alike (AUC ~ 0.5)."""
        gen = torch.Generator().manual_seed(self.p.seed)
        n = self.p.control_n
        x = toy_images(3 * n, 1, 28, gen).to(self.device)
        bank = amplitude(x[:n])
        s = best_match(x, bank).cpu().numpy()
        lab = np.r_[np.ones(n), np.zeros(2 * n)]
        return [Control("exact copies of bank images: AUC", "auc", M.auc(s[:2 * n], lab[:2 * n]), 0.99),
                Control("two disjoint non-member sets: |AUC - 0.5|", "auc", abs(M.auc(s[n:], lab[:2 * n]) - 0.5),
                        0.2, positive=False)]


# ------------------------------------------------------------------------------------------ attribute inference

def radial_profile(amp: torch.Tensor, shifted: bool) -> torch.Tensor:
    """Mean log(1 + A) per channel in integer radial-frequency bins: (N, C, h, w) -> (N, C * bins).
    ``shifted``: the spectrum is fftshifted (a window crop), else unshifted."""
    (N, C, h, w), dev = amp.shape, amp.device
    fy = torch.arange(h, device=dev) - h // 2 if shifted else torch.fft.fftfreq(h, device=dev) * h
    fx = torch.arange(w, device=dev) - w // 2 if shifted else torch.fft.fftfreq(w, device=dev) * w
    r = (fy[:, None] ** 2 + fx[None, :] ** 2).sqrt().round().long().clamp(max=min(h, w) // 2).flatten()
    onehot = F.one_hot(r, int(r.max()) + 1).float()
    onehot = onehot / onehot.sum(0, keepdim=True)
    return (torch.log1p(amp.float()).flatten(2) @ onehot).flatten(1)


def features(amp: torch.Tensor, kind: str, full: tuple) -> np.ndarray:
    """"radial" (orientation-free radial log-spectrum) or "logamp" (the whole log-amplitude)."""
    if kind == "radial":
        f = radial_profile(amp, shifted=tuple(amp.shape[-2:]) != tuple(full))
    else:
        f = torch.log1p(amp.float()).flatten(1)
    return f.cpu().numpy()


def fit(x_train: np.ndarray, y_train: np.ndarray, c: float = 1.0):
    """Standardised multinomial logistic regression (L2, strength 1/c), fitted."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000)).fit(x_train, y_train)


@dataclass
class AIParams(AttackParams):
    adversary_view: str = "client"
    features: list = field(default_factory=lambda: ["radial", "logamp"])
    attributes: list = field(default_factory=lambda: ["class", "domain"])
    c: float = 1.0                    # inverse L2 strength of the logistic regression
    control_n: int = 200
    seed: int = 0


class AttributeInference(_BankAttack):
    """Predict each bank entry's class and domain from its amplitude. Variants "<features>/<training data>":
    class from aux.public only ("public") or also from aux.domain_samples ("public+domain_samples"); domain
    from aux.domain_samples (labels in aux.domains order)."""
    name = "amplitude_attribute"
    aux = ("public", "domain_samples")
    outputs = {   # variants are "<features>/<training data>": one entry per part
        "radial": "features: the radially averaged log-spectrum (orientation-free)",
        "logamp": "features: the whole log-amplitude",
        "public": "classifier trained on public images of the held-out domain only (not the victim's domain)",
        "public+domain_samples": "classifier trained on public images of the held-out and of every source domain",
        "domain_samples": "classifier trained on public samples of every source domain"}
    Params = AIParams

    def __init__(self, params=None, device: str = "cpu"):
        super().__init__(params, device)
        bad = [f for f in self.p.features if f not in ("radial", "logamp")] + \
            [a for a in self.p.attributes if a not in ("class", "domain")]
        if bad:
            raise UserError(f"{self.name}: unknown feature/attribute {bad[0]!r}: features are radial, logamp; "
                            "attributes are class, domain")

    def run(self, view, aux):
        full = view.shape[1:2] * 2
        banks, outs = bank_entries(view, self.p.max_victims), []
        for shape in {tuple(a.shape[-2:]) for _, _, a in banks}:   # one classifier per bank layout
            amp = lambda x: amplitude(x.to(self.device), shape)    # noqa: E731
            dom = [aux.domain_samples[d] for d in aux.domains]
            sets = {("class", "public"): (aux.public.x, aux.public.y, aux.num_classes),
                    ("class", "public+domain_samples"): (torch.cat([aux.public.x] + [s.x for s in dom]),
                                                         torch.cat([aux.public.y] + [s.y for s in dom]),
                                                         aux.num_classes),
                    ("domain", "domain_samples"): (torch.cat([s.x for s in dom]),
                                                   torch.cat([torch.full((len(s),), i) for i, s in enumerate(dom)]),
                                                   len(dom))}
            for (attr, src), (x, y, k) in sets.items():
                if attr not in self.p.attributes:
                    continue
                for feat in self.p.features:
                    clf = fit(features(amp(x), feat, full), y.numpy(), self.p.c)   # one fit for every victim
                    for victim, rnd, a in banks:
                        if tuple(a.shape[-2:]) == shape:
                            pred = clf.predict(features(a.to(self.device), feat, full))
                            outs.append(Predictions(victim, KIND, rnd, attr, pred, k, truth=records.AMP,
                                                    variant=f"{feat}/{src}"))
        return outs

    def control(self):
        """A linearly separable synthetic attribute (a fine grating added or not) is recovered; random labels
        stay at chance."""
        gen = torch.Generator().manual_seed(self.p.seed)
        n = self.p.control_n
        x = toy_images(2 * n, 1, 28, gen)
        attr = torch.randint(0, 2, (2 * n,), generator=gen)
        yy, xx = torch.meshgrid(torch.arange(28), torch.arange(28), indexing="ij")
        grating = 0.5 + 0.5 * torch.cos(2 * math.pi * (5 * yy + 7 * xx) / 28)
        x = torch.where(attr.view(-1, 1, 1, 1).bool(), 0.5 * x + 0.5 * grating, x)
        rand, out = torch.randint(0, 2, (2 * n,), generator=gen), []
        for feat in self.p.features:
            f = features(amplitude(x.to(self.device)), feat, (28, 28))
            for name, lab, thr, pos in (("synthetic separable attribute", attr, 0.9, True),
                                        ("random labels", rand, 0.65, False)):
                pred = fit(f[:n], lab[:n].numpy(), self.p.c).predict(f[n:])
                out.append(Control(f"{feat}: {name}: balanced accuracy", "balanced_acc",
                                   M.balanced_accuracy(pred, lab[n:].numpy(), 2), thr, positive=pos))
        return out
