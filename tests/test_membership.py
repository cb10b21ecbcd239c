"""Membership inference: score math, reference federations through the engine, controls, harness outputs."""
import csv

from conftest import tiny_scenario

import numpy as np
import pytest

from attacks.membership import LiRA, LossAttack, RMIA, Trajectory, control_world, lira, references, rmia, \
    target_states, trend_slope
from fdg_audit.errors import UserError


def test_lira_offline_and_online_separate_shifted_members():
    rng = np.random.default_rng(0)
    n, N = 400, 8
    member = rng.random(n) < 0.5
    ref_in = np.zeros((N, n), bool)
    ref_in[: N // 2] = True                              # online: half the references trained on every x
    hard = rng.normal(0, 1, n)                           # per-example difficulty, shared by all models
    ref_phi = hard + rng.normal(0, 0.3, (N, n)) + 2.0 * ref_in
    phi = hard + rng.normal(0, 0.3, n) + 2.0 * member
    for online in (False, True):
        s = lira(phi, ref_phi, ref_in, online)
        assert s[member].mean() > s[~member].mean()
        # calibration on the per-example OUT mean removes the shared difficulty: better than the raw statistic
        from fdg_audit.metrics import auc
        assert auc(s, member) > auc(phi, member) + 0.05
    # offline score is the z-score against the OUT Gaussian (global variance)
    s = lira(phi, ref_phi, np.zeros((N, n), bool), False)
    assert np.allclose(np.argsort(s), np.argsort(phi - ref_phi.mean(0)))


def test_rmia_counts_population_points_beaten_by_gamma():
    px = np.array([0.9, 0.5, 0.1])
    ref_px = np.full((2, 3), 0.5)
    pz = np.array([0.5, 0.5, 0.5, 0.5])
    ref_pz = np.full((2, 4), 0.5)
    none_in = np.zeros((2, 3), bool)
    # a = 1: Pr(x) = Pr_OUT(x) = 0.5 everywhere, so LR(x, z) = px / 0.5
    s = rmia(px, ref_px, none_in, pz, ref_pz, a=1.0, gamma=1.5, online=False)
    assert s.tolist() == [1.0, 0.0, 0.0]                 # only 0.9/0.5 = 1.8 > 1.5
    s = rmia(px, ref_px, none_in, pz, ref_pz, a=1.0, gamma=0.5, online=False)
    assert s.tolist() == [1.0, 1.0, 0.0]
    # the score never increases when the target's probability of x falls
    assert np.all(np.diff(rmia(px, ref_px, none_in, pz, ref_pz, 0.3, 1.0, False)) <= 0)


def test_trend_slope_is_least_squares_slope():
    t = np.arange(5.0)
    losses = np.stack([3 - 0.5 * t, 1 + 0 * t, 0.2 * t], 1)
    assert np.allclose(trend_slope(losses), [-0.5, 0.0, 0.2])
    assert np.allclose(trend_slope(losses[:1]), 0.0)


def test_params_are_validated():
    with pytest.raises(UserError, match="target_model"):
        LossAttack.Params(target_model="final")
    with pytest.raises(UserError, match="refs >= 2"):
        LiRA.Params(online=True, refs=1)
    with pytest.raises(UserError, match="shadow_data"):
        RMIA.Params(shadow_data="victims")


def test_controls_loss_and_trajectory():
    for atk in (LossAttack(), Trajectory()):
        pos, neg = atk.control()
        assert pos.positive and pos.passed and pos.value >= 0.8, (atk.name, pos)
        assert not neg.positive and neg.passed and abs(neg.value - 0.5) < 0.15, (atk.name, neg)


def test_references_run_the_observed_protocol_with_balanced_in_out():
    view, aux, _, _ = control_world("cpu")
    victims = view.clients
    refs = references(view, aux, LiRA.Params(refs=2, online=True, ref_rounds=1), victims, online=True)
    assert len(refs.states) == 2
    for v in victims:
        ins = np.stack([m[v] for m in refs.cand_in])
        assert (ins.sum(0) == 1).all()                     # every candidate IN for exactly half the references
        # the reference twin's model is a plain model of the observed architecture
        assert set(refs.states[0][v]) == set(target_states(view, v, "local")[-1][1])
    # local target: a reference twin trained only on its own share of the pool, never on population points
    for r in range(2):
        a, b = refs.pool_in[r][victims[0]], refs.pool_in[r][victims[1]]
        assert a.any() and b.any() and not (a & b).any()
    refs_g = references(view, aux, LiRA.Params(refs=1, target_model="global", ref_rounds=1), victims, online=False)
    assert (refs_g.pool_in[0][victims[0]] == refs_g.pool_in[0][victims[1]]).all()   # global: union of clients


def test_lira_and_rmia_train_equal_reference_federations_once_through_their_shared_cache(monkeypatch, tmp_path):
    """The references of one run and setting are kept in the attack cache every membership attack shares: RMIA's job
    after LiRA's reads LiRA's models (no federation trained) and gets the same states, IN masks and pool; another
    setting (more references) misses the cache."""
    import attacks.membership as MB
    from fdg_audit.audit.harness import cache_dir
    from fdg_audit.audit.checks import describe
    (_, lira, _), (_, rmia, _) = (describe({"name": n}, "cpu") for n in ("mia_lira", "mia_rmia"))   # as the harness
    assert cache_dir(tmp_path, lira, "a") == cache_dir(tmp_path, rmia, "b") == tmp_path / "attack_cache" / "mia_references"
    view, aux, _, _ = control_world("cpu")
    view.__dict__.pop("_kept", None)    # what other tests' attacks kept on this (shared) control view
    p = LiRA.Params(refs=2, ref_rounds=1)
    first = references(view, aux, p, view.clients, online=False)
    kept = dict(view._kept)
    assert len(kept) == 1
    monkeypatch.setattr(view, "cached", lambda key: kept.get(key), raising=False)
    monkeypatch.setattr(MB, "federate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained again")))
    again = references(view, aux, RMIA.Params(refs=2, ref_rounds=1), view.clients, online=False)
    for r in range(2):
        for v in view.clients:
            assert all(np.array_equal(np.asarray(first.states[r][v][k]), again.states[r][v][k])
                       for k in first.states[r][v])
            assert np.array_equal(first.cand_in[r][v], again.cand_in[r][v])
    view.model(again.states[1][view.clients[0]])    # a cached state loads into the observed model, as a trained one
    with pytest.raises(AssertionError, match="trained again"):
        references(view, aux, RMIA.Params(refs=3, ref_rounds=1), view.clients, online=False)


