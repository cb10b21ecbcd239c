"""Scorecard statistics: interval coverage, unbiased held-out selection, `attacks = "all"` selection."""
import numpy as np
import pytest

from fdg_audit.metrics import stats as S


@pytest.mark.parametrize("n_runs", [3, 5])
def test_two_level_interval_covers_95_percent_with_few_runs(n_runs):
    """A two-level metric (runs x items: each run has its own effect, sd 0.5, and 30 items of sd 1 around it):
    the interval over runs covers the true mean 95% +- 3% of the time at 3 and at 5 runs (1200 repetitions).
    The two-stage bootstrap it replaced covered about 80-88% here."""
    rng = np.random.default_rng(n_runs)
    hits = []
    for rep in range(1200):
        runs = [S.Items("mean", rng.normal(0.3 + rng.normal(0, 0.5), 1.0, 30), ids=np.arange(30))
                for _ in range(n_runs)]
        _, lo, hi = S.estimate(runs, seed=rep)
        hits.append(lo <= 0.3 <= hi)
    assert 0.92 <= np.mean(hits) <= 0.98, np.mean(hits)


def test_false_distinguishable_rate_at_zero_difference_is_at_most_5_percent():
    """Two methods with no true difference (paired runs: a shared run effect, each its own item noise): the share
    of "distinguishable" calls stays <= 5% (plus Monte-Carlo slack), alone and with Holm over 4 comparisons;
    below 3 runs the call is "not testable", never "distinguishable"."""
    rng = np.random.default_rng(7)
    single, family = [], []
    for rep in range(1000):
        shared = rng.normal(0, 0.5, 5)
        a = [S.Items("mean", rng.normal(m, 1.0, 30)) for m in shared]
        f = [S.Items("mean", rng.normal(m, 1.0, 30)) for m in shared]
        single.append(S.paired(a, f)["call"] == "distinguishable")
        comps = [S.compare(rng.normal(0, 1, 5)) for _ in range(4)]
        family.append(any(c["call"] == "distinguishable" for c in S.holm_calls(comps)))
    assert np.mean(single) <= 0.065 and np.mean(family) <= 0.065, (np.mean(single), np.mean(family))
    two = S.compare([0.5, 0.6])
    assert two["call"] == "not testable" and two["n"] == 2
    strong = S.compare([0.5, 0.6, 0.55, 0.52])
    assert strong["call"] == "distinguishable" and strong["lo"] > 0


def test_holm_and_signflip_are_exact():
    assert S.holm([0.01, 0.04, 0.03, np.nan])[:3] == pytest.approx([0.03, 0.06, 0.06])
    assert np.isnan(S.holm([0.01, np.nan])[1])
    assert S.signflip_p([1.0, 2.0, 3.0]) == pytest.approx(0.25)       # only all-plus and all-minus reach 2.0
    assert S.signflip_p([1.0, -1.0, 1.0, -1.0]) == pytest.approx(1.0)
    m, lo, hi, n = S.t_interval([1.0, 2.0, 3.0])
    assert (m, n) == (2.0, 3) and (hi - m) == pytest.approx(4.303 * 1 / np.sqrt(3), rel=1e-3)


def test_auc_interval_covers_and_matches_the_metrics_module():
    from fdg_audit import metrics as M
    rng = np.random.default_rng(1)
    y = np.r_[np.ones(60), np.zeros(60)].astype(int)
    s = rng.normal(0, 1, 120) + 0.5 * y
    it = S.Items("auc", s, y, np.arange(120))
    assert it.stat() == pytest.approx(M.auc(s, y))
    hits = []
    for rep in range(200):   # true AUC of N(0.5, 1) vs N(0, 1): Phi(0.5 / sqrt 2)
        y = np.r_[np.ones(60), np.zeros(60)].astype(int)
        runs = [S.Items("auc", rng.normal(0, 1, 120) + 0.5 * y, y, np.arange(120))]
        _, lo, hi = S.estimate(runs, seed=rep)
        hits.append(lo <= 0.6381 <= hi)
    assert 0.9 <= np.mean(hits) <= 0.99, np.mean(hits)


def test_heldout_selection_on_pure_noise_stays_at_chance_while_the_max_does_not():
    rng = np.random.default_rng(2)
    heldout, naive = [], []
    for run in range(4):   # 4 runs x 12 candidates (victims x rounds) of pure-noise membership scores
        cands = []
        for _ in range(12):
            y = rng.permutation(np.r_[np.ones(50), np.zeros(50)]).astype(int)
            cands.append(S.Items("auc", rng.random(100), y, np.arange(100) + 1000 * run))
        i, items, sel = S.heldout(cands, higher=True, salt=run)
        assert sel == "heldout" and 35 <= len(items) <= 65
        heldout.append(items)
        naive.append(max(c.stat() for c in cands))
    v, lo, hi = S.estimate(heldout)
    assert lo <= 0.5 <= hi
    assert np.mean(naive) > 0.56   # the strongest of 12 noisy AUCs is biased upwards


