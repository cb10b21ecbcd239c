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

The artifact audit (table row D3, docs/attacks.md §4.2):

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
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.api import records, seeding
from fdg_audit.api.attack import Attack, AttackParams, Audit, Control, Skipped
from fdg_audit.api.method import Payload, TrainParams
from fdg_audit.api.privacy import (UPDATE_KINDS, ArtifactMechanism, AuditConfig, ClientDP, ClientDPFilter,
                                   GaussianRows, PrivacyConfig, canary_coins, canary_images, dp_fit, epsilon,
                                   gradient_canary_coordinates, new_accountant, one_run_bound, update_canaries)

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


def audit_controls(synthetic, positive: str, noisy: str) -> list[Control]:
    """The three controls of an audit from ``synthetic(sigma, insert) -> (scores, canary truth, accountant eps)`` on
    data it builds: canaries without noise certify eps_lb >= 1 (``positive`` names the setting), no canary inserted
    certifies eps_lb = 0, noise multiplier 1 (``noisy``) certifies no more than the accountant's eps."""
    pos = one_run_bound(*synthetic(0.0, True)[:2], 1e-5)
    neg = one_run_bound(*synthetic(0.0, False)[:2], 1e-5)
    s, member, eps = synthetic(1.0, True)
    return [Control(positive, "eps_lb_one_run", pos, 1.0),
            Control("no canary inserted", "eps_lb_one_run", neg, 0.0, positive=False),
            Control(f"{noisy}: eps_lb <= accountant eps", "eps_lb_one_run", one_run_bound(s, member, 1e-5), eps,
                    positive=False)]


class ArtifactAudit(Attack):
    name = "dp_audit_artifact"
    consumes = (KIND,)
    adversary = "server"
    aux = ()
    outputs = {"max": "regenerates the canaries from the public seed; the best cosine of a canary's spectrum to any "
                      "bank row (DC removed): what any holder of the bank can compute",
               "slot": "white-box: regenerates the canaries from the public seed and knows they fill the bank's last "
                       "m rows (the whole training split, in order, with null records for absent canaries)"}
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
            for variant, scores in (("max", max_scores(bank, amp)), ("slot", slot_scores(bank, amp))):
                outs.append(Audit(m.sender, KIND, m.round, scores, delta, eps, variant=variant, independent=True))
        return outs

    @staticmethod
    def _synthetic(sigma: float, insert: bool, m: int = 64, seed: int = 0):
        """A filtered synthetic bank (100 smooth random images + m canary slots): its scores (the ``max`` statistic
        without noise, ``slot`` with), the slots' truth and the accountant's epsilon."""
        g = torch.Generator().manual_seed(seed)
        x = F.avg_pool2d(torch.rand(100, 1, 28, 28, generator=g), 5, 1, 2)
        member = torch.rand(m, generator=g) < 0.5
        can = canary_images(m, 1, 28, seed) * (member & insert).view(-1, 1, 1, 1)
        bank = torch.fft.fft2(torch.cat([x, can]).double()).abs()
        f = GaussianRows(KIND, ArtifactMechanism(clip=100.0, noise_multiplier=sigma), 1e-5, "rdp")
        out, _, ev = f(KIND, {"amp": bank}, {}, {"run": "control", "round": 0, "sender": "c"})
        amp = torch.fft.fft2(canary_images(m, 1, 28, seed).double()).abs()
        return (slot_scores if sigma else max_scores)(out["amp"], amp), member.numpy(), ev["epsilon"]

    def control(self):
        return audit_controls(self._synthetic, "canaries in a clean bank (max statistic)", "noise multiplier 1")


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


class _CanaryAudit(Attack):
    """An audit of the canaries in the uploads of each client: the releases of ``consumes`` whose ``mechanism`` event
    records ``flag`` (``_updates``), scored by ``audit``; its controls come from ``_synthetic`` (``audit_controls``)."""
    adversary = "server"
    aux = ()
    Params = CanaryParams
    mechanism = flag = ""
    controls = ("", "")           # (the positive control's setting, the noisy control's setting)

    def run(self, view, aux):
        ups = {v: _updates(view, v, self.consumes, self.mechanism, self.flag) for v in view.clients}
        return [self.audit(view, v, u) for v, u in ups.items() if u]

    def audit(self, view, victim: str, ups: list):
        raise NotImplementedError

    def control(self):
        return audit_controls(self._synthetic, *self.controls)


