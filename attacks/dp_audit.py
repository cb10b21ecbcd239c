"""DP audits (one-run, Steinke, Nasr, Jagielski 2023) of the three mechanisms: the Gaussian mechanism on amplitude
banks (``dp_audit_artifact``), client-level DP on model updates (``dp_audit_client``) and example-level DP-SGD
(``dp_audit_dpsgd``). All three produce ``Audit`` outputs: one score per canary, scored by the shared scorer into
eps_lb_one_run / eps_lb_cp next to the accountant's eps_theory (fdg_audit/privacy/audit.py).

``dp_audit_client`` (canary clients, ``[privacy.audit] update_canaries = m``; fdg_audit/privacy/client_dp.py): the
server knows what it sent each client, so it reads each update u_t = upload_t - received_t of an audited client;
canary j's score is sum_t <u_t, u_j> over the client's releases (the likelihood-ratio statistic of the Gaussian
mechanism for a canary of norm C in every release). eps_theory: the client_dp accountant's epsilon on the last
release. Central mode (variant ``aggregate``): its epsilon covers the aggregate, not the individual uploads, so
the audit reads what that epsilon protects, the global model the server broadcasts: u_t = b_{t+1} - b_t, the
uniform mean of round t's uploads minus the model they started from (canaries C / K under noise sigma C / K; the
other clients' clipped updates are fixed data, nearly orthogonal to the random canary directions). The last
round's aggregate is never broadcast, so R rounds give R - 1 audited releases against an accountant's epsilon
for all of them (a valid, slightly loose comparison). Audit one client per central-mode run: every audited
client's canaries share the public directions and land in the same aggregate, where they blur each other.
Controls (the filter itself on a synthetic 2,000-coordinate update, 128 canaries): no noise: eps_lb >= 1;
canaries never inserted: eps_lb = 0; noise multiplier 1 over 3 releases: eps_lb <= the accountant's epsilon.

``dp_audit_dpsgd`` (white-box Dirac gradient canaries, ``[privacy.audit] gradient_canaries = m``;
fdg_audit/privacy/dpsgd.py): canary j is a per-example gradient C at a public parameter coordinate, a member with
probability 1/2, Poisson-sampled into the steps like an example. The server knows what it sent, so canary j's
score is how far the client's uploads moved its coordinate against the canary, sum_t (received_t - upload_t)[j].
eps_theory: the example-level composition of the mechanisms on the uploaded weights (dp_sgd, and client_dp at
sigma / 2). Controls (Opacus DP-SGD on a 2,004-parameter linear model, 40 canaries, 20 steps): no noise: eps_lb >= 1;
no canary inserted: eps_lb = 0; noise multiplier 1: eps_lb <= the accountant's epsilon.

The artifact audit (table row D3, attacks.md §4.2, Audit-B):

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

from fdg_audit.api.attack import Attack, AttackParams, Audit, Control, Skipped
from fdg_audit.privacy import ArtifactMechanism, ClientDP, epsilon, new_accountant
from fdg_audit.privacy.artifacts import GaussianRows
from fdg_audit.privacy.audit import one_run_bound
from fdg_audit.privacy.canaries import canary_images
from fdg_audit.privacy.client_dp import UPDATE_KINDS, ClientDPFilter, canary_coins, update_canaries

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


# ------------------------------------------------------------------------------------------- model updates

def _updates(view, victim: str, kinds, mechanism: str, canaries: str) -> list:
    """(message, {name: update}) for each upload of ``kinds`` by ``victim`` whose ``mechanism`` event records
    ``canaries`` (only releases that carried canaries are audited), the update measured from what the victim last
    received under that name (or ``<victim>/<name>``), zero where nothing was received (as the filter does)."""
    received, out = {}, []
    for m in sorted(view.messages(), key=lambda m: m.env.seq):
        if m.receiver == victim:
            received.update(m.payload.arrays)
        elif m.sender == victim and m.kind in kinds and \
                any(e.get("mechanism") == mechanism and e.get(canaries) for e in m.env.filters):
            upd = {}
            for k, v in m.payload.arrays.items():
                if v.is_floating_point():
                    ref = received.get(k, received.get(f"{victim}/{k}"))
                    upd[k] = v.double() - (0 if ref is None else ref.double())
            out.append((m, upd))
    return out


def _example_epsilon(events: list, delta: float) -> float:
    """The example-level epsilon of the mechanisms on one upload (dp_sgd; client_dp at sigma / 2); inf if none."""
    hist, acc = [], "prv"
    for ev in events:
        if ev.get("mechanism") in ("dp_sgd", "client_dp"):
            hist += [tuple(h) for h in ev.get("example_history", ev["history"])]
            acc = ev["accountant"]
    if not hist:
        return math.inf
    a = new_accountant(acc)
    a.history = hist
    return epsilon(a, delta)


def _aggregate_steps(view, victim: str, ups: list) -> list:
    """Central mode: the change of the global model the server broadcasts after each audited release,
    b_{t+1} - b_t over the upload's float arrays (in the upload's order, as the filter concatenates them). The
    uniform mean of round t's uploads is b_{t+1}, so the change holds the canaries at C / K under noise sigma C / K."""
    casts = {m.round: m.payload.arrays for m in view.messages()
             if m.sender == "server" and m.receiver == victim and m.kind == "weights"}
    out = []
    for m, upd in ups:
        now, nxt = casts.get(m.round), casts.get(m.round + 1)
        if now is not None and nxt is not None and all(k in now and k in nxt for k in upd):
            out.append(torch.cat([(nxt[k].double() - now[k].double()).flatten() for k in upd]))
    return out