def test_heldout_finds_a_real_signal_and_single_candidate_keeps_all_items():
    rng = np.random.default_rng(3)
    noise = [S.Items("mean", rng.normal(0, 1, 50), ids=np.arange(50)) for _ in range(5)]
    signal = S.Items("mean", rng.normal(2, 1, 50), ids=np.arange(50))
    i, items, sel = S.heldout(noise[:2] + [signal] + noise[2:], higher=True)
    assert i == 2 and items.stat() > 1.5
    i, items, sel = S.heldout([signal])
    assert sel == "single" and len(items) == 50


def test_heldout_with_few_items_never_leaves_an_empty_half():
    """Estimates have one item per victim: a hash split of 2-4 ids can leave a half empty (a NaN cell before);
    the ranked split keeps both halves non-empty, and one item means no split and no choice on data."""
    rng = np.random.default_rng(5)
    empty = 0
    for salt in range(40):
        ids = np.arange(2) + 10 * salt
        empty += S.half(ids, salt).all() or not S.half(ids, salt).any()
        cands = [S.Items("mean", rng.normal(0, 1, 2), ids=ids) for _ in range(3)]
        i, items, sel = S.heldout(cands, higher=True, salt=salt)
        assert sel in ("heldout", "heldout-ranked") and len(items) == 1 and np.isfinite(items.stat())
    assert empty > 0   # the plain hash split does leave a half empty here
    one = [S.Items("mean", np.array([v]), ids=np.array([7])) for v in (0.2, 0.4, 0.9)]
    i, items, sel = S.heldout(one, higher=True)
    assert sel == "mean" and items.stat() == pytest.approx(0.5)
    i, items, sel = S.heldout([S.Items("auc", np.array([0.3]), np.array([1]), np.array([7]))] * 2)
    assert sel == "first" and i == 0


def test_paired_difference_interval():
    rng = np.random.default_rng(4)
    a = [S.Items("mean", rng.normal(1.0, 1, 80), ids=np.arange(80)) for _ in range(3)]
    f = [S.Items("mean", rng.normal(0.0, 1, 80), ids=np.arange(80)) for _ in range(3)]
    d = S.paired(a, f)
    assert d["lo"] > 0.2 and d["hi"] < 2.0 and d["lo"] < d["mean"] < d["hi"] and d["n"] == 3
    d = S.paired_values(np.array([0.80, 0.82, 0.70, 0.71]), np.array([0.80, 0.81, 0.70, 0.72]),
                        np.array(["a", "a", "b", "b"]))
    assert d["lo"] <= 0 <= d["hi"] and d["n"] == 4 and d["call"] == "not distinguishable"


def test_balanced_accuracy_items():
    from fdg_audit import metrics as M
    pred, true = np.array([0, 1, 1, 2, 2, 2]), np.array([0, 1, 2, 2, 2, 0])
    it = S.Items("balanced_acc", (pred == true).astype(float), true)
    assert it.stat() == pytest.approx(M.balanced_accuracy(pred, true, 3))


# ---------------------------------------------------------------- attacks = "all"

from fdg_audit.api.attack import Attack  # noqa: E402


class WeightsProbe(Attack):
    """A user plugin named "module:Class" that reads weights (applies to every method here)."""
    name, consumes, adversary, target = "weights_probe", ("weights",), "server", "membership"

    def run(self, view, aux):
        return []


class StyleProbe(Attack):
    """A user plugin that reads style banks (applies to no method here)."""
    name, consumes, adversary, target = "style_probe", ("style_bank",), "client", "attribute"

    def run(self, view, aux):
        return []


