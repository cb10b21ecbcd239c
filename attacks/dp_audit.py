"""DP audit of the Gaussian mechanism on amplitude banks (attacks.md §4.2, Audit-B; table row D3).

Setting: a scenario with ``[privacy.audit] canaries = m`` appends m canary slots to every audited client's
training split (fdg_audit/privacy/canaries.py): slot j holds public canary image j with probability 1/2, otherwise
an all-black null record (zero amplitude: the zero-out neighbour the mechanism is accounted under). FedDG's bank
carries one amplitude row per training image, canaries included; ``[privacy.artifacts] amplitude_bank`` clips
and noises those rows at the client. The auditor (the server, which receives every upload) regenerates the
canaries from the public seed, scores every slot, and the shared scorer turns the scores and the truth
(``canaries``: which slots hold their canary) into ε lower bounds (fdg_audit/privacy/audit.py: one-run and
Clopper–Pearson, 95 % confidence), reported next to the accountant's ε from the upload's envelope.

Statistics (two outputs, ``variant``):
* ``max`` (the spec's statistic; what any holder of the bank can compute): the canary's fingerprint is its
  amplitude spectrum with the DC term removed (canary spectra are then exactly orthogonal to each other), and
  its score is the best cosine between that fingerprint and any bank row (DC removed). It does not need to know
  where the canary sits in the bank.
* ``slot`` (the white-box auditor who knows that the slots are the bank's last m rows, true when the bank holds the
  whole training split in order, as FedDG's default ``bank_fraction = 1``, and ``out = "null"``): the projection of
  slot j's row on canary j's full (DC included) amplitude direction, the likelihood-ratio statistic of the
  Gaussian mechanism (canary row vs zero row), i.e. the tightest test this mechanism admits.
Either statistic gives a valid bound; a wrong assumption only weakens it.

Controls (synthetic bank: 100 smooth random images plus 64 canary slots, through the same filter class):
positive, no noise: the ``max`` statistic must certify ε_lb >= 1; negative, no canary ever inserted (coins drawn,
slots left null): ε_lb must be 0; negative, noise multiplier 1: ε_lb(slot) must not exceed the accountant's ε.
Baseline: random guessing certifies ε_lb = 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.attack import Attack, AttackParams, Audit, Control, Skipped
from fdg_audit.privacy import ArtifactMechanism
from fdg_audit.privacy.artifacts import GaussianRows
from fdg_audit.privacy.audit import one_run_bound
from fdg_audit.privacy.canaries import canary_images

KIND = "amplitude_bank"


@dataclass
class Params(AttackParams):
    canaries: int = 64            # must equal [privacy.audit] canaries of the audited run
    canary_seed: int = 0          # must equal [privacy.audit] seed
    delta: float = 1e-5           # used only where the bank carries no accounting event (no mechanism)


def _no_dc(a: torch.Tensor) -> torch.Tensor:
    a = a.clone()
    a[..., 0, 0] = 0
    return a.flatten(1)


def max_scores(bank: torch.Tensor, canary_amp: torch.Tensor) -> np.ndarray:
    """Per canary: the best cosine between its DC-free spectrum and any DC-free bank row."""
    r = F.normalize(_no_dc(bank.double()), dim=1)
    u = F.normalize(_no_dc(canary_amp.double()), dim=1)
    return (r @ u.T).max(0).values.numpy()


def slot_scores(bank: torch.Tensor, canary_amp: torch.Tensor) -> np.ndarray:
    """Per canary j: the projection of the bank's row N - m + j on canary j's full amplitude direction."""
    m = len(canary_amp)
    rows = bank[len(bank) - m:].double().flatten(1)
    return (rows * F.normalize(canary_amp.double().flatten(1), dim=1)).sum(1).numpy()


class ArtifactAudit(Attack):
    name = "dp_audit_artifact"
    consumes = (KIND,)
    adversary = "server"
    aux = ()
    target = "dp_audit"
    Params = Params

    def run(self, view, aux):
        p = self.p
        c, s, _ = view.shape
        amp = torch.fft.fft2(canary_images(p.canaries, c, s, p.canary_seed).double()).abs()
        outs = []
        for m in view.messages(kind=KIND, receiver=view.me):
            if m.sender == "server" or not any(a["name"] == "amp" for a in m.env.arrays):
                continue
            bank = m.payload.arrays["amp"]
            if tuple(bank.shape[1:]) != tuple(amp.shape[1:]) or len(bank) < p.canaries:
                outs.append(Skipped(m.sender, KIND, m.round, f"bank rows {tuple(bank.shape)} are not full spectra "
                                    f"of the {p.canaries} canary slots (bank_content = \"window\"?)"))
                continue
            ev = next((e for e in m.env.filters if e.get("mechanism") == "gaussian_rows"), None)
            eps, delta = (float(ev["epsilon"]), float(ev["delta"])) if ev else (math.inf, p.delta)
            outs.append(Audit(m.sender, KIND, m.round, max_scores(bank, amp), delta, eps, variant="max"))
            outs.append(Audit(m.sender, KIND, m.round, slot_scores(bank, amp), delta, eps, variant="slot"))
        return outs

    @staticmethod
    def _synthetic(m: int, insert: bool, sigma: float, seed: int = 0):
        """A filtered synthetic bank (100 smooth random images + m canary slots) and the slots' truth."""
        g = torch.Generator().manual_seed(seed)
        x = F.avg_pool2d(torch.rand(100, 1, 28, 28, generator=g), 5, 1, 2)
        member = torch.rand(m, generator=g) < 0.5
        can = canary_images(m, 1, 28, seed) * (member & insert).view(-1, 1, 1, 1)
        bank = torch.fft.fft2(torch.cat([x, can]).double()).abs()
        f = GaussianRows(KIND, ArtifactMechanism(clip=100.0, noise_multiplier=sigma), 1e-5, "rdp")
        out, _, ev = f(KIND, {"amp": bank}, {}, {"run": "control", "round": 0, "sender": "c"})
        amp = torch.fft.fft2(canary_images(m, 1, 28, seed).double()).abs()
        return out["amp"], amp, member.numpy(), ev["epsilon"]

    def control(self):
        m = 64
        bank, amp, member, _ = self._synthetic(m, True, 0.0)
        pos = one_run_bound(max_scores(bank, amp), member, 1e-5)
        bank, amp, member, _ = self._synthetic(m, False, 0.0)
        neg = one_run_bound(max_scores(bank, amp), member, 1e-5)
        bank, amp, member, eps = self._synthetic(m, True, 1.0)
        noisy = one_run_bound(slot_scores(bank, amp), member, 1e-5)
        return [Control("canaries in a clean bank (max statistic)", "eps_lb_one_run", pos, 1.0),
                Control("no canary inserted", "eps_lb_one_run", neg, 0.0, positive=False),
                Control("noise multiplier 1: eps_lb <= accountant eps", "eps_lb_one_run", noisy, eps, positive=False)]
