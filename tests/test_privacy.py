"""Differential privacy: DP-SGD in Client.fit, Gaussian rows on artifacts, privacy.csv, the artifact audit."""
import csv
import json
import math

import numpy as np
import pytest
import torch

from fdg_audit.data import DataConfig, load_data
from fdg_audit.errors import UserError
from fdg_audit.store.ledger import Ledger
from fdg_audit.privacy import PRIVACY_FIELDS, ArtifactMechanism, epsilon, new_accountant
from fdg_audit.privacy.artifacts import GaussianRows, clip_rows

from conftest import leakage_rows, tiny_scenario

DPSGD = dict(dp_sgd=True, noise_multiplier=0.5, max_grad_norm=1.0, accountant="rdp")


def scenario(n: int, rounds: int, *layers, **overrides) -> str:
    """The shared tiny scenario on three rotated-digit domains of ``n`` images, ``rounds`` rounds of one local epoch
    at batch size 32, changed by ``layers`` and ``overrides`` (``tiny_scenario``)."""
    return tiny_scenario(dict(seeds=[0], threads=None, model=None, methods=None, data=dict(per_domain=n),
                              train=dict(rounds=rounds, local_epochs=1, batch_size=32, lr=0.1)), *layers, **overrides)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def hashes(root):
    return [e.sha256 for e in Ledger.open(root).envelopes]


def test_dp_sgd_trains_and_accountant_persists_over_rounds(run_toml):
    root = run_toml(scenario(200, 5, privacy=DPSGD, methods=[dict(name="fedavg")]))
    with open(root / "privacy.csv") as f:
        assert next(csv.reader(f)) == PRIVACY_FIELDS
    rows = read_csv(root / "privacy.csv")
    for party in ("rot15", "rot30"):
        mine = sorted((r for r in rows if r["party"] == party), key=lambda r: int(r["round"]))
        assert {r["epsilon"] for r in mine if r["round"] == "1"} == {mine[0]["epsilon"]}   # one ε for every adversary
        mine = [r for r in mine if r["adversary"] == "server"]
        assert [int(r["round"]) for r in mine] == [1, 2, 3, 4, 5]
        eps = [float(r["epsilon"]) for r in mine]
        assert all(b > a for a, b in zip(eps, eps[1:])), eps       # grows: never reset between rounds
        q, per_round = float(mine[0]["sample_rate"]), int(mine[0]["steps"])
        for t, r in enumerate(mine, 1):                            # = one accountant over all t rounds' steps
            acc = new_accountant("rdp")
            acc.history = [(0.5, q, per_round * t)]
            assert int(r["steps"]) == per_round * t
            assert float(r["epsilon"]) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    led = Ledger.open(root)
    ups = led.select(kind="weights", receiver="server")
    assert ups and all(not a["name"].startswith("_module") for e in ups for a in e.arrays)   # plain state dicts
    assert all(e.filters and e.filters[0]["mechanism"] == "dp_sgd" for e in ups)
    metrics = [r for r in read_csv(root / "metrics.csv") if r["source_val_acc"]]
    assert max(float(r["source_val_acc"]) for r in metrics) > 0.25   # 10 classes: chance is 0.1


def test_same_seed_same_ledger_with_dp_in_both_engines(run_toml):
    feddg = dict(name="feddg", privacy=dict(dp_sgd=False, artifacts=dict(amplitude_bank=dict(clip=50.0,
                                                                                          noise_multiplier=1.0))))
    text = scenario(40, 1, privacy=DPSGD, methods=[dict(name="fedavg"), feddg])
    # workers use one thread each: compare every run at the same thread count
    a, b = run_toml(text, "threads=1", name="a"), run_toml(text, "threads=1", name="b")
    assert hashes(a) == hashes(b)                                     # DP-SGD noise and bank noise are seeded
    assert (a / "privacy.csv").read_text() == (b / "privacy.csv").read_text()
    mech = {r["mechanism"] for r in read_csv(a / "privacy.csv")}
    assert mech == {"dp_sgd", "gaussian_rows:amplitude_bank"}
    # the process engine: the filter runs inside each client's process (DP-SGD only uses the client's generator,
    # whose equality across engines the core tests check)
    c = run_toml(scenario(40, 1, privacy=DPSGD, methods=[feddg]), "engine=\"process\"", "threads=1", name="c")
    run = "rotated/feddg/rot0/s0"
    assert hashes(c) == [e.sha256 for e in Ledger.open(a).envelopes if e.run == run]


