"""Amplitude-bank attacks (FedDG): bank access per adversary, phase retrieval, fingerprint, attribute inference.

``FakeBank`` is a FedAvg that uploads and relays the same bank FedDG does (phase "bank" / "bank_relay", kind
"amplitude_bank", {"amp"} / {"<sender>/amp"}); it is run by "module:Class" name like any third-party method.
"""
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from attacks.amplitude import (
    AttributeInference, PhaseRetrieval, amplitude, bank_entries, fingerprint, perturb,
    radial_profile, retrieve, toy_images,
)
from fdg_audit import metrics as M
from fdg_audit.api.attack import AdversaryView
from fdg_audit.audit.harness import load_runs, run_attacks
from fdg_audit.audit.scoring import Truth
from fdg_audit.errors import UserError
from fdg_audit.api.method import MethodPlugin, Reply
from fdg_audit.store.ledger import Ledger
from fdg_audit.runner import run_scenario
from methods.fedavg import FedAvgClient, FedAvgServer
from methods.fedavg import Params as FedAvgParams

from conftest import leakage_rows as rows, public_split, tiny_scenario


@dataclass
class FakeParams(FedAvgParams):
    bank_content: str = "full"       # full | window (the central 5x5 of the fftshifted amplitude)


class FakeClient(FedAvgClient):
    def on_bank(self, msg):
        amp = torch.fft.fft2(self.train.x).abs()
        if self.params.bank_content == "window":
            h = amp.shape[-1] // 2
            amp = torch.fft.fftshift(amp, dim=(-2, -1))[..., h - 2:h + 3, h - 2:h + 3]
        self.record_truth("amp", idx=self.train.idx)
        return Reply("amplitude_bank", {"amp": amp.contiguous()})

    def on_bank_relay(self, msg):
        self.relayed = sorted(msg.arrays)


class FakeServer(FedAvgServer):
    def begin(self):
        super().begin()
        banks = self.ask("bank")
        self.exchange("bank_relay", "amplitude_bank",
                      {c: ({f"{o}/amp": banks[o].arrays["amp"] for o in self.clients if o != c}, {})
                       for c in self.clients})


class FakeBank(MethodPlugin):
    name = "fakebank"
    Params = FakeParams
    Server = FakeServer
    Client = FakeClient
    kinds = ("n_samples", "amplitude_bank", "weights")


FAKE = f"{__name__}:FakeBank"
AMP = dict(name="amp", data=dict(per_domain=80), train=dict(batch_size=32))
ROT = dict(data=dict(family="rotated", domains=["rot0", "rot15", "rot45", "rot75"], targets=["rot75"]),
           methods=[dict(name=FAKE, label="m", bank_content="full")])
