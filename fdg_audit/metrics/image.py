"""Reconstruction metrics (docs/attacks.md §1). Torch in, torch out, on the inputs' device.

Images are (B, C, H, W) in [0, 1]; every per-image metric returns a tensor of shape (B,).
Nothing here loops over images or shifts in Python.
"""

import numpy as np
import torch

PSNR_CAP_DB = 60.0   # PSNR at or above this (MSE <= 1e-6: exact to 8-bit precision, whose limit is 58.9 dB) is this


def mse(x, y):
    """Mean squared error per image over channels and pixels, shape (B,)."""
    return (x - y).pow(2).flatten(1).mean(1)


def _psnr_from_mse(m, data_range):
    floor = data_range**2 * 10 ** (-PSNR_CAP_DB / 10)  # MSE below this would exceed the cap
    return 10 * torch.log10(data_range**2 / m.clamp_min(floor))


def psnr(x, y, data_range=1.0):
    """PSNR = 10·log10(data_range² / MSE) per image, shape (B,).

    Capped at PSNR_CAP_DB (60 dB, past the 8-bit limit of 58.9 dB) so identical images give 60 instead of inf,
    batch means stay finite and a few exact images cannot dominate a mean.
    """
    return _psnr_from_mse(mse(x, y), data_range)


def _best_alignment(x, y):
    """Circular shift (si, sj) and inversion flag maximising the correlation of the moved x with y.

    The moved image is x_f(n - s), where x_f is x or its point inversion x(-n mod N). Because the
    sum of squares does not change under these moves, max correlation == min MSE:
    MSE(s) = mean(x²) + mean(y²) - 2·corr(s)/(C·H·W). corr comes from one FFT pair:
    sum_n x(n-s)·y(n) = ifft(Y·conj(X)) and sum_n x(s-n)·y(n) = ifft(Y·X), summed over channels.
    """
    H, W = x.shape[-2:]
    X, Y = torch.fft.fft2(x), torch.fft.fft2(y)
    plain = torch.fft.ifft2(Y * X.conj()).real.sum(1)  # (B, H, W)
    inv = torch.fft.ifft2(Y * X).real.sum(1)
    best = torch.stack([plain, inv], 1).flatten(1).argmax(1)  # (B,) over 2·H·W candidates
    return best // (H * W), (best % (H * W)) // W, best % W  # flip, si, sj


def aligned(x, y):
    """x moved by the circular shift and/or point inversion that best matches y, shape like x.

    These are the trivial ambiguities of Fourier-magnitude data, so grids should show this image.
    """
    B, C, H, W = x.shape
    flip, si, sj = _best_alignment(x, y)
    x_inv = torch.roll(torch.flip(x, (-2, -1)), (1, 1), (-2, -1))  # x(-n mod N)
    xf = torch.where(flip.bool().view(B, 1, 1, 1), x_inv, x)
    dev = x.device
    rows = (torch.arange(H, device=dev) - si[:, None]) % H  # (B, H): out[i] = xf[i - si]
    cols = (torch.arange(W, device=dev) - sj[:, None]) % W
    out = xf.gather(2, rows.view(B, 1, H, 1).expand(B, C, H, W))
    return out.gather(3, cols.view(B, 1, 1, W).expand(B, C, H, W))


def aligned_psnr(x, y, data_range=1.0, return_aligned=False):
    """PSNR of x after the best circular shift and point inversion (see `aligned`), shape (B,).

    The alignment is searched with FFTs; the reported PSNR is recomputed directly on the aligned
    image, so an exact shifted/inverted copy reaches the cap. Returns (psnr, x_aligned) if asked.
    """
    xa = aligned(x, y)
    p = psnr(xa, y, data_range)
    return (p, xa) if return_aligned else p


def aligned_mse(x, y, chunk=4096):
    """Pairwise MSE after the best circular shift and point inversion of each x onto each y, shape (len(x), len(y)).

    The same alignment rule as `aligned` (max correlation == min MSE), for every pair at once from one FFT of each
    set: MSE = mean(x²) + mean(y²) - 2·max_corr/(C·H·W), clamped at 0 against rounding. Pairs are processed
    ``chunk`` at a time so the (pairs, H, W) correlation maps stay small."""
    n = x[0].numel()
    X, Y = torch.fft.fft2(x), torch.fft.fft2(y)
    sx, sy = x.pow(2).flatten(1).sum(1), y.pow(2).flatten(1).sum(1)
    i, j = torch.meshgrid(torch.arange(len(x), device=x.device), torch.arange(len(y), device=x.device), indexing="ij")
    i, j = i.flatten(), j.flatten()
    best = torch.empty(len(i), device=x.device, dtype=x.dtype)
    for a in range(0, len(i), chunk):
        Xi, Yj = X[i[a:a + chunk]], Y[j[a:a + chunk]]
        plain = torch.fft.ifft2(Yj * Xi.conj()).real.sum(1).flatten(1).amax(1)
        inv = torch.fft.ifft2(Yj * Xi).real.sum(1).flatten(1).amax(1)
        best[a:a + chunk] = torch.maximum(plain, inv)
    return ((sx[i] + sy[j] - 2 * best) / n).clamp_min(0).view(len(x), len(y))


def standardized(x, eps=1e-6):
    """Each image's channels at zero mean and unit variance over their pixels (a constant channel becomes 0), shape
    like x: what is left once brightness, contrast and palette are taken out."""
    m = x.mean((-2, -1), keepdim=True)
    return (x - m) / x.std((-2, -1), keepdim=True).clamp_min(eps)


