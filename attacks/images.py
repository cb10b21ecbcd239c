"""Image helpers shared by the attacks: the attacker's imperfect copies of candidate images (``perturb``, used by the
amplitude and style fingerprints) and the total-variation prior of the image reconstructions (``total_variation``,
used by the update, style and prototype inversions)."""
from __future__ import annotations

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