APP = dict(ROT, data=dict(family="appearance", domains=["grey", "colour", "inverted", "texture"], targets=["texture"]))
PR, FP, AI = "amplitude_phase_retrieval", "amplitude_fingerprint", "amplitude_attribute"
FAST_PR = dict(name="amplitude_phase_retrieval", hio=100, er=50, restarts=2, max_images=8, render_restarts=16,
               render_keep=2, render_steps=[200, 400])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Finished run folders (attacks re-run on them): rotated full bank, rotated window bank, appearance."""
    out, made = tmp_path_factory.mktemp("amp"), {}

    def get(key, *layers):  # one run per key
        if key not in made:
            f = out / f"{key}.toml"
            f.write_text(public_split(tiny_scenario(AMP, *layers)))   # one fixed split: thresholds on known data
            made[key] = run_scenario(str(f), out=str(out / key), quiet=True)
        return made[key]
    return get


def controls(root, attack):
    return [c for c in json.loads((Path(root) / "controls.json").read_text()) if c["attack"] == attack]


def value(root, **match):
    (r,) = rows(root, **match)
    return float(r["value"]), float(r["baseline"])


# ------------------------------------------------------------------------------------------ bank access

@pytest.mark.parametrize("adversary", ["client", "server", "eavesdropper"])
def test_each_adversary_reads_the_banks_it_observed(runs, adversary):
    root = runs("rot", ROT)
    runs, data = load_runs(root)
    run = next(iter(runs.values()))
    clients = run.clients
    me = {"client": clients[0]}.get(adversary, adversary)
    view = AdversaryView(Ledger.open(root), run.protocol(), adversary, me, torch.device("cpu"))
    banks = bank_entries(view)
    assert [v for v, _, _ in banks] == sorted(c for c in clients if c != me)   # never its own bank
    truth = Truth(root, run.run, data[run.run])
    for victim, rnd, amp in banks:   # the bank is |FFT2| of exactly the recorded images, in row order
        x, _, doms = truth.images(truth.record(victim, "amp")["idx"])
        assert rnd == 0 and set(doms) == {victim}
        assert torch.allclose(amp, torch.fft.fft2(x).abs(), atol=1e-4)
    assert len(bank_entries(view, max_victims=1)) == 1


def test_window_crop_matches_feddg():
    feddg = pytest.importorskip("methods.feddg")
    x = toy_images(3, 3, 28, torch.Generator().manual_seed(0))
    assert torch.equal(amplitude(x, (5, 5)), feddg.central(feddg.amplitude(x), 2))
    assert torch.equal(amplitude(x, (28, 28)), feddg.amplitude(x))


# ------------------------------------------------------------------------------------------ phase retrieval

def test_padded_images_with_known_support_come_back_exactly():
    gen = torch.Generator().manual_seed(1)
    x = torch.nn.functional.pad(toy_images(6, 1, 12, gen), (0, 12, 0, 12))
    sup = torch.zeros(24, 24, dtype=torch.bool)
    sup[:12, :12] = True
    g, res, _ = retrieve(torch.fft.fft2(x[:, 0]).abs(), sup, "zero", 1000, 200, 8, gen=gen, tol=0.0)
    ps = M.aligned_psnr(g[:, None], x)
    assert ps.median() >= 60 and (res[ps >= 60] < 1e-3).all()
    assert (M.aligned_psnr(g[:, None].flip(-1), x) < ps).all()      # a mirror image is not a trivial ambiguity
    # PhaseRetrieval's controls at defaults (>= 60 dB; render share >= 0.2): tests/test_conformance.py


def test_batched_supports_equal_one_shared_support_and_defaults_are_the_attacks_md_budget():
    gen = torch.Generator().manual_seed(2)
    x = toy_images(4, 1, 16, gen)[:, 0]
    sup = torch.zeros(16, 16, dtype=torch.bool)
    sup[2:14, 2:14] = True
    a = torch.fft.fft2(x).abs()
    g1, r1, _ = retrieve(a, sup, "constant", 30, 10, 2, gen=torch.Generator().manual_seed(0))
    g2, r2, _ = retrieve(a, sup.expand(4, 16, 16), "constant", 30, 10, 2, gen=torch.Generator().manual_seed(0))
    assert torch.allclose(g1, g2, atol=1e-5) and torch.allclose(r1, r2, atol=1e-6)
    box = torch.ones(16, 16, dtype=torch.bool)     # an all-True mask is the box variant
    g3, _, _ = retrieve(a, box, "constant", 30, 10, 2, gen=torch.Generator().manual_seed(0))
    g4, _, _ = retrieve(a, None, "constant", 30, 10, 2, gen=torch.Generator().manual_seed(0))
    assert torch.allclose(g3, g4, atol=1e-5)
    p = PhaseRetrieval.Params()
    assert (p.hio, p.er, p.restarts) == (1000, 200, 8) and "support_frame" in p.variants


def test_each_image_stops_at_its_own_plateau():
    """What the plateau rule guarantees, on inputs where it holds by construction (no float order, no timing):
    units run together each stop at their own plateau. Objectives given exactly: unit 0 never improves after its
    first check, unit 1 improves by 10 % per window until iteration 60 then stalls, unit 2 halves every window.
    With two stages (HIO, ER) a unit is done at its second plateau: unit 0 at 60 its (checks at 20, 40: moved; 60:
    done), unit 1 at 100, unit 2 never (its cap). Then retrieve() on padded images: with the rule off (plateau_tol 0,
    tol 0) every image runs both caps; with it on no image runs past them."""
    from attacks.images import Plateau
    window, cap = 20, 200
    plat = Plateau(3, window, 1e-3, stages=2)
    best = lambda it: torch.tensor([1.0, 0.9 ** min(it // window, 3), 0.5 ** (it // window)])  # noqa: E731
    for it in range(1, cap + 1):
        if plat.due():
            u = plat.active
            plat.check(best(it)[u])
        if not len(plat.active):
            break
    plat.finish()
    assert plat.its.tolist() == [60, 100, cap] and plat.stage.tolist() == [2, 2, 0]

    gen = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    x = torch.nn.functional.pad(toy_images(6, 1, 12, gen()), (0, 12, 0, 12))
    sup = torch.zeros(24, 24, dtype=torch.bool)
    sup[:12, :12] = True
    a = torch.fft.fft2(x[:, 0]).abs()
    _, _, on = retrieve(a, sup, "zero", 600, 200, 4, gen=gen(), window=25)
    _, _, off = retrieve(a, sup, "zero", 600, 200, 4, gen=gen(), tol=0.0, plateau_tol=0.0)
    assert (off.its == 800).all() and (on.its <= 800).all() and (on.its > 0).all()
    assert (on.cpu > 0).all() and (off.cpu > 0).all()


def test_phase_retrieval_outputs_record_iterations_cpu_and_rule(runs):
    root = runs("rot", ROT)
    run = next(iter(load_runs(root)[0].values()))
    view = AdversaryView(Ledger.open(root), run.protocol(), "server", "server", torch.device("cpu"))
    atk = PhaseRetrieval(PhaseRetrieval.Params(adversary_view="server", variants=["box"], hio=40, er=20, restarts=1,
                                               max_images=2, plateau_window=10))
    outs = atk.run(view, None)
    assert len(outs) == len(run.clients)
    for o in outs:
        assert 0 < o.iterations <= 60 and o.cpu_seconds > 0
        assert "over 10 its" in o.plateau and "HIO until a plateau or 40 its" in o.plateau and "cap 60 its" in o.plateau


def test_phase_retrieval_beats_the_mean_intensity_baseline(runs):
    root = runs("rot", ROT)
    run_attacks(root, [FAST_PR], quiet=True)
    victims = ["rot15", "rot45"]                     # the curious client is rot0, the first client
    for victim in victims:
        for variant in ("box", "support", "support_domain", "support_frame", "render"):   # every variant by default
            ps, base = value(root, attack=PR, victim=victim, output=variant, metric="psnr")
            assert ps > base + 5                       # digits on black: positivity alone leaks a lot
            ss, sbase = value(root, attack=PR, victim=victim, output=variant, metric="ssim")
            assert ss > sbase + 0.3
    assert {r["status"] for r in rows(root, attack=PR)} == {"ok"}
    assert {r["victim"] for r in rows(root, attack=PR)} == set(victims)
    assert [c["passed"] for c in controls(root, PR)] == [True, True]
    grids = sorted((Path(root) / "recon" / "amplitude_phase_retrieval").glob("*.npz"))
    assert len(grids) == 10
    flats = 0
    for g in grids:
        with np.load(g) as z:
            assert z["recon"].shape == z["truth"].shape == (8, 1, 28, 28)
            # per image the better of the flat DC image (at the true image's mean: the un-noised DC term, built by
            # the scorer, so a noised bank cannot move it) and the public mean image, aligned
            flat = np.broadcast_to(z["truth"].mean((2, 3), keepdims=True), z["truth"].shape)
            flats += int(np.isclose(z["baseline"], flat, atol=1e-6).all((1, 2, 3)).sum())
            mse = lambda a: ((a - z["truth"]) ** 2).mean((1, 2, 3))  # noqa: E731
            assert (mse(z["baseline"]) <= mse(flat) + 1e-6).all()
    assert flats < 80   # never better than flat (above), and the public mean image wins where it is closer


def test_render_prior_recovers_rotated_digits_exactly():
    """The public recipe of the rotated digits (8x8 digit -> 20x20 box -> rotation): at the default budget, most
    rot15 digits come back exactly from their amplitude alone; the mean clears 40 dB."""
    from sklearn.datasets import load_digits

    from attacks.amplitude import render_fit
    from fdg_audit.data.digits import lift, rotate
    from fdg_audit.metrics import image as M
    x = rotate(lift(load_digits().images[:16]), 15.0)
    p = PhaseRetrieval.Params()
    r = render_fit(torch.fft.fft2(x[:, 0]).abs(), torch.full((16,), 15.0), p.render_restarts, p.render_keep,
                   p.render_steps, torch.Generator().manual_seed(0))
    ps = M.aligned_psnr(r, x)
    assert ps.mean() >= 40 and (ps >= 60).sum() >= 8


def test_render_is_skipped_without_a_recipe(runs):
    root = runs("app", APP)
    run_attacks(root, [dict(FAST_PR, variants=["render"])], quiet=True)
    got = rows(root, attack=PR)
    assert got and all(r["metric"] == "skipped" and "publishes no recipe" in r["status"] for r in got)


def test_server_view_attacks_every_client(runs):
    root = runs("rot", ROT)
    run_attacks(root, [dict(FAST_PR, adversary_view="server", variants=["box"], max_images=4)], quiet=True)
    assert {r["victim"] for r in rows(root, attack=PR)} == {"rot0", "rot15", "rot45"}
    assert {r["adversary"] for r in rows(root, attack=PR)} == {"server"}
    with pytest.raises(UserError, match="unknown variant"):
        PhaseRetrieval(PhaseRetrieval.Params(variants=["boxx"]))


def test_window_bank_skips_phase_retrieval_but_not_the_fingerprint(runs):
    root = runs("rot_window", ROT, dict(methods=[dict(name=FAKE, label="m", bank_content="window")]))
    # one variant: the skip is decided per bank, before variants (the render control, run by the harness for a
    # "render" variant, is asserted in test_phase_retrieval_beats_the_mean_intensity_baseline and conformance)
    run_attacks(root, [dict(FAST_PR, variants=["box"]), dict(name="amplitude_fingerprint")], quiet=True)
    skipped = rows(root, attack=PR)
    assert skipped and all(r["metric"] == "skipped" and r["status"].startswith("skipped: the bank holds a (5, 5)")
                           for r in skipped)
    auc, _ = value(root, attack=FP, victim="pooled", output="exact", metric="auc")
    assert auc > 0.9                                   # 25 low frequencies still single out most images


# ------------------------------------------------------------------------------------------ fingerprint

def test_fingerprint_is_shift_and_inversion_invariant():
    x = toy_images(4, 3, 28, torch.Generator().manual_seed(2))
    inv = torch.roll(torch.flip(x, (-2, -1)), (1, 1), (-2, -1))        # x(-n mod N)
    f = fingerprint(amplitude(x))
    for y in (torch.roll(x, (5, -3), (-2, -1)), inv):
        assert torch.allclose(fingerprint(amplitude(y)), f, atol=1e-5)
    assert torch.allclose(f.norm(dim=1), torch.ones(4)) and torch.allclose(f.mean(1), torch.zeros(4), atol=1e-6)


def test_perturbation_is_a_non_circular_shift_plus_gain_and_noise():
    x = torch.zeros(64, 1, 9, 9)
    x[:, :, 4, 4] = 0.5
    y = perturb(x, torch.Generator().manual_seed(0), shift=2, gain=0.0, noise=0.0)
    pos = y.flatten(1).argmax(1)
    dy, dx = pos // 9 - 4, pos % 9 - 4
    assert torch.allclose(y.flatten(1).amax(1), torch.full((64,), 0.5))
    assert dy.abs().max() == 2 and dx.abs().max() == 2 and len(set(zip(dy.tolist(), dx.tolist()))) > 10
    edge = torch.zeros(64, 1, 9, 9)
    edge[..., :, 0] = 1.0      # a bright left column: repeated when moved right, gone when moved left, never wrapped
    y = perturb(edge, torch.Generator().manual_seed(0), shift=2, gain=0.0, noise=0.0)    # same shifts as above
    assert torch.equal((y[:, 0, 0, :] == 1).sum(-1), (dx + 1).clamp(min=0)) and (y[..., -1] == 0).all()
    z = perturb(torch.full((256, 1, 8, 8), 0.5), torch.Generator().manual_seed(0), shift=0, gain=0.1, noise=0.02)
    gains = z.mean((1, 2, 3)) / 0.5
    assert 0.88 < gains.min() < 0.95 and 1.05 < gains.max() < 1.12 and 0.015 < (z - z.mean((2, 3), True)).std() < 0.025


def test_fingerprint_finds_members_and_controls_hold(runs):
    root = runs("rot", ROT)
    run_attacks(root, [dict(name="amplitude_fingerprint")], quiet=True)
    for victim in ("rot15", "rot45", "pooled"):
        auc, base = value(root, attack=FP, victim=victim, output="exact", metric="auc")
        blind = value(root, attack=FP, victim=victim, output="exact", metric="blind_auc")[0]
        assert auc == 1.0 and base == max(0.5, blind)   # a model-free classifier's AUC is the floor
        assert value(root, attack=FP, victim=victim, output="perturbed", metric="auc")[0] > 0.8
    assert value(root, attack=FP, victim="pooled", output="exact", metric="tpr@0fpr")[0] == 1.0
    ctl = controls(root, FP)
    assert [(c["positive"], c["passed"]) for c in ctl] == [(True, True), (False, True)]


# ------------------------------------------------------------------------------------------ attribute inference

def test_radial_profile_ignores_orientation():
    x = toy_images(5, 2, 16, torch.Generator().manual_seed(3))
    a, at = amplitude(x), amplitude(x.transpose(-1, -2))                  # transposing keeps every radius
    assert torch.allclose(radial_profile(a, False), radial_profile(at, False), atol=1e-5)
    assert radial_profile(a, False).shape == (5, 2 * 9)
    shifted = torch.fft.fftshift(a, dim=(-2, -1))
    assert torch.allclose(radial_profile(shifted, True), radial_profile(a, False), atol=1e-5)


def test_attribute_inference_beats_chance(runs):
    root = runs("app", APP)
    run_attacks(root, [dict(name="amplitude_attribute")], quiet=True)
    for victim in ("colour", "inverted"):
        # the appearance of a site is in its amplitude (inverted differs from grey only at DC: radial keeps it)
        acc, chance = value(root, attack=AI, victim=victim, output="radial/domain_samples",
                            metric="domain_balanced_acc")
        assert chance == 1 / 3 and acc > 0.9
        acc, chance = value(root, attack=AI, victim=victim, output="logamp/public+domain_samples",
                            metric="class_balanced_acc")
        assert chance == 0.1 and acc > 0.3
    assert len(controls(root, AI)) == 4 and all(c["passed"] for c in controls(root, AI))
    ctl = AttributeInference(AttributeInference.Params(features=["radial"])).control()
    assert [(c.positive, c.passed) for c in ctl] == [(True, True), (False, True)]


def test_feddg_bank_is_attacked(runs):
    """The real method's bank through the same attacks."""
    pytest.importorskip("methods.feddg")
    root = runs("feddg", ROT, dict(methods=[dict(name="feddg", label="m")]))
    run_attacks(root, [dict(FAST_PR, variants=["support_domain"]), dict(name="amplitude_fingerprint")], quiet=True)
    assert value(root, attack=FP, victim="pooled", output="exact", metric="auc")[0] == 1.0
    ps, base = value(root, attack=PR, victim="rot15", output="support_domain", metric="psnr")
    assert ps > base + 5
