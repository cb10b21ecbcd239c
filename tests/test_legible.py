"""The legibility rule (fdg_audit.metrics.image.legible) against what a person sees: a labelled check set of real
reconstructions (tests/data/legible_check.npz: amplitude-bank phase retrieval and update inversion from a recorded
run, 8-bit, each with its true image and its nearest distractor of the scorer's pool, labelled genuine / partial /
noise by looking at grids of truth | reconstruction | nearest distractor; see ``source`` for where each came from).

Re-identification alone (linkable) accepts textured noise that is nearer its true image than the nearest distractor
by a hair; legible must not."""
from pathlib import Path

import numpy as np
import torch

from fdg_audit import metrics as M

CHECK = Path(__file__).parent / "data" / "legible_check.npz"


def _load():
    z = np.load(CHECK)
    f = lambda k: torch.as_tensor(z[k], dtype=torch.float32) / 255  # noqa: E731
    return f("truth"), f("recon"), f("near"), z["label"], z["source"]


def test_legible_agrees_with_the_labels_and_rejects_noise_that_re_identification_accepts():
    x, r, near, label, _ = _load()
    hit = M.reidentified(r, x, near[:, None])          # the nearest distractor decides re-identification
    leg = M.legible(r, x).numpy()
    hit = hit.numpy()
    genuine, partial, noise = (label == "genuine"), (label == "partial"), (label == "noise")
    assert genuine.sum() >= 10 and noise.sum() >= 10 and (genuine | partial | noise).all()
    table = {k: (int(m.sum()), int(leg[m].sum()), int(hit[m].sum())) for k, m in
             (("genuine", genuine), ("partial", partial), ("noise", noise))}
    agree = (leg[genuine].sum() + (~leg[noise]).sum()) / (genuine.sum() + noise.sum())
    print(f"\nlegible vs labels (n, legible, re-identified): {table}; agreement on genuine + noise {agree:.3f}")
    assert leg[genuine].mean() >= 0.9            # what a person reads as the image is legible ...
    assert not leg[noise].any()                  # ... noise never is,
    assert hit[noise].any()                      # although re-identification accepts some of it
    assert agree >= 0.95


def test_the_check_set_is_what_it_says():
    """Truth, reconstruction and distractor are images in [0, 1] of one shape; the distractor is not the truth."""
    x, r, near, label, source = _load()
    assert x.shape == r.shape == near.shape and x.shape[1:] == (3, 28, 28)
    assert len(label) == len(source) == len(x)
    assert ((near - x).flatten(1).abs().amax(1) > 0).all()