def test_lira_controls_with_two_references():
    """LiRA below its default 4 references. RMIA's default is 2 references: its controls at that setting are
    asserted once, in tests/test_conformance.py (controls at defaults)."""
    pos, neg = LiRA(LiRA.Params(refs=2)).control()
    assert pos.passed and pos.value >= 0.8, pos
    assert neg.passed, neg


def test_harness_writes_pooled_rows_and_raw_scores(run_toml):
    root = run_toml(tiny_scenario(
        name="mia", threads=None, model=None,
        data=dict(family=None, domains=["rot0", "rot15", "rot30"], targets=["rot0"], per_domain=None),
        train=dict(rounds=2, lr=0.05, batch_size=None),
        attacks=[dict(name="mia_loss"), dict(name="mia_trajectory", target_model="global")]))
    rows = list(csv.DictReader(open(root / "leakage.csv")))
    loss = [r for r in rows if r["attack"] == "mia_loss" and r["metric"] == "auc"]
    assert {r["victim"] for r in loss} == {"rot15", "rot30", "pooled"}
    assert all(r["status"] == "ok" for r in loss)
    traj = {r["output"] for r in rows if r["attack"] == "mia_trajectory"}
    assert traj == {"slope", "last", "mean"}
    # the global model is what a curious client receives: the first client (rot15) attacks, and not itself
    traj_auc = [r for r in rows if r["attack"] == "mia_trajectory" and r["metric"] == "auc"]
    assert {r["victim"] for r in traj_auc} == {"rot30"}
    assert {r["adversary"] for r in traj_auc} == {"rot15"} and {r["adversary"] for r in loss} == {"server"}
    z = np.load(root / "mia" / "mia_loss" / "rotated__fedavg__rot0__s0.npz")
    assert set(z.files) == {"score", "member", "victim", "variant", "round"}
    assert len(z["score"]) == len(z["member"]) == len(z["victim"])
    for v in ("rot15", "rot30"):
        m = z["member"][z["victim"] == v]
        assert m.sum() == len(m) - m.sum() > 0              # as many members as non-members per victim
    from fdg_audit.metrics import auc
    pooled = [r for r in loss if r["victim"] == "pooled"][0]
    assert abs(auc(z["score"], z["member"]) - float(pooled["value"])) < 1e-9
    # each victim's and the pooled AUC with its DeLong interval and the blind baseline (max(0.5, blind AUC))
    for r in loss:
        same = {x["metric"]: float(x["value"]) for x in rows if x["attack"] == "mia_loss" and x["victim"] == r["victim"]
                and x["output"] == r["output"]}
        assert same["auc_ci_low"] <= float(r["value"]) <= same["auc_ci_high"]
        assert float(r["baseline"]) == pytest.approx(max(0.5, same["blind_auc"]))


