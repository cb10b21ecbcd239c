"""The Gaussian mechanism on shared artifacts, as a bus filter at the sender (docs/attacks.md §4.2, row D3).

For a kind named in ``[privacy.artifacts]`` (amplitude_bank, style_bank, prototypes, ...) every payload a *client*
sends is privatized before it is encoded: the float arrays are read as rows (dim 0, one row per image for a bank),
each row is clipped to L2 norm ``clip`` jointly over the arrays (row i of "mean" and of "std" together), and
N(0, (noise_multiplier * clip)^2) noise is added to every element. The server's relays of such artifacts are
post-processing of what the clients released and pass unchanged. Non-float arrays and scalars cannot be
noised: they must be named in ``passthrough`` (sent as they are, outside the guarantee) or the run stops.

Accounting. Neighbouring datasets differ in one image replaced by a null record whose row is zero
("zero-out", Kairouz et al. 2021; an all-black image has an all-zero amplitude spectrum). With ``rows = "image"``
(each row derived from one image) one release is then the Gaussian mechanism with sensitivity ``clip`` and
noise multiplier sigma; with ``rows = "aggregate"`` (a row mixes several images, e.g. class prototypes) one image
can move its row anywhere in the clip ball, sensitivity 2 * clip, accounted as noise multiplier sigma / 2. Each
release is one step of Opacus' accountant used stand-alone, ``step(noise_multiplier, sample_rate=1)``; the
accountant lives per (run, sender, kind) for the whole run. The event (mechanism, clip, sigma, releases, epsilon
at delta, the accountant's history) goes into the envelope's ``filters`` field.

Counts (``rows = "count"``, e.g. ``n_samples = { rows = "count", clip = 1.0, noise_multiplier = 5.0 }``): every
numeric scalar of the payload (a client's n_k) gets N(0, (noise_multiplier * clip)^2) and is sent rounded, at least 1
(post-processing). Sensitivity ``clip`` (1: adding or removing one example moves a count by 1); one Gaussian
release per payload, accounted as above. Without it a client's n_k is sent in the clear, outside every guarantee.

Randomness: a torch.Generator seeded from (run, sender, round, kind, how many such payloads this sender already
sent this round), so the noise is the same in both engines, independent of the method's own random streams
(a clean and a noised run share all other randomness), and differs for every release.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import seeding
from ..bus import Mod
from ..errors import UserError
from .accounting import epsilon, new_accountant

SALT = 0x6A7D


@dataclass
class ArtifactMechanism:
    """Per-row L2 clipping to ``clip`` (jointly over the payload's float arrays) + N(0, (noise_multiplier*clip)^2)."""
    clip: float = 1.0
    noise_multiplier: float = 1.0
    rows: str = "image"             # image: each row comes from one image | aggregate: a row mixes several
    passthrough: list = field(default_factory=list)   # non-float arrays / scalars sent unprotected (named)


def noise_generator(run: str, sender: str, rnd: int, kind: str, count: int) -> torch.Generator:
    return seeding.torch_gen(run, sender, rnd, kind, count, SALT)


def clip_rows(arrays: dict[str, torch.Tensor], clip: float) -> dict[str, torch.Tensor]:
    """Scale row i of every array by min(1, clip / ||row i over all arrays||)."""
    sq = sum(a.reshape(len(a), -1).double().pow(2).sum(1) for a in arrays.values())
    f = (clip / (sq.sqrt() + 1e-12)).clamp(max=1.0)
    return {k: (a.double() * f.to(a.device).view(-1, *([1] * (a.dim() - 1)))).to(a.dtype) for k, a in arrays.items()}


class GaussianRows(Mod):
    """The bus mod of one artifact kind (``Mod.__call__`` on every client payload of that kind)."""

    def __init__(self, kind: str, mech: ArtifactMechanism, delta: float, accountant: str):
        self.kind, self.m, self.delta, self.accountant = kind, mech, delta, accountant
        self.acc: dict = {}        # (run, sender) -> accountant
        self.sent: dict = {}       # (run, sender, round) -> payloads filtered so far

    def __call__(self, kind, arrays, scalars, where):
        sender, run = where["sender"], where["run"]
        if sender == "server":
            return arrays, scalars, None
        m = self.m
        if m.rows == "count":
            return self.count(kind, arrays, scalars, where)
        bad = [k for k in scalars if k not in m.passthrough]
        bad += [k for k, v in arrays.items() if not torch.as_tensor(v).is_floating_point() and k not in m.passthrough]
        if bad:
            raise UserError(f"privacy.artifacts.{kind}: {bad[0]!r} is not a float array and cannot be noised: add it "
                            f"to passthrough = [...] to send it unprotected, or drop the mechanism for {kind}")
        rows = {k: torch.as_tensor(v) for k, v in arrays.items() if k not in m.passthrough}
        if len({len(v) for v in rows.values()}) > 1:
            raise UserError(f"privacy.artifacts.{kind}: arrays {sorted(rows)} have different row counts "
                            f"{[len(v) for v in rows.values()]}: the per-row mechanism needs one row per record")
        g = self.generator(where, kind)
        out = dict(arrays)
        for k, v in clip_rows(rows, m.clip).items():
            z = torch.randn(v.shape, generator=g, dtype=torch.float64) * (m.noise_multiplier * m.clip)
            out[k] = (v.double() + z.to(v.device)).to(v.dtype)
        return out, scalars, self.account(run, sender, m.noise_multiplier / (2.0 if m.rows == "aggregate" else 1.0))

    def generator(self, where: dict, kind: str) -> torch.Generator:
        """The noise generator of this release: (run, sender, round, kind, payloads already filtered this round)."""
        key = (where["run"], where["sender"], where["round"])
        n = self.sent[key] = self.sent.get(key, -1) + 1
        return noise_generator(*key, kind, n)

    def count(self, kind, arrays, scalars, where):
        """Noised counts: every numeric scalar + N(0, (sigma * clip)^2), rounded, at least 1."""
        sender, run, m = where["sender"], where["run"], self.m
        bad = [k for k, v in scalars.items() if k not in m.passthrough and (isinstance(v, bool) or
                                                                            not isinstance(v, (int, float)))]
        if arrays or bad:
            raise UserError(f"privacy.artifacts.{kind}: rows = \"count\" noises numeric scalars only; "
                            f"{sorted(arrays) or bad} cannot be noised as a count")
        g = self.generator(where, kind)
        out = dict(scalars)
        for k in sorted(k for k in scalars if k not in m.passthrough):
            z = float(torch.randn((), generator=g, dtype=torch.float64)) * m.noise_multiplier * m.clip
            out[k] = max(1, int(round(scalars[k] + z)))
        return arrays, out, self.account(run, sender, m.noise_multiplier)

    def account(self, run: str, sender: str, sigma: float) -> dict:
        m = self.m
        acc = self.acc.setdefault((run, sender), new_accountant(self.accountant))
        acc.step(noise_multiplier=sigma, sample_rate=1.0)
        releases = sum(h[2] for h in acc.history)
        event = dict(mechanism="gaussian_rows", kind=self.kind, accountant=self.accountant,
                     noise_multiplier=m.noise_multiplier, clip=m.clip, rows=m.rows,
                     sensitivity=m.clip * (2 if m.rows == "aggregate" else 1), sample_rate=1.0, steps=releases,
                     delta=self.delta, epsilon=epsilon(acc, self.delta), history=[list(h) for h in acc.history],
                     passthrough=list(m.passthrough))
        return event
