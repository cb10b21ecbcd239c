"""Image folders ``root/<domain>/<class>/<image>`` (PACS, VLCS, Office-Home, Digits-DG), read with PIL.

Classes are the sorted union of class folder names over all domains found, so a label means the same class in
every domain. Image ids number all images of all domains in sorted (domain, class, file) order.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import DataConfig, DomainSet, select_domains, split_domain
from fdg_audit import seeding
from fdg_audit.errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
MAX_PIXELS = 50_000_000     # width x height read before decoding: larger files are refused, not decoded


def _subdirs(p: Path) -> list[str]:
    return sorted(c.name for c in p.iterdir() if c.is_dir() and not c.name.startswith("."))


def scan(root: Path) -> tuple[list[str], list[str], dict[str, list[tuple[Path, str]]]]:
    """(domain names, class names, {domain: [(file, class name), ...]}) of an image tree."""
    if not root.is_dir():
        raise UserError(f"data folder {root} not found: "
                        f"set data.root to the folder that holds one sub-folder per domain")
    try:
        return _scan(root)
    except OSError as e:
        raise UserError(f"data folder {root}: cannot read {e.filename or root} ({e.strerror or e}): set data.root to "
                        "a folder you can read that holds <domain>/<class>/<image> sub-folders") from None


def _scan(root: Path) -> tuple[list[str], list[str], dict[str, list[tuple[Path, str]]]]:
    domains = _subdirs(root)
    if not domains:
        raise UserError(f"data folder {root} has no domain sub-folders: set data.root to the folder that holds "
                        f"<domain>/<class>/<image> sub-folders")
    files = {}
    for d in domains:
        files[d] = [(f, c) for c in _subdirs(root / d) for f in sorted((root / d / c).iterdir())
                    if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS]
    classes = sorted({c for d in domains for c in _subdirs(root / d)})
    return domains, classes, files


def read_image(path: Path, size: int) -> np.ndarray:
    """One image as (size, size, 3) uint8 RGB."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            if im.width * im.height > MAX_PIXELS:
                raise UserError(f"image {path} claims too many pixels ({im.width}x{im.height}, more than this reader's "
                                f"bound of {MAX_PIXELS:,}): remove or downscale that file")
            return np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.uint8)
    except Image.DecompressionBombError as e:
        raise UserError(f"image {path} claims too many pixels ({e}): remove or downscale that file") from None
    except (OSError, ValueError) as e:
        raise UserError(f"image {path} could not be read ({e}): remove or replace that file") from None


def load_folder_domains(cfg: DataConfig) -> DomainSet:
    """The DomainSet of the image tree at cfg.root, resized to cfg.image_size squares."""
    if not cfg.root:
        raise UserError("data.root is empty for dataset folder: "
                        "set data.root to the folder that holds one sub-folder per domain")
    root = Path(cfg.root).expanduser()
    found, classes, files = scan(root)
    wanted = select_domains(cfg, found, str(root))
    label = {c: i for i, c in enumerate(classes)}
    start = np.cumsum([0] + [len(files[d]) for d in found])
    domains = []
    for name in wanted:
        i = found.index(name)
        entries = files[name]
        if not entries:
            raise UserError(f"domain folder {root / name} has no images ({', '.join(IMAGE_EXTENSIONS)}) in class "
                            f"sub-folders: add <class>/<image> files there or drop it from data.domains")
        pick = seeding.rng(cfg.split_seed, i).permutation(len(entries))
        if cfg.per_domain:
            pick = np.sort(pick[:cfg.per_domain])
        else:
            pick = np.arange(len(entries))
        pixels = np.stack([read_image(entries[j][0], cfg.image_size) for j in pick])
        x = torch.as_tensor(pixels).permute(0, 3, 1, 2).float().div(255.0).contiguous()
        y = np.array([label[entries[j][1]] for j in pick], dtype=np.int64)
        domains.append(split_domain(name, x, y, start[i] + pick, cfg.val_fraction, [cfg.split_seed, 1000 + i]))
    return DomainSet(root.name, domains, len(classes), 3, cfg.image_size)


def domain_names(cfg: DataConfig) -> list[str] | None:
    """The domain folders under cfg.root (data set registry: fdg_audit/data/registry.py)."""
    return scan(Path(cfg.root).expanduser())[0] if cfg.root else None


load = load_folder_domains   # the data set "folder" (registered in pyproject.toml)
