"""MNIST-style IDX files (gzipped or not) as domains: "rotated" (Rotated-MNIST / Rotated-Fashion-MNIST) or
"appearance" (the five colour/texture/contrast styles of the digits' appearance family, 3 channels).

train and t10k are concatenated; image ids are row numbers in that concatenation (train first). Each domain
gets a disjoint random subset of ``per_domain`` images (0 means 1000, to stay small).
"""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch

from .base import FASHION_MNIST_ROOT, DataConfig, DomainSet, select_domains, split_domain
from .digits import FAMILIES, ROTATED, appearance, domain_names, domain_rows, not_digits_dg, rotate  # noqa: F401
from fdg_audit import seeding
from fdg_audit.errors import UserError

IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
DEFAULT_PER_DOMAIN = 1000
MAX_IDX_DIMS = 4            # MNIST-style files have 1 (labels) or 3 (images) dimensions


def read_idx(path: str | Path) -> np.ndarray:
    """Parse one IDX file (magic 0 0 <type> <ndim>, ndim big-endian uint32 dims, big-endian data)."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise UserError(f"IDX file {path} is not valid gzip ({e}): replace it with an intact copy") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPES:
        raise UserError(f"{path} is not an IDX file (bad magic number): point data.root at MNIST-format IDX files")
    ndim = raw[3]
    if not 1 <= ndim <= MAX_IDX_DIMS or len(raw) < 4 + 4 * ndim:
        raise UserError(f"IDX file {path} claims {ndim} dimensions ({len(raw)} bytes; this reader takes 1 to "
                        f"{MAX_IDX_DIMS} and a complete header): point data.root at MNIST-format IDX files")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dtype = np.dtype(IDX_DTYPES[raw[2]])
    body = raw[4 + 4 * ndim:]
    if len(body) != dtype.itemsize * int(np.prod(dims)):
        raise UserError(f"IDX file {path} is truncated ({len(body)} data bytes for shape {dims}): "
                        f"replace it with an intact copy")
    return np.frombuffer(body, dtype=dtype).reshape(dims)


def find_idx(root: Path, base: str) -> Path:
    """root/base.gz or root/base; UserError naming the missing file otherwise."""
    for p in (root / f"{base}.gz", root / base):
        if p.is_file():
            return p
    raise UserError(f"IDX file {root / base}.gz not found (nor without .gz): set data.root to the folder holding the "
                    f"MNIST/Fashion-MNIST IDX files; `apt-get install dataset-fashion-mnist` puts Fashion-MNIST in "
                    f"{FASHION_MNIST_ROOT}")


def load_idx_domains(cfg: DataConfig) -> DomainSet:
    """Rotated or appearance domains from the IDX files in cfg.root (empty root = Debian's Fashion-MNIST folder)."""
    if cfg.family not in FAMILIES:
        raise UserError(f"unknown data.family {cfg.family!r} for dataset idx: use one of {', '.join(FAMILIES)}")
    names = FAMILIES[cfg.family]
    wanted = select_domains(cfg, names, f"idx/{cfg.family}")
    root = Path(cfg.root or FASHION_MNIST_ROOT)
    paths = [find_idx(root, b) for b in FILES]
    tr_x, tr_y, te_x, te_y = (read_idx(p) for p in paths)
    for imgs, labs, p in ((tr_x, tr_y, paths[0]), (te_x, te_y, paths[2])):
        if imgs.ndim != 3 or labs.ndim != 1 or len(imgs) != len(labs) or imgs.shape[1:] != tr_x.shape[1:]:
            raise UserError(f"IDX images {p} ({imgs.shape}) do not match their labels ({labs.shape}) or each other: "
                            f"use matching MNIST-format image/label files")
    if tr_x.shape[1] != tr_x.shape[2]:
        raise UserError(f"IDX images in {root} are {tr_x.shape[1]}x{tr_x.shape[2]}: only square images are supported")
    images = np.concatenate([tr_x, te_x])
    labels = np.concatenate([tr_y, te_y]).astype(np.int64)
    chunks = domain_rows(cfg, labels, len(names), cfg.per_domain or DEFAULT_PER_DOMAIN)
    scale = 255.0 if images.dtype == np.uint8 else 1.0
    domains = []
    for name in wanted:
        i = names.index(name)
        rows, ids = chunks[i]
        x = torch.as_tensor(images[rows].astype(np.float32) / scale).unsqueeze(1).clamp(0.0, 1.0)
        if cfg.family == "rotated":
            x = rotate(x, ROTATED[name])
        else:
            x = appearance(x, name, seeding.rng(cfg.split_seed, 1000 + i))
        domains.append(split_domain(name, x, labels[rows], ids, cfg.val_fraction, [cfg.split_seed, i]))
    return DomainSet(f"{root.name}-{cfg.family}", domains, int(labels.max()) + 1,
                     1 if cfg.family == "rotated" else 3, int(images.shape[1]))


def load(cfg: DataConfig) -> DomainSet:
    """The data set "idx" (registered in pyproject.toml; ``domain_names`` as digits')."""
    not_digits_dg(cfg)
    return load_idx_domains(cfg)