@dataclass
class CanaryParams(AttackParams):
    canaries: int = 256           # must equal [privacy.audit] update_canaries / gradient_canaries of the audited run
    canary_seed: int = 0          # must equal [privacy.audit] seed
    delta: float = 1e-5           # used only where the uploads carry no accounting event


class UpdateAudit(Attack):
    name = "dp_audit_client"
    consumes = tuple(UPDATE_KINDS)
    adversary = "server"
    aux = ()
    target = "dp_audit"
    Params = CanaryParams

    def run(self, view, aux):
        p, outs = self.p, []
        for victim in view.clients:
            ups = _updates(view, victim, UPDATE_KINDS, "client_dp", "update_canaries")
            if not ups:
                continue
            m, _ = ups[-1]
            ev = next(e for e in m.env.filters if e.get("mechanism") == "client_dp")
            central = ev["mode"] == "central"
            flats = _aggregate_steps(view, victim, ups) if central else \
                [torch.cat([v.flatten() for v in upd.values()]) for _, upd in ups]
            if not flats:
                outs.append(Skipped(victim, m.kind, m.round, "central mode: no broadcast after the audited releases "
                                    "(the aggregate of the last round is never sent; run at least 2 rounds)"))
                continue
            scores = sum((update_canaries(p.canaries, len(f), p.canary_seed) @ f).numpy() for f in flats)
            outs.append(Audit(victim, m.kind, m.round, scores, float(ev["delta"]), float(ev["epsilon"]),
                              truth="update_canaries", variant="aggregate" if central else "sum"))
        return outs

    @staticmethod
    def _synthetic(m: int, sigma: float, insert: bool, releases: int = 1):
        from fdg_audit.privacy import AuditConfig
        c = ClientDP(clip=1.0, noise_multiplier=sigma, clients=3)
        f = ClientDPFilter(c, 1e-5, "rdp", AuditConfig(update_canaries=m if insert else 0, seed=0))
        g = torch.Generator().manual_seed(0)
        scores, ev = np.zeros(m), None
        for t in range(releases):
            ref = torch.randn(2000, generator=g, dtype=torch.float64)
            upd = torch.randn(2000, generator=g, dtype=torch.float64)
            out, _, ev = f("weights", {"w": ref + upd}, {}, {"run": "control", "round": t + 1, "sender": "c",
                                                           "received": {"w": ref}})
            scores += (update_canaries(m, 2000, 0) @ (out["w"] - ref)).numpy()
        return scores, canary_coins("control", "c", m, 0), ev["epsilon"]

    def control(self):
        m = 128
        pos = one_run_bound(*self._synthetic(m, 0.0, True)[:2], 1e-5)
        neg = one_run_bound(*self._synthetic(m, 0.0, False)[:2], 1e-5)
        s, member, eps = self._synthetic(m, 1.0, True, releases=3)
        return [Control("canary clients, no noise", "eps_lb_one_run", pos, 1.0),
                Control("no canary inserted", "eps_lb_one_run", neg, 0.0, positive=False),
                Control("noise multiplier 1, 3 releases: eps_lb <= accountant eps", "eps_lb_one_run",
                        one_run_bound(s, member, 1e-5), eps, positive=False)]


