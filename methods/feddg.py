"""FedDG / ELCFS (Liu et al., CVPR 2021): episodic learning in continuous frequency space (docs/methods.md §2).

Protocol:
- Round 0, after FedAvg's ``hello`` (n_k): every client computes the amplitude spectrum of each training image,
  per channel, unshifted, ``|FFT2(x)|`` over (H, W) (the official ``np.abs(np.fft.fft2(img, axes=(-2, -1)))``), and
  uploads it: phase ``bank``, kind ``amplitude_bank``, arrays ``{"amp": (N, C, H, W)}``. The server relays to each
  client the *other* clients' banks in one message: phase ``bank_relay``, kind ``amplitude_bank``, arrays
  ``{"<sender>/amp": ...}``. The ground truth ``amp`` (truth name == array name) holds the global image ids ``idx``
  of the bank rows, in row order.
- Every round: FedAvg (broadcast, local training, n_k-weighted average of the full state).
- Local training, per batch: every image gets another client's amplitude (source client uniform, then one of its
  bank entries uniform); inside the central low-frequency window of half-size b = floor(L * min(H, W)), i.e.
  (2b+1)^2 coefficients after fftshift, its amplitude becomes (1 - lam) * own + lam * other with lam ~ U[0, 1]
  per image (the paper's eq. 2 as corrected by the authors in issue #2); the phase stays its own; the inverse
  FFT's real part is clamped to [0, 1] (``clamp``; the official loader clips to [0, 255]).
  Episodic step (first order, as ``train_ELCFS.py``): L_in = CE(x; theta); theta' = theta - beta * clamp(grad L_in,
  +-clip) with the gradient treated as a constant (no create_graph); L_out = CE(x_transformed; theta') through
  ``torch.func.functional_call``; one optimizer step on L_in + L_out. Because theta' depends on theta with identity
  Jacobian, dL_out/dtheta = dL_out/dtheta' reaches the real model (the CCST re-implementation loads theta' into a
  deep copy and so sends no outer gradient at all; tests check that ours does). The inner gradient is computed
  once and reused: the loss handed to the optimizer is L_in + L_out in value and g_in + dL_out/dtheta' in gradient
  (the official code back-propagates L_in a second time, which gives the same gradient at 1.2-1.4x the
  cost; ``bench/feddg_step.py``).
- Mixing randomness (source client, bank row, lam) is drawn on the device from a generator seeded by the client's
  seeded generator: no host-to-device copy per step.
- The segmentation boundary (NT-Xent) loss is omitted: this is classification (CSAC also discards it).

Paper vs. official code (docs/methods.md §2, "Code != paper"); the paper is the default:
- ``variant = "paper"``: continuous lam ~ U[0, 1] and the window from ``L``. ``variant = "official"``: the released
  dataloader, ``source_to_target_freq(..., L=0)``: a 1x1 window (the DC term, i.e. each channel's mean intensity)
  replaced outright (lam = 1); ``L`` is ignored.
- ``bank_fraction``: the README extracts every training image (1.0, default); the official dataloader uses a random
  ``int(N/8)`` subset per client (0.125). The subset is drawn with the client's seeded rng and the truth lists it.
- ``bank_dtype``: float32 (default, the testbed's image dtype) or float64 (numpy, as the official ``.npy`` files).
- ``bank_content``: ``"full"`` (the spectrum the paper specifies and the code stores) or ``"window"``: only the
  central (2b+1)^2 window after fftshift, the only part training uses (a different, smaller artifact for attacks).
- ``relay``: ``"full"`` (default: the server relays the other clients' banks as uploaded, as the paper's shared
  bank) or ``"window"``: the server relays only the central (2b+1)^2 windows, the only part clients use; training
  is identical, relay bytes shrink by (2b+1)^2 / (H W) (``bench/feddg_step.py`` measures them).

Example-level DP-SGD (``[privacy] dp_sgd = true``): the episodic objective is made per-example separable: each
example's inner step uses its own gradient, theta'_i = theta - beta * clamp(grad CE(x_i)), and its outer loss is
CE(T(x_i); theta'_i) on its own transformed image; per-example gradients g_in,i + dL_out,i/dtheta'_i (first
order, as above) come from ``torch.func`` (vmap over grad) and go through Opacus' DPOptimizer (clip, noise,
accountant). T(x_i) mixes x_i with other clients' bank rows: those are not this client's data, are fixed before
training, and enter no other example's term, so each example's contribution is still one clipped gradient and the
per-example sensitivity holds. (Without DP the inner step uses the batch-mean gradient, as the official code.)
The bank itself is a separate release: privatize it with ``[privacy.artifacts] amplitude_bank``; privacy.csv's
``total`` composes both.
- Pixel scale: images here are in [0, 1]; the official code works on 0-255 pixels. The amplitude is linear in the
  pixel scale, so a bank here equals the official bank / 255 (up to the resize the official code does first).
- Official hyperparameters: Adam lr 1e-3, batch 5, meta_step_size 1e-3, clip_value 100 (defaults here for beta and
  clip); the optimizer settings come from the shared TrainParams.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fdg_audit.api import UserError, records
from fdg_audit.api.method import MethodPlugin, Reply
from fdg_audit.api.privacy import per_sample

from .fedavg import FedAvgClient, FedAvgServer, uniform_mean
from .fedavg import Params as FedAvgParams


@dataclass
class Params(FedAvgParams):
    variant: str = "paper"          # paper (continuous lam, window from L) | official (DC only, lam = 1)
    L: float = 0.1                  # window half-size ratio: b = floor(L * min(H, W)); 28 px -> b = 2, a 5x5 window
    meta_step_size: float = 1e-3    # beta of the fast weights (official default)
    clip_value: float = 100.0       # inner-gradient clamp (official default)
    clamp: bool = True              # clamp transformed images to [0, 1] (official: np.clip to [0, 255])
    bank_content: str = "full"      # full (|FFT2| of the whole image) | window (central (2b+1)^2 after fftshift)
    bank_fraction: float = 1.0      # share of training images in the bank (official dataloader: 1/8 = 0.125)
    bank_dtype: str = "float32"     # float32 | float64 (official .npy files)
    relay: str = "full"             # full (banks as uploaded) | window (only the central windows clients use)

    def __post_init__(self):
        for key, allowed in (("variant", ("paper", "official")), ("bank_content", ("full", "window")),
                             ("bank_dtype", ("float32", "float64")), ("relay", ("full", "window"))):
            if getattr(self, key) not in allowed:
                raise UserError(f"feddg {key} = {getattr(self, key)!r}: use one of {', '.join(allowed)}")
        if not 0.0 < self.bank_fraction <= 1.0:
            raise UserError(f"feddg bank_fraction = {self.bank_fraction!r}: use a number in (0, 1], e.g. 0.125")
        if self.L < 0:
            raise UserError(f"feddg L = {self.L!r}: use a ratio >= 0, e.g. 0.1 (0 = the DC term only)")


# ------------------------------------------------------------------------------------------ frequency tools

def half_window(p: Params, h: int, w: int) -> int:
    """b of the (2b+1)^2 central window (0 = the DC term), capped so the window fits the image."""
    b = 0 if p.variant == "official" else int(p.L * min(h, w))
    return min(b, (h - 1) // 2, (w - 1) // 2)


def amplitude(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """|FFT2| over (H, W), per channel, unshifted: the bank entry of every image in ``x`` (N, C, H, W)."""
    return torch.fft.fft2(x.to(dtype)).abs()


def central(amp: torch.Tensor, b: int) -> torch.Tensor:
    """The central (2b+1)^2 window of unshifted spectra (..., H, W), after fftshift (the DC term is at H//2, W//2)."""
    h, w = amp.shape[-2:]
    s = torch.fft.fftshift(amp, dim=(-2, -1))
    return s[..., h // 2 - b:h // 2 + b + 1, w // 2 - b:w // 2 + b + 1]


def mix(x: torch.Tensor, other: torch.Tensor, lam: torch.Tensor, b: int, clamp: bool = True) -> torch.Tensor:
    """Frequency-space interpolation: inside the central window, x's amplitude becomes (1 - lam) * own + lam * other
    (``other``: (N, C, 2b+1, 2b+1) windows, ``lam``: (N,)); x's phase is kept; returns the real part of the IFFT."""
    f = torch.fft.fft2(x)
    amp, pha = f.abs(), f.angle()
    h, w = x.shape[-2:]
    s = torch.fft.fftshift(amp, dim=(-2, -1))
    rows, cols = slice(h // 2 - b, h // 2 + b + 1), slice(w // 2 - b, w // 2 + b + 1)
    lam = lam.to(s.dtype).view(-1, 1, 1, 1)
    s[..., rows, cols] = (1 - lam) * s[..., rows, cols] + lam * other.to(s.dtype)
    out = torch.fft.ifft2(torch.polar(torch.fft.ifftshift(s, dim=(-2, -1)), pha)).real
    return out.clamp(0.0, 1.0) if clamp else out


# ------------------------------------------------------------------------------------------ parties

class FedDGClient(FedAvgClient):
    def on_bank(self, msg):
        """Upload the amplitude spectra of (a seeded subset of) the training images."""
        p, n = self.params, len(self.train.y)
        if p.bank_fraction < 1.0:
            rows = torch.as_tensor(sorted(self.rng.choice(n, max(1, int(n * p.bank_fraction)), replace=False)))
        else:
            rows = torch.arange(n)
        amp = amplitude(self.train.x[rows.to(self.train.x.device)], getattr(torch, p.bank_dtype))
        if p.bank_content == "window":
            amp = central(amp, half_window(p, *amp.shape[-2:]))
        self.record_truth(records.AMP, idx=self.train.idx[rows.numpy()])
        return Reply("amplitude_bank", {"amp": amp.contiguous()})

    def on_bank_relay(self, msg):
        """Keep the other clients' central windows (``set_bank``)."""
        if not msg.arrays:
            raise UserError("feddg needs at least two source clients to exchange amplitudes: add a domain")
        self.set_bank([msg.arrays[key] for key in sorted(msg.arrays)])
        return None

    def set_bank(self, sources: list) -> None:
        """The hook a subclass that shares something else calls: ``sources`` holds one tensor of amplitude spectra
        (R, C, H, W), unshifted as ``amplitude`` gives them, or already central (R, C, 2b+1, 2b+1) windows, per
        other client. It sets the state ``transform`` draws from: ``b`` (half window), ``windows`` (all rows,
        concatenated), ``counts`` and ``offsets`` (each source's row range); a source is drawn uniformly, then one
        of its rows."""
        h, w = self.train.x.shape[-2:]
        self.b = half_window(self.params, h, w)
        wins = [a if a.shape[-1] == 2 * self.b + 1 else central(a, self.b) for a in sources]
        if not wins or any(len(a) == 0 for a in wins):
            raise UserError(f"{type(self).__name__}.set_bank: give at least one non-empty tensor of spectra per source")
        counts = torch.tensor([len(a) for a in wins], device=self.device)
        self.windows = torch.cat(wins).to(self.device, torch.float32)
        self.counts, self.offsets = counts, torch.cumsum(counts, 0) - counts

    def device_gen(self) -> torch.Generator:
        """A generator on the device, seeded from the client's seeded (CPU) generator once per reseed."""
        if getattr(self, "_dgen_src", None) is not self.gen:
            seed = int(torch.randint(0, 2 ** 62, (1,), generator=self.gen))
            self._dgen, self._dgen_src = torch.Generator(device=self.device).manual_seed(seed), self.gen
        return self._dgen

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """x moved toward other clients' amplitude (one random source client and bank entry per image)."""
        n, g, dev = len(x), self.device_gen(), self.device
        src = torch.randint(len(self.counts), (n,), generator=g, device=dev)
        u = torch.rand(n, generator=g, device=dev)
        row = self.offsets[src] + (u * self.counts[src]).long().clamp_max(self.counts[src] - 1)
        lam = torch.ones(n, device=dev) if self.params.variant == "official" else torch.rand(n, generator=g, device=dev)
        return mix(x, self.windows[row], lam, self.b, self.params.clamp)

    def episodic_loss(self, model, x, y):
        """L_in(theta) + L_out(theta'), theta' = theta - beta * clamp(grad L_in) (first order). The inner gradient
        g_in is computed once; the returned loss has the value L_in + L_out and the gradient g_in + dL_out/dtheta'
        (a detached inner product with g_in stands in for L_in's second backward pass)."""
        p = self.params
        with torch.no_grad():
            xt = self.transform(x)
        loss_in = F.cross_entropy(model(x), y)
        names, params = zip(*[(k, v) for k, v in model.named_parameters() if v.requires_grad])
        grads = torch.autograd.grad(loss_in, params)
        fast = {k: v - p.meta_step_size * g.clamp(-p.clip_value, p.clip_value)
                for k, v, g in zip(names, params, grads)}
        loss_out = F.cross_entropy(functional_call(model, {**dict(model.named_buffers()), **fast}, (xt,)), y)
        lin = sum((v * g).sum() for v, g in zip(params, grads))
        return loss_out + lin - lin.detach() + loss_in.detach()

    def per_example_grads(self, model, x, y) -> list[torch.Tensor]:
        """Per-example gradients of the separable episodic objective (see the module docstring), one (B, *shape)
        tensor per trainable parameter, from torch.func (vmap over grad)."""
        p = self.params
        with torch.no_grad():
            xt = self.transform(x)
        names = [k for k, v in model.named_parameters() if v.requires_grad]
        theta = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
        bufs = dict(model.named_buffers())

        def ce(prm, xi, yi):
            return F.cross_entropy(functional_call(model, {**bufs, **prm}, (xi[None],)), yi[None])

        def one(prm, xi, xti, yi):
            g_in = grad(ce)(prm, xi, yi)
            fast = {k: prm[k] - p.meta_step_size * g_in[k].clamp(-p.clip_value, p.clip_value) for k in prm}
            g_out = grad(ce)(fast, xti, yi)
            return {k: g_in[k] + g_out[k] for k in prm}

        g = vmap(one, in_dims=(None, 0, 0, 0), randomness="different")(theta, x, xt, y)
        return [g[k] for k in names]

    def local_update(self):
        loss = self.episodic_loss
        if self.privacy is not None and self.privacy.dp_sgd:
            loss = per_sample(functools.partial(FedDGClient.episodic_loss, self), self.per_example_grads)
        self.fit(self.model, loss)


class FedDGServer(FedAvgServer):
    bank_kind = "amplitude_bank"   # the kind the relay is sent as (a subclass sharing another artifact names its own)

    def begin(self):
        super().begin()
        banks = self.ask("bank")
        amps = {o: banks[o].arrays["amp"] for o in self.clients}
        if self.params.relay == "window":
            h, w = self.shape[1:3]
            b = half_window(self.params, h, w)
            amps = {o: a if a.shape[-1] == 2 * b + 1 else central(a, b).contiguous() for o, a in amps.items()}
        self.exchange("bank_relay", self.bank_kind,
                      {c: ({f"{o}/amp": amps[o] for o in self.clients if o != c}, {}) for c in self.clients})


class FedDG(MethodPlugin):
    name = "feddg"
    title = "FedDG"
    Params = Params
    Server = FedDGServer
    Client = FedDGClient
    partial_participation = True   # banks are exchanged once (round 0, every client); the rounds are FedAvg's
    kinds = ("n_samples", "amplitude_bank", "weights")
    aggregate_share = staticmethod(uniform_mean)   # FedAvg's server
    # public frequency tools, for subclasses and attacks (Kerckhoffs): FedDG = fdg_audit.api.load_method("feddg")
    amplitude, central, mix, half_window = (staticmethod(f) for f in (amplitude, central, mix, half_window))