def test_noised_bank_is_clipped_rows_plus_noise_of_the_configured_scale(run_toml):
    clip, sigma = 40.0, 0.5
    bank = dict(amplitude_bank=dict(clip=clip, noise_multiplier=sigma))
    root = run_toml(scenario(80, 1, privacy=dict(artifacts=bank), methods=[dict(name="feddg", local_steps=1)]))
    data = load_data(DataConfig(dataset="digits", domains=["rot0", "rot15", "rot30"], per_domain=80))
    by_id = {int(i): x for d in data.domains for s in (d.train, d.val) for i, x in zip(s.idx, s.x)}
    led = Ledger.open(root)
    ups = led.select(kind="amplitude_bank", receiver="server")
    assert len(ups) == 2
    for e in ups:
        noised = led.payload(e).arrays["amp"].double()
        with np.load(root / "truth" / e.run / e.sender / "amp.npz") as z:
            clean = torch.fft.fft2(torch.stack([by_id[int(i)] for i in z["idx"]]).double()).abs()
        assert (clean.flatten(1).norm(dim=1) > clip).all()          # every row is clipped here
        clipped = clip_rows({"amp": clean}, clip)["amp"]
        assert clipped.flatten(1).norm(dim=1).max() <= clip * (1 + 1e-9)
        resid = noised - clipped
        assert resid.std().item() == pytest.approx(sigma * clip, rel=0.03)
        assert abs(resid.mean().item()) < 0.02 * sigma * clip
        n2, c2 = noised.flatten(1), clean.flatten(1)                   # per row, noised ~ f * clean + noise with
        coef = (n2 * c2).sum(1) / (c2 * c2).sum(1)                      # f = clip / ||row||: the row was scaled
        f = clip / c2.norm(dim=1)
        assert (coef - f).abs().mean() < 0.1 and (coef - 1).abs().mean() > 0.5
        ev = e.filters[0]
        assert (ev["mechanism"], ev["clip"], ev["noise_multiplier"], ev["steps"]) == ("gaussian_rows", clip, sigma, 1)
        acc = new_accountant("prv")                                   # one Gaussian release, Opacus' default
        acc.step(noise_multiplier=sigma, sample_rate=1.0)
        assert ev["epsilon"] == pytest.approx(epsilon(acc, 1e-5), rel=1e-9)
    relays = led.select(kind="amplitude_bank", sender="server")
    assert relays and all(not e.filters for e in relays)            # relays are post-processing: no new noise


def test_clipping_bound_and_noise_scale_unit():
    g = torch.Generator().manual_seed(0)
    x = {"mean": torch.randn(500, 8, generator=g) * 3, "std": torch.rand(500, 8, generator=g) * 3}
    c = clip_rows(x, 2.0)
    norms = torch.cat([c["mean"], c["std"]], 1).norm(dim=1)
    assert norms.max() <= 2.0 * (1 + 1e-6)
    small = torch.cat([x["mean"], x["std"]], 1).norm(dim=1) < 2.0
    assert torch.equal(c["mean"][small], x["mean"][small])
    f = GaussianRows("style_bank", ArtifactMechanism(clip=2.0, noise_multiplier=3.0), 1e-5, "rdp")
    out, _, ev = f("style_bank", x, {}, {"run": "r", "round": 0, "sender": "a"})
    assert (out["mean"] - c["mean"]).std().item() == pytest.approx(6.0, rel=0.05)
    again, _, _ = GaussianRows("style_bank", f.m, 1e-5, "rdp")("style_bank", x, {}, {"run": "r", "round": 0,
                                                                                      "sender": "a"})
    assert torch.equal(again["mean"], out["mean"])                    # seeded by (run, sender, round, kind)
    other, _, _ = f("style_bank", x, {}, {"run": "r", "round": 0, "sender": "a"})
    assert not torch.equal(other["mean"], out["mean"])                # a second release gets fresh noise
    assert f.acc[("r", "a")].history == [(3.0, 1.0, 2)]               # and is accounted
    with pytest.raises(UserError, match="passthrough"):
        f("style_bank", {"mean": x["mean"], "ids": torch.arange(500)}, {}, {"run": "r", "round": 0, "sender": "a"})