def reidentified(rec, truth, distractors, aligned_match=True):
    """Re-identification hits, shape (B,) bool: reconstruction ``rec[b]`` is nearer to its true image ``truth[b]``
    than to every one of its ``distractors[b]`` (B, D, C, H, W): does the reconstruction pick the victim's image out
    of a candidate set? Nearer: MSE between ``standardized`` images (each channel at zero mean and unit variance, so
    a dimmer, low-contrast or recoloured copy of the right image counts and a palette alone does not), after the
    best circular shift and point inversion unless ``aligned_match`` is False. A tie is a miss, so an image equally
    far from every candidate (e.g. blank) never scores; chance is 1/(1 + D)."""
    B, D = distractors.shape[:2]
    cand = standardized(torch.cat([truth[:, None], distractors], 1).flatten(0, 1))   # (B (1 + D), C, H, W)
    r = standardized(rec)[:, None].expand(B, D + 1, *rec.shape[1:]).reshape(cand.shape)
    d = (mse(aligned(r, cand), cand) if aligned_match else mse(r, cand)).view(B, D + 1)
    flat = rec.flatten(2).std(2).amax(1) <= 1e-6          # a constant image is equally far from every candidate
    return ~flat & (d[:, 0] < d[:, 1:].amin(1) if D else torch.ones(B, dtype=torch.bool, device=rec.device))


LEGIBLE_CORR = 0.6   # aligned correlation with the true image at or above which a reconstruction is legible


def aligned_corr(rec, truth):
    """Pearson correlation of each image with its true image after the best circular shift and point inversion,
    per channel, averaged over channels, shape (B,) in [-1, 1] (a constant channel counts 0)."""
    a, b = standardized(rec), standardized(truth)
    a = aligned(a, b)
    n = a[0, 0].numel()
    return ((a * b).flatten(2).sum(2) / max(n - 1, 1)).clamp(-1, 1).mean(1)


def legible(rec, truth, threshold=LEGIBLE_CORR):
    """Legibility, shape (B,) bool: the reconstruction's aligned correlation with its true image (``aligned_corr``)
    is at least ``threshold``, whether or not it is re-identified (a clear "1" can be as near another "1").
    Textured noise with the true image's spectrum, which can win re-identification by a hair, correlates with its
    true image at 0.07-0.55; reconstructions a person reads as the image at 0.67-1.0 (tests/test_legible.py: the
    labelled check set and the rule's agreement with it)."""
    return aligned_corr(rec, truth) >= threshold


def ssim(x, y, data_range=1.0, win_size=11, sigma=1.5, k1=0.01, k2=0.03):
    """Gaussian-window SSIM (Wang et al. 2004) per image, shape (B,): ``pytorch_msssim.ssim``.

    11×11 Gaussian window, σ = 1.5, K1 = 0.01, K2 = 0.03, population (weighted, not sample) variances.
    'valid' filtering: only windows fully inside the image are scored (as Wang's MATLAB code), so
    H and W must be >= win_size (pytorch_msssim would silently skip the smoothing). The SSIM map is averaged
    over positions, then over channels. This is plain SSIM, not breaching's CW-SSIM.
    """
    from pytorch_msssim import ssim as _ssim
    if min(x.shape[-2:]) < win_size:
        raise ValueError(f"ssim needs H, W >= win_size={win_size}, got {x.shape[-2]}x{x.shape[-1]}")
    return _ssim(x, y, data_range=data_range, size_average=False, win_size=win_size, win_sigma=sigma, K=(k1, k2))


def success_rate(psnr_values, threshold=25.0):
    """Fraction of images with PSNR >= threshold (fix the threshold in advance), as a float."""
    return float((torch.as_tensor(psnr_values) >= threshold).float().mean())


def match_batch(rec, truth, cost=None):
    """Hungarian matching: returns perm (LongTensor, len(truth)) so that rec[perm[i]] matches truth[i].

    Cost is the pairwise per-image MSE unless `cost` (shape len(truth) × len(rec), e.g. LPIPS)
    is given. len(rec) may exceed len(truth); surplus reconstructions are left unmatched.
    """
    if cost is None:
        cost = torch.cdist(truth.flatten(1), rec.flatten(1)).pow(2) / truth[0].numel()
    from scipy.optimize import linear_sum_assignment   # here: scipy.optimize costs half a second at import
    _, cols = linear_sum_assignment(np.asarray(torch.as_tensor(cost).detach().cpu(), dtype=np.float64))
    return torch.as_tensor(cols, dtype=torch.long, device=rec.device)


def matched_psnr(rec, truth, data_range=1.0):
    """PSNR per ground-truth image after Hungarian matching on MSE, shape (len(truth),)."""
    return psnr(rec[match_batch(rec, truth)], truth, data_range)


def label_count_accuracy(pred_counts, true_counts):
    """1 - ½·Σ_c|ĉ_c - c_c| / Σ_c c_c over the last (class) axis; 1 = the label multisets agree.

    Returns a tensor over the leading axes (0-d for one count vector).
    """
    p, t = torch.as_tensor(pred_counts).double(), torch.as_tensor(true_counts).double()
    return 1 - 0.5 * (p - t).abs().sum(-1) / t.sum(-1)


__all__ = [
    "PSNR_CAP_DB", "mse", "psnr", "aligned", "aligned_psnr", "ssim", "success_rate",
    "match_batch", "matched_psnr", "label_count_accuracy", "aligned_mse", "reidentified", "aligned_corr",
    "legible", "LEGIBLE_CORR",
]