# ------------------------------------------------------------------------------------------- DP-SGD

class DPSGDAudit(Attack):
    name = "dp_audit_dpsgd"
    consumes = ("weights",)
    adversary = "server"
    aux = ()
    target = "dp_audit"
    Params = CanaryParams

    def run(self, view, aux):
        from fdg_audit.privacy.dpsgd import gradient_canary_coordinates
        p, outs = self.p, []
        for victim in view.clients:
            ups = _updates(view, victim, ("weights",), "dp_sgd", "gradient_canaries")
            if not ups:
                continue
            names = [k for k, _ in view.new_model().named_parameters()]   # trainable parameters, in order
            scores = np.zeros(p.canaries)
            for _, upd in ups:
                if not all(k in upd for k in names):
                    break
                flat = torch.cat([upd[k].flatten() for k in names])
                scores -= flat[torch.as_tensor(gradient_canary_coordinates(p.canaries, len(flat), p.canary_seed))
                               ].numpy()       # descent moves a canary's coordinate against its gradient (+C)
            else:
                m = ups[-1][0]
                ev = next(e for e in m.env.filters if e.get("mechanism") == "dp_sgd")
                outs.append(Audit(victim, "weights", m.round, scores, float(ev["delta"]),
                                  _example_epsilon(m.env.filters, p.delta), truth="gradient_canaries",
                                  variant="dirac"))
                continue
            outs.append(Skipped(victim, "weights", ups[-1][0].round, "the uploads are not full parameter states"))
        return outs

    @staticmethod
    def _synthetic(m: int, sigma: float, insert: bool, seed: int = 0):
        """DP-SGD (Opacus) on a linear model, 100 random examples, m Dirac canaries, 20 steps; the scores."""
        from types import SimpleNamespace

        from fdg_audit.params import TrainParams
        from fdg_audit.privacy import AuditConfig, PrivacyConfig
        from fdg_audit.privacy.dpsgd import dp_fit
        g = torch.Generator().manual_seed(seed)
        x, y = torch.rand(100, 500, generator=g) - 0.5, torch.randint(0, 4, (100,), generator=g)
        net = torch.nn.Linear(500, 4)
        cfg = PrivacyConfig(dp_sgd=True, noise_multiplier=sigma, accountant="rdp",
                            audit=AuditConfig(gradient_canaries=m if insert else 0, seed=seed))
        client = SimpleNamespace(privacy=cfg, params=TrainParams(lr=0.1, momentum=0.0, weight_decay=0.0, batch_size=25),
                                 train=SimpleNamespace(x=x, y=y), dp_state=None, gen=g, events=[], id="c",
                                 _seq=np.random.SeedSequence(seed), _party=1, record_truth=lambda *a, **k: None)
        before = torch.cat([q.detach().flatten() for q in net.parameters()])
        dp_fit(client, net, steps=20)
        after = torch.cat([q.detach().flatten() for q in net.parameters()])
        from fdg_audit.privacy.dpsgd import gradient_canary_coordinates
        coords = gradient_canary_coordinates(m, len(before), seed)
        member = client.dp_state.canaries[1] if insert else np.random.default_rng(seed).random(m) < 0.5
        return (before - after)[coords].numpy(), member, client.events[-1]["epsilon"]

    def control(self):
        m = 40
        pos = one_run_bound(*self._synthetic(m, 0.0, True)[:2], 1e-5)
        neg = one_run_bound(*self._synthetic(m, 0.0, False)[:2], 1e-5)
        s, member, eps = self._synthetic(m, 1.0, True)
        return [Control("Dirac canaries, no noise", "eps_lb_one_run", pos, 1.0),
                Control("no canary inserted", "eps_lb_one_run", neg, 0.0, positive=False),
                Control("noise multiplier 1: eps_lb <= accountant eps", "eps_lb_one_run",
                        one_run_bound(s, member, 1e-5), eps, positive=False)]