def test_batchnorm_and_non_private_losses_are_refused(run_toml, tmp_path):
    with pytest.raises(UserError, match='model.norm = "group"'):
        run_toml(scenario(40, 1, privacy=DPSGD, model=dict(norm="batch"), methods=[dict(name="fedavg")]))
    for method in ("csac", "fedsr"):      # refused at plan time (every such method: test_client_dp.py)
        with pytest.raises(UserError, match=f"'{method}' has no per-example objective .*client-level DP") as e:
            run_toml(scenario(40, 1, privacy=DPSGD, methods=[dict(name=method)]), name=method)
        assert "\n" not in str(e.value) and not (tmp_path / "runs" / method).exists()   # before any training
    from types import SimpleNamespace

    from fdg_audit.privacy.dpsgd import check_loss
    with pytest.raises(UserError, match="not marked as a mean of per-example terms"):   # a plugin's own loss: at fit
        check_loss(SimpleNamespace(train=None), torch.nn.Linear(2, 2), lambda m, x, y: 0, None)


def test_dp_fit_refuses_batchnorm_models_built_by_a_method():
    from types import SimpleNamespace

    from fdg_audit.privacy.dpsgd import check_loss
    client = SimpleNamespace(train=None)
    bn = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    with pytest.raises(UserError, match='model.norm = "group"'):
        check_loss(client, bn, None, None)


def audit(sigma: float) -> str:
    """FedDG's bank clipped at 100 without noise ("clean") and at ``sigma`` ("noised"), 128 canaries, the artifact
    audit."""
    bank = lambda s: dict(artifacts=dict(amplitude_bank=dict(clip=100.0, noise_multiplier=s)))  # noqa: E731
    return scenario(100, 1, train=dict(local_epochs=None, local_steps=1), privacy=dict(audit=dict(canaries=128)),
                    methods=[dict(name="feddg", label="clean", privacy=bank(0.0)),
                             dict(name="feddg", label="noised", privacy=bank(sigma))],
                    attacks=[dict(name="attacks.dp_audit:ArtifactAudit", canaries=128)])


def test_audit_bound_is_below_the_accountant_and_positive_without_noise(run_toml):
    root = run_toml(audit(1.0))
    rows = read_csv(root / "leakage.csv")
    get = lambda method, metric: [(r["victim"], r["output"], float(r["value"])) for r in rows  # noqa: E731
                                  if r["method"] == method and r["metric"] == metric]
    clean = get("clean", "eps_lb_one_run")
    assert len(clean) == 4 and all(v > 1.0 for _, _, v in clean)       # positive control: canaries are visible
    assert all(math.isinf(v) for _, _, v in get("clean", "eps_theory"))
    theory = {(vi, o): v for vi, o, v in get("noised", "eps_theory")}
    acc = new_accountant("prv")
    acc.step(noise_multiplier=1.0, sample_rate=1.0)
    assert len(theory) == 4 and all(v == pytest.approx(epsilon(acc, 1e-5)) for v in theory.values())
    for metric in ("eps_lb_one_run", "eps_lb_cp"):
        for vi, o, v in get("noised", metric):
            assert 0.0 <= v <= theory[(vi, o)]
    controls = json.loads((root / "controls.json").read_text())
    assert controls and all(c["passed"] for c in controls)
    member = np.load(root / "truth" / "rotated/noised/rot0/s0" / "rot15" / "canaries.npz")["member"]
    assert len(member) == 128 and 30 < member.sum() < 98                 # each slot in w.p. 1/2


