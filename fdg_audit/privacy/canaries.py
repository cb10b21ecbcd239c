"""Canaries for DP audits (docs/attacks.md §4.2): m slots appended to an audited client's training split.

Canary j is a public image built from the public ``[privacy.audit] seed``: a full-contrast grating
0.5 + 0.5 cos(2 pi (u r + v c) / S + phi_j) (same in every channel) at its own spatial frequency (u, v), drawn
without repetition from the frequencies that are not their own conjugate. Its amplitude spectrum is the DC term
plus two spikes at +-(u, v): with the DC removed, the spectra of two canaries are exactly orthogonal, which makes
each canary's fingerprint distinctive. Labels are uniform random (mislabelled canaries, also usable for DP-SGD
audits). Canary j depends only on (seed, j), never on m.

Each slot holds its canary with probability 1/2, from the client's private seed (the auditor does not know
which); otherwise ``out = "null"`` puts a null record there (an all-black image, whose amplitude row is zero:
the zero-out neighbouring relation the artifact mechanism is accounted under), or ``out = "absent"`` leaves the
slot out (add/remove, Opacus' relation for DP-SGD). The truth record ``canaries`` (scorers only) holds ``member``
(m,) and the slots' ids ``idx`` = -1 - j (negative, apart from every real image id). Audit runs are for audits:
attacks that score against real image ids do not know the canary ids.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import records, seeding
from ..data.base import Split

CANARY_STREAM = 0x0CA7   # spawn key of the client's private coin flips


def canary_frequencies(size: int, seed: int) -> np.ndarray:
    """(K, 2) distinct frequencies (u, v), one of each conjugate pair, never self-conjugate, in seeded order."""
    u, v = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    u, v = u.ravel(), v.ravel()
    cu, cv = (-u) % size, (-v) % size
    keep = (u * size + v) < (cu * size + cv)      # one of each pair {k, -k}; drops k == -k (DC, Nyquist)
    f = np.stack([u[keep], v[keep]], 1)
    return f[seeding.rng(seed, 1).permutation(len(f))]


def canary_images(m: int, channels: int, size: int, seed: int = 0) -> torch.Tensor:
    """(m, C, S, S) canary images in [0, 1]."""
    f = canary_frequencies(size, seed)
    if m > len(f):
        raise ValueError(f"at most {len(f)} canaries fit {size}x{size} images, asked for {m}")
    phase = seeding.rng(seed, 2).uniform(0, 2 * np.pi, len(f))[:m]
    r = torch.arange(size, dtype=torch.float64)
    fu = torch.as_tensor(f[:m, 0], dtype=torch.float64).view(-1, 1, 1)
    fv = torch.as_tensor(f[:m, 1], dtype=torch.float64).view(-1, 1, 1)
    arg = 2 * torch.pi * (fu * r.view(1, -1, 1) + fv * r.view(1, 1, -1)) / size + torch.as_tensor(phase).view(-1, 1, 1)
    x = 0.5 + 0.5 * torch.cos(arg)
    return x[:, None].expand(m, channels, size, size).float().contiguous()


def canary_labels(m: int, num_classes: int, seed: int = 0) -> torch.Tensor:
    return torch.as_tensor(seeding.rng(seed, 3).integers(0, num_classes, 4096)[:m], dtype=torch.long)


def insert_canaries(client, audit) -> None:
    """Append the canary slots to ``client.train`` and record which canaries went in."""
    if audit.clients and client.id not in audit.clients:
        return
    c, s, _, k = client.shape
    m, dev = audit.canaries, client.train.x.device
    coins = client.stream(CANARY_STREAM)
    member = coins.random(m) < 0.5
    ids = -1 - np.arange(m)
    x = canary_images(m, c, s, audit.seed).to(dev)
    y = canary_labels(m, k, audit.seed).to(dev)
    if audit.out == "null":
        x = x * torch.as_tensor(member, device=dev, dtype=x.dtype).view(-1, 1, 1, 1)
        keep = np.ones(m, bool)
    else:
        keep = member
    sel = torch.as_tensor(np.flatnonzero(keep), device=dev, dtype=torch.long)
    t = client.train
    client.train = Split(torch.cat([t.x, x[sel]]), torch.cat([t.y, y[sel]]), np.concatenate([t.idx, ids[keep]]))
    client.record_truth(records.CANARIES, member=member, idx=ids)