def test_candidates_of_small_clients_pair_members_with_domain_non_members():
    """With many clients per domain a client's own val share may hold no image; its non-members then come from
    the domain's held-back val half, which no client trained on, and every client still gets a balanced pool."""
    from fdg_audit.audit.scoring import build_aux
    from fdg_audit.data import DataConfig, load_data
    data = load_data(DataConfig(dataset="digits", per_domain=60, clients_per_domain=8, domains=["rot0", "rot15", "rot30"]))
    aux, members = build_aux(data, "rot30", ("candidates",), seed=0)
    clients = [c for d in ("rot0", "rot15") for c in data.clients(d)]
    assert sorted(aux.candidates) == sorted(c.name for c in clients if len(c.train.y))
    for c in clients:
        m, cand = members[c.name], aux.candidates[c.name]
        assert m.sum() == len(m) - m.sum() == min(len(c.train.y), len(data.domain(c.name.split("/")[0]).val.y) // 2)
        assert m.sum() > 0
        # members are the client's own images (as pixels), non-members no client's
        own = {x.numpy().tobytes() for x in c.train.x}
        for x, is_in in zip(cand.x, m):
            assert (x.numpy().tobytes() in own) == bool(is_in)


def _digits_pool(shift: bool, n=200, seed=0):
    """Candidates from one domain's images: members and non-members a random split (exchangeable), or (``shift``)
    members mostly of classes 0-4 and non-members mostly of 5-9 (a class-balance shift no model is needed for)."""
    import torch
    from fdg_audit.data import DataConfig, load_data
    d = load_data(DataConfig(dataset="digits", domains=["rot0", "rot30"])).domains[0]
    x, y = torch.cat([d.train.x, d.val.x]), torch.cat([d.train.y, d.val.y])
    rng = np.random.default_rng(seed)
    w = np.where(y.numpy() < 5, 0.8, 0.2) if shift else np.full(len(y), 0.5)
    is_member = rng.random(len(y)) < w
    pick = lambda mask: rng.permutation(np.flatnonzero(mask))[:n // 2]  # noqa: E731
    keep = np.r_[pick(is_member), pick(~is_member)]
    return x[keep], y[keep], is_member[keep].astype(float)


def test_blind_auc_beats_chance_only_when_members_and_non_members_differ():
    from fdg_audit.metrics.membership import blind_auc, hanley_mcneil_se
    se = hanley_mcneil_se(0.5, 100, 100)                       # about 0.041
    exchangeable = [blind_auc(*_digits_pool(False, seed=s), seed=s) for s in range(3)]
    assert all(abs(a - 0.5) < 3 * se for a in exchangeable), exchangeable
    shifted = blind_auc(*_digits_pool(True))
    assert shifted > 0.5 + 3 * se, shifted


def test_auc_ci_is_delongs_interval_with_its_coverage():
    from scipy.stats import norm
    from fdg_audit.metrics.membership import auc, auc_ci, victim_spread
    rng = np.random.default_rng(0)
    lab = np.r_[np.ones(60), np.zeros(40)]
    s = rng.normal(0.8 * lab, 1.0)
    a, lo, hi = auc_ci(s, lab)
    assert a == pytest.approx(auc(s, lab)) and lo < a < hi
    true = norm.cdf(0.8 / np.sqrt(2))                          # binormal AUC
    cover = np.mean([(lambda c: c[1] <= true <= c[2])(auc_ci(rng.normal(0.8 * lab, 1.0), lab)) for _ in range(300)])
    assert 0.91 <= cover <= 0.99, cover
    ties = np.round(s)                                         # midranks: ties count half, as in the AUC
    assert auc_ci(ties, lab)[0] == pytest.approx(auc(ties, lab))
    leaky, blind = (rng.normal(3 * lab, 1.0), lab), (rng.normal(0 * lab, 1.0), lab)
    sp = victim_spread({"a": leaky, "b": blind}, baseline={"a": 0.5, "b": 0.5})
    assert sp["share_clear"] == 0.5 and sp["min"] == sp["victims"]["b"][0] and sp["max"] > 0.95
    assert victim_spread({"a": leaky}, baseline=0.999)["share_clear"] == 0.0


def test_scorer_baseline_is_the_blind_auc_of_the_candidates():
    from fdg_audit.api.attack import Aux, Scores
    from fdg_audit.data import Split
    from fdg_audit.audit.scoring import score
    rows = {}
    for shift in (True, False):
        x, y, m = _digits_pool(shift)
        aux = Aux(candidates={"v": Split(x, y, np.arange(len(y)))}, num_classes=10)
        s = np.random.default_rng(1).normal(size=len(m)) + m
        rows[shift] = {r["metric"]: r for r in score(Scores("v", "weights", 1, s), None, {"v": m}, aux)[0]}
    for r in rows.values():
        assert r["auc"]["baseline"] == max(0.5, r["blind_auc"]["value"])
        assert r["auc_ci_low"]["value"] < r["auc"]["value"] < r["auc_ci_high"]["value"]
        assert r["auc_ci_low"]["baseline"] == r["auc"]["baseline"]
    assert rows[True]["auc"]["baseline"] > 0.6 > rows[False]["blind_auc"]["value"]


def test_rmia_tunes_a_on_every_reference_in_turn():
    """RMIA's offline a is the grid value of the best mean AUC over the references, each attacked with the others
    (leave one out), not the best on reference 0 alone: on a pool where the two choices differ, tune_a returns the
    first. Each reference is a lookup table of logits (pool and population points are their row numbers)."""
    from types import SimpleNamespace

    import torch

    from attacks.membership import References
    from fdg_audit.api import Split
    from fdg_audit.metrics import auc

    class Table(torch.nn.Module):
        def __init__(self, z):
            super().__init__()
            self.z = torch.nn.Parameter(torch.as_tensor(z, dtype=torch.float32), requires_grad=False)

        def forward(self, x):
            return self.z[x[:, 0].long()]

    atk, grid = RMIA(RMIA.Params(refs=3)), np.round(np.linspace(0, 1, 11), 2)
    n, m, t = 60, 30, atk.p.temperature
    for seed in range(50):
        rng = np.random.default_rng(seed)
        ins = rng.random((3, n)) < 0.5
        hard = rng.normal(0, 1, n + m)
        s = hard + rng.normal(0, rng.uniform(0.3, 2.0, (3, 1)), (3, n + m))
        s[:, :n] += 1.0 * ins
        probs = 1 / (1 + np.exp(-s / t))                  # softmax over logits [s, 0] at label 0, temperature t

        def curve(i, rest):
            keep = (~ins[rest]).any(0)
            return [auc(rmia(probs[i, :n][keep], probs[rest][:, :n][:, keep], ins[rest][:, keep], probs[i, n:],
                             probs[rest][:, n:], a, atk.p.gamma, False), ins[i][keep]) for a in grid]
        loo = np.mean([curve(i, np.arange(3) != i) for i in range(3)], 0)
        first = curve(0, np.arange(3) != 0)
        if grid[np.argmax(loo)] != grid[np.argmax(first)]:
            break
    else:
        pytest.fail("no pool where attacking reference 0 alone and leave-one-out choose different a")
    z = np.stack([s, np.zeros_like(s)], -1)
    refs = References(states=[{"v": Table(z[r])} for r in range(3)], cand_in=[],
                      pool=Split(torch.arange(n, dtype=torch.float32)[:, None], torch.zeros(n, dtype=torch.long),
                                 np.arange(n)),
                      pool_in=[{"v": ins[r]} for r in range(3)],
                      population=Split(torch.arange(n, n + m, dtype=torch.float32)[:, None],
                                       torch.zeros(m, dtype=torch.long), np.arange(n, n + m)))
    assert atk.tune_a(SimpleNamespace(model=lambda st: st), refs, "v") == grid[np.argmax(loo)]