def test_privacy_csv_composes_a_partys_mechanisms_into_a_total():
    from fdg_audit.bus import Envelope
    from fdg_audit.privacy import privacy_rows

    def env(rnd, ev):
        return Envelope("r", "m", rnd, "p", 0, "a", "server", "k", [], [], 0, "", [ev])
    sgd = lambda rnd, steps: dict(mechanism="dp_sgd", accountant="rdp", noise_multiplier=1.0, clip=1.0,  # noqa: E731
                                  sample_rate=0.1, steps=steps, delta=1e-5, epsilon=0.0,
                                  history=[[1.0, 0.1, steps]])
    bank = dict(mechanism="gaussian_rows", kind="amplitude_bank", accountant="rdp", noise_multiplier=2.0, clip=5.0,
                sample_rate=1.0, steps=1, delta=1e-5, epsilon=0.0, history=[[2.0, 1.0, 1]])
    every = privacy_rows([env(0, bank), env(1, sgd(1, 10)), env(2, sgd(2, 20))])
    assert len(every) == 3 * 6 and {r["covers"] for r in every if r["mechanism"] == "total"} == {
        "amplitude_bank weights delta head generator", "amplitude_bank"}
    rows = [r for r in every if r["adversary"] == "server"]
    assert [(r["mechanism"], r["round"]) for r in rows] == [
        ("dp_sgd", 1), ("dp_sgd", 2), ("gaussian_rows:amplitude_bank", 0), ("total", 0), ("total", 1), ("total", 2)]
    acc = new_accountant("rdp")
    acc.history = [(1.0, 0.1, 20), (2.0, 1.0, 1)]
    assert rows[-1]["epsilon"] == pytest.approx(epsilon(acc, 1e-5)) and rows[-1]["steps"] == 21
    solo = new_accountant("rdp")
    solo.history = [(1.0, 0.1, 20)]
    assert rows[-1]["epsilon"] > epsilon(solo, 1e-5)


def sgd_audit(seed: int, method: str, clean: bool) -> str:
    """DP-SGD at sigma 1.0 on ``method`` ("dp") beside, when ``clean``, FedAvg without noise ("clean"), 256
    gradient canaries, the DP-SGD audit."""
    return scenario(40, 1, seeds=[seed], threads=1, train=dict(local_epochs=None, local_steps=5, batch_size=16),
                    privacy=dict(dp_sgd=True, max_grad_norm=1.0, accountant="rdp", audit=dict(gradient_canaries=256)),
                    methods=([dict(name="fedavg", label="clean", privacy=dict(noise_multiplier=0.0))] if clean else [])
                    + [dict(name=method, label="dp", privacy=dict(noise_multiplier=1.0))],
                    attacks=[dict(name="dp_audit_dpsgd", canaries=256)])


def test_dp_sgd_audit_below_accountant_on_dp_runs_and_positive_without_noise(run_toml):
    for seed, method in ((0, "fedavg"), (1, "fedavg"), (2, "feddg")):
        root = run_toml(sgd_audit(seed, method, clean=not seed), name=f"s{seed}")   # one clean (no-noise) run
        lb, theory = leakage_rows(root, method="dp", metric="eps_lb_one_run"), leakage_rows(root, method="dp",
                                                                                             metric="eps_theory")
        assert len(lb) == len(theory) == 2
        for a, t in zip(lb, theory):
            assert 0.0 <= float(a["value"]) <= float(t["value"]) < math.inf
        clean = [float(r["value"]) for r in leakage_rows(root, method="clean", metric="eps_lb_one_run")]
        assert len(clean) == (0 if seed else 2) and min(clean, default=9) > 1.5   # no noise: the canaries are found
    assert all(c["passed"] for c in json.loads((root / "controls.json").read_text()))


def test_fdp_one_run_audit_tells_eps_8_from_infinity():
    """2,000 canaries through the Gaussian mechanism that is exactly (8, 1e-5)-DP (each canary's score: its
    membership plus N(0, sigma^2)): the f-DP one-run bound stays <= 8 over ten seeds; without noise it exceeds 8,
    and so does the audit's ceiling. Steinke et al.'s bound cannot (its delta term caps it below 8)."""
    from fdg_audit.metrics.dp import gaussian_delta, gaussian_sigma
    from fdg_audit.privacy.audit import ceiling, one_run_bound
    m, delta = 2000, 1e-5
    sigma = gaussian_sigma(8.0, delta)
    assert gaussian_delta(8.0, sigma) == pytest.approx(delta, rel=1e-6)
    for seed in range(10):
        rng = np.random.default_rng(seed)
        member = rng.random(m) < 0.5
        assert one_run_bound(member + sigma * rng.standard_normal(m), member, delta, fdp=True) <= 8.0
    member = np.random.default_rng(0).random(m) < 0.5
    assert one_run_bound(member.astype(float), member, delta, fdp=True) > 8.0 and ceiling(m, delta) > 8.0
    assert one_run_bound(member.astype(float), member, delta) < 8.0