def test_attacks_all_selects_exactly_the_attacks_whose_consumes_meet_the_ledger(run_toml):
    import json
    from fdg_audit.harness import selection
    from fdg_audit.plugins import available, load_attack
    from fdg_audit.scenario import load_raw, parse
    root = run_toml("""
        name = "sel"
        seeds = [0]
        report = false
        [data]
        dataset = "digits"
        family = "rotated"
        domains = ["rot0", "rot30", "rot60"]
        targets = ["rot0"]
        per_domain = 40
        [train]
        rounds = 1
        [[methods]]
        name = "fedavg"
        [[methods]]
        name = "feddg"
        bank_content = "full"
        """)
    sc = parse(dict(load_raw(root / "config.resolved.toml"),
                    attacks=[{"name": "all"}, {"name": "test_scorecard:WeightsProbe"},
                             {"name": "test_scorecard:StyleProbe"}]))
    cfgs = [dict(name=a.name, label=a.label, **a.params) for a in sc.attacks]
    assert {c["name"] for c in cfgs} == set(available("attack")) | {"test_scorecard:WeightsProbe",
                                                                      "test_scorecard:StyleProbe"}
    envs = [json.loads(line) for line in (root / "messages.jsonl").read_text().splitlines()]
    chosen = selection(root, cfgs)
    assert set(chosen) == {"rotated/fedavg/rot0/s0", "rotated/feddg/rot0/s0"}
    for run, labels in chosen.items():
        mine = [e for e in envs if e["run"] == run]
        clients = sorted({e["sender"] for e in mine} - {"server"})
        seen = {"server": {e["kind"] for e in mine if "server" in (e["sender"], e["receiver"])},
                "eavesdropper": {e["kind"] for e in mine},
                "client": {e["kind"] for e in mine if clients[0] in (e["sender"], e["receiver"])}}
        want = set()
        for c in cfgs:
            atk = load_attack(c["name"])()
            if set(atk.consumes) & seen[atk.adversary]:
                want.add(c["label"])
        assert set(labels) == want
        assert "test_scorecard:WeightsProbe" in labels and "test_scorecard:StyleProbe" not in labels
        assert ("amplitude_phase_retrieval" in labels) == ("feddg" in run)
        assert "update_inversion" in labels and "mia_loss" in labels and "style_inversion" not in labels


def test_attacks_all_string_and_bad_keys():
    from fdg_audit.errors import UserError
    from fdg_audit.plugins import available
    from fdg_audit.scenario import parse
    sc = parse({"attacks": "all"})
    assert sorted(a.name for a in sc.attacks) == sorted(available("attack"))
    sc = parse({"attacks": [{"name": "all", "targets": ["x"], "exclude": ["mia_lira"]},
                            {"name": "update_inversion", "iterations": 5}]})
    names = [a.name for a in sc.attacks]
    assert "mia_lira" not in names and names.count("update_inversion") == 1
    assert all(a.params.get("targets") == ["x"] for a in sc.attacks if a.name != "update_inversion")
    sc = parse({"attacks": [{"name": "all", "seeds": [0, 1, 2]}]})     # seeds is a setting every attack has
    assert all(a.params.get("seeds") == [0, 1, 2] for a in sc.attacks)
    with pytest.raises(UserError, match="not a setting every attack has"):
        parse({"attacks": [{"name": "all", "iterations": 5}]})
    with pytest.raises(UserError, match="not a registered attack"):
        parse({"attacks": [{"name": "all", "exclude": ["nope"]}]})


def test_attack_randomness_is_salted_by_the_run_seed():
    """Runs of different seeds draw independent attack randomness; the same run seed gives the same draws."""
    from fdg_audit.harness import _make, salted
    _, atk, job = _make({"name": "amplitude_phase_retrieval"}, "cpu")
    seeds = {salted(atk, job, s)[0].p.seed for s in (0, 1, 2)}
    assert len(seeds) == 3 and salted(atk, job, 1)[0].p.seed == salted(atk, job, 1)[1]["params"]["seed"]
    assert salted(atk, job, 1)[0].p.seed == salted(atk, job, 1)[0].p.seed and atk.p.seed == 0


def test_attack_seed_and_target_filters(tmp_path):
    from types import SimpleNamespace

    from fdg_audit.harness import wanted
    from fdg_audit.errors import UserError
    from fdg_audit.runner import run_scenario
    atk = SimpleNamespace(p=SimpleNamespace(targets=["rot0"], seeds=[1]))
    run = lambda target, seed: SimpleNamespace(target=target, seed=seed)  # noqa: E731  (a RunInfo's fields)
    assert wanted(atk, run("rot0", 1))
    assert not wanted(atk, run("rot0", 0)) and not wanted(atk, run("rot15", 1))
    assert wanted(SimpleNamespace(p=SimpleNamespace(targets=[], seeds=[])), run("x", 5))
    f = tmp_path / "s.toml"
    f.write_text('seeds = [0]\n[[methods]]\nname = "fedavg"\n[[attacks]]\nname = "mia_loss"\nseeds = [3]\n')
    with pytest.raises(UserError, match=r"attacks.mia_loss.seeds = \[3\]"):
        run_scenario(str(f), out=str(tmp_path / "runs"), quiet=True)
    assert not (tmp_path / "runs").exists()          # refused before anything ran