class UpdateAudit(_CanaryAudit):
    name = "dp_audit_client"
    consumes = tuple(UPDATE_KINDS)
    mechanism, flag = "client_dp", "update_canaries"
    controls = ("canary clients, no noise", "noise multiplier 1, 3 releases")
    outputs = {"sum": "the server knows what it sent each client: sum over the client's releases of each update's "
                      "inner product with the public canary directions",
               "aggregate": "central mode: the change of the broadcast global model (what the central epsilon "
                            "covers), one audited client per run"}

    def audit(self, view, victim, ups):
        m, _ = ups[-1]
        ev = next(e for e in m.env.filters if e.get("mechanism") == "client_dp")
        central = ev["mode"] == "central"
        flats = _aggregate_steps(view, victim, ups) if central else \
            [torch.cat([v.flatten() for v in upd.values()]) for _, upd in ups]
        if not flats:
            return Skipped(victim, m.kind, m.round, "central mode: no broadcast after the audited releases (the "
                           "aggregate of the last round is never sent; run at least 2 rounds)")
        scores = sum((update_canaries(self.p.canaries, len(f), self.p.canary_seed) @ f).numpy() for f in flats)
        return Audit(victim, m.kind, m.round, scores, float(ev["delta"]), float(ev["epsilon"]),
                     truth=records.UPDATE_CANARIES, variant="aggregate" if central else "sum")

    @staticmethod
    def _synthetic(sigma: float, insert: bool, m: int = 128):
        """The filter on a synthetic 2,000-coordinate update, 1 release without noise and 3 with: the canary
        scores, the coins and the accountant's epsilon."""
        c = ClientDP(clip=1.0, noise_multiplier=sigma, clients=3)
        f = ClientDPFilter(c, 1e-5, "rdp", AuditConfig(update_canaries=m if insert else 0, seed=0))
        g = torch.Generator().manual_seed(0)
        scores, ev = np.zeros(m), None
        for t in range(3 if sigma else 1):
            ref = torch.randn(2000, generator=g, dtype=torch.float64)
            upd = torch.randn(2000, generator=g, dtype=torch.float64)
            if hasattr(f, "request"):          # the bus's Mod hook: what the client received (older cores: "received")
                f.request("c", Payload(arrays={"w": ref}))
            out, _, ev = f("weights", {"w": ref + upd}, {}, {"run": "control", "round": t + 1, "sender": "c",
                                                           "received": {"w": ref}})
            scores += (update_canaries(m, 2000, 0) @ (out["w"] - ref)).numpy()
        return scores, canary_coins("control", "c", m, 0), ev["epsilon"]


# ------------------------------------------------------------------------------------------- DP-SGD

class DPSGDAudit(_CanaryAudit):
    name = "dp_audit_dpsgd"
    consumes = ("weights",)
    mechanism, flag = "dp_sgd", "gradient_canaries"
    controls = ("Dirac canaries, no noise", "noise multiplier 1")
    outputs = {"dirac": "white-box Dirac gradient canaries at public parameter coordinates: how far the client's "
                        "uploads moved each canary's coordinate against it"}

    def audit(self, view, victim, ups):
        names = [k for k, _ in view.new_model().named_parameters()]   # trainable parameters, in order
        m = ups[-1][0]
        if not all(k in upd for _, upd in ups for k in names):
            return Skipped(victim, "weights", m.round, "the uploads are not full parameter states")
        scores = np.zeros(self.p.canaries)
        for _, upd in ups:
            flat = torch.cat([upd[k].flatten() for k in names])
            coords = gradient_canary_coordinates(self.p.canaries, len(flat), self.p.canary_seed)
            scores -= flat[torch.as_tensor(coords)].numpy()   # descent moves a canary's coordinate against its gradient
        ev = next(e for e in m.env.filters if e.get("mechanism") == "dp_sgd")
        return Audit(victim, "weights", m.round, scores, float(ev["delta"]),
                     _example_epsilon(m.env.filters, self.p.delta), truth=records.GRADIENT_CANARIES, variant="dirac")

    @staticmethod
    def _synthetic(sigma: float, insert: bool, m: int = 40, seed: int = 0):
        """DP-SGD (Opacus) on a linear model, 100 random examples, m Dirac canaries, 20 steps; the scores."""
        g = torch.Generator().manual_seed(seed)
        x, y = torch.rand(100, 500, generator=g) - 0.5, torch.randint(0, 4, (100,), generator=g)
        net = torch.nn.Linear(500, 4)
        cfg = PrivacyConfig(dp_sgd=True, noise_multiplier=sigma, accountant="rdp",
                            audit=AuditConfig(gradient_canaries=m if insert else 0, seed=seed))
        tp = TrainParams(lr=0.1, momentum=0.0, weight_decay=0.0, batch_size=25)
        client = SimpleNamespace(privacy=cfg, params=tp, train=SimpleNamespace(x=x, y=y), dp_state=None, gen=g,
                                 events=[], id="c", stream=lambda *k: seeding.rng(seed, *k),
                                 record_truth=lambda *a, **k: None,
                                 _seq=np.random.SeedSequence(seed), _party=1)   # _seq, _party: for a core without stream()
        before = torch.cat([q.detach().flatten() for q in net.parameters()])
        dp_fit(client, net, steps=20)
        after = torch.cat([q.detach().flatten() for q in net.parameters()])
        coords = gradient_canary_coordinates(m, len(before), seed)
        member = client.dp_state.canaries[1] if insert else seeding.rng(seed).random(m) < 0.5
        return (before - after)[coords].numpy(), member, client.events[-1]["epsilon"]
