"""Image helpers shared by the attacks: the attacker's imperfect copies of candidate images (``perturb``, used by the
amplitude and style fingerprints), the total-variation prior of the image reconstructions (``total_variation``,
used by the update, style and prototype inversions), and the plateau rule that ends every reconstruction
optimisation (``Plateau``: phase retrieval and its learned variant, update inversion, fedavg_leakage)."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def perturb(x: torch.Tensor, gen: torch.Generator, shift: int = 2, gain: float = 0.1, noise: float = 0.02
            ) -> torch.Tensor:
    """The attacker's imperfect copies of images x (N, C, H, W) in [0, 1], per image: a non-circular integer shift by
    up to +-shift px in each direction (the edge rows/columns repeat, as when the crop window moves over a scene), a
    gain in [1-gain, 1+gain], Gaussian noise N(0, noise^2); clamped to [0, 1]. Random draws come from ``gen``."""
    N, C, H, W = x.shape
    dev = x.device
    d = torch.randint(-shift, shift + 1, (2, N), generator=gen).to(dev)
    xp = F.pad(x, (shift,) * 4, mode="replicate")
    rows = torch.arange(H, device=dev) + shift - d[0][:, None]            # out[i] = x[i - dy]
    cols = torch.arange(W, device=dev) + shift - d[1][:, None]
    out = xp.gather(2, rows.view(N, 1, H, 1).expand(N, C, H, W + 2 * shift))
    out = out.gather(3, cols.view(N, 1, 1, W).expand(N, C, H, W))
    g = 1 + gain * (2 * torch.rand(N, 1, 1, 1, generator=gen) - 1)
    return (out * g.to(dev) + noise * torch.randn(x.shape, generator=gen).to(dev)).clamp(0, 1)


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic total variation per image (N,) of x (N, ..., H, W): the mean absolute difference of vertically
    neighbouring pixels plus that of horizontally neighbouring pixels."""
    return (x[..., 1:, :] - x[..., :-1, :]).abs().flatten(1).mean(1) + \
        (x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(1)


# ------------------------------------------------------------------------------------------ plateau rule

PLATEAU_WINDOW, PLATEAU_TOL = 50, 0.01   # the defaults every reconstruction attack's Params repeats


def plateau_rule(window: int, tol: float, cap: str, stages: str = "", cpu: float = 0.0) -> str:
    """The stopping rule in words, for ``Reconstruction.plateau``; a ``tol`` of 0 turns the rule off (fixed budget)."""
    if tol <= 0:
        return f"fixed budget: {cap}" + (f" or {cpu:g} CPU s" if cpu > 0 else "")
    return (f"plateau: best objective improved < {tol:g} (relative) over {window} its, checked every {window}"
            + (f"; {stages}" if stages else "") + f"; cap {cap}" + (f" or {cpu:g} CPU s" if cpu > 0 else ""))


class Plateau:
    """The plateau rule of every reconstruction optimisation, for ``n`` units (victims, or images) run together.

    A unit's plateau: its best objective so far improved by less than ``tol`` (relative) over the last ``window``
    iterations, checked every ``window`` iterations (one host sync per check). At a plateau a unit moves to its next
    stage (a smaller step, or the next algorithm); after ``stages`` plateaus, or once it used ``cpu_cap`` CPU seconds
    (its share of the batch's process time; 0 = no cap), it is done. The caller runs the iteration cap. ``active``
    holds the indices of the units still running, in the order of the ``best`` tensors the caller passes."""

    def __init__(self, n: int, window: int, tol: float, stages: int = 1, cpu_cap: float = 0.0):
        self.window, self.tol, self.stages, self.cpu_cap = max(1, int(window)), float(tol), stages, cpu_cap
        self.mark = torch.full((n,), float("inf"), dtype=torch.float64)
        self.stage = torch.zeros(n, dtype=torch.long)
        self.its = torch.zeros(n, dtype=torch.long)
        self.cpu = torch.zeros(n, dtype=torch.float64)
        self.active = torch.arange(n)
        self.it, self._t = 0, time.process_time()

    def due(self) -> bool:
        """Count one iteration of the active units; True when a check is due."""
        self.it += 1
        return self.it % self.window == 0

    def _charge(self):
        now = time.process_time()
        if len(self.active):
            self.cpu[self.active] += (now - self._t) / len(self.active)
            self.its[self.active] = self.it
        self._t = now

    def check(self, best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the rule to the active units' best objectives ``best`` (len(active),): returns (moved to the next
        stage, done) as bool tensors over the active units, and drops the done ones from ``active``."""
        b, u = best.detach().double().cpu(), self.active
        moved = (self.mark[u] - b) < self.tol * self.mark[u].abs()      # inf marks (first check) never plateau
        self.mark[u] = b
        return moved, self.advance(moved)

    def advance(self, sel: torch.Tensor) -> torch.Tensor:
        """Move the selected active units (bool over ``active``) to their next stage (a plateau, or a stage's own
        cap); returns which active units are done, and drops them from ``active``."""
        self._charge()
        u = self.active
        self.stage[u] += sel.long()
        done = (self.stage[u] >= self.stages) | ((self.cpu[u] >= self.cpu_cap) if self.cpu_cap > 0 else False)
        self.active = u[~done]
        return done

    def finish(self):
        """End the optimisation (at the cap or with every unit done): charge the last iterations."""
        self._charge()
        self.active = self.active[:0]
