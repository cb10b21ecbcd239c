"""Scorecard statistics: interval coverage, unbiased held-out selection, `attacks = "all"` selection."""
import numpy as np
import pytest

from fdg_audit.metrics import stats as S
from test_report import psnr_headline  # noqa: F401  (fixture: a dB reconstruction headline)


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
    assert S.signflip_p([1.0, 2.0, 3.0], "greater") == pytest.approx(0.125)   # only all-plus
    assert S.signflip_p(np.ones(20), "greater") == pytest.approx(1 / (2 ** 16 + 1))   # sampled: never 0
    m, lo, hi, n = S.t_interval([1.0, 2.0, 3.0])
    assert (m, n) == (2.0, 3) and (hi - m) == pytest.approx(4.303 * 1 / np.sqrt(3), rel=1e-3)


def test_each_harm_is_its_own_holm_family():
    """Accuracy comparisons are adjusted among themselves, not with the leakage ones (one family per harm): with
    p = 0.02 and 0.5 for accuracy and 0.01, 0.03, 0.2 for reconstruction, accuracy's 0.02 becomes 2 x 0.02 (a
    family of 2), not 4 x 0.02 (Holm over all 5); an untestable comparison (p NaN) counts in no family."""
    from fdg_audit.report.compare import holm_per_harm
    mk = lambda harm, p: dict(harm=harm, p=p, n=10, lo=-0.5, hi=0.5, metric="target_acc")  # noqa: E731
    comps = [mk("accuracy", 0.02), mk("accuracy", 0.5), mk("accuracy", float("nan"))] + \
        [mk("reconstruction", p) for p in (0.01, 0.03, 0.2)]
    holm_per_harm(comps)
    assert [c["p_holm"] for c in comps[:2]] == pytest.approx([0.04, 0.5])
    assert [c["p_holm"] for c in comps[3:]] == pytest.approx([0.03, 0.06, 0.2])
    assert comps[2]["call"] == "not testable" and comps[2]["p_holm"] != comps[2]["p_holm"]
    assert [c["family_size"] for c in comps] == [2, 2, 2, 3, 3, 3]
    assert [c["call"] for c in comps[:2]] == ["borderline", "inconclusive"]


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


def _choose(cands_by_run, higher=True):
    """stats.crossfit over {run: [Items]} (keys: positions): per run the items as scored, and how."""
    runs = {r: dict(enumerate(cs)) for r, cs in cands_by_run.items()}
    choice, how = S.crossfit(runs, higher, {r: r for r in runs})
    return {r: S.concat([S.part(runs[r][k], r, h) for k, h in ks]) for r, ks in choice.items()}, choice, how


def test_crossfit_selection_on_pure_noise_stays_at_chance_while_the_max_does_not():
    rng = np.random.default_rng(2)
    cands, naive = {}, []
    for run in range(4):   # 4 runs x 12 candidates (outputs x rounds) of pure-noise membership scores
        cands[run] = []
        for _ in range(12):
            y = rng.permutation(np.r_[np.ones(50), np.zeros(50)]).astype(int)
            cands[run].append(S.Items("auc", rng.random(100), y, np.arange(100) + 1000 * run))
        naive.append(max(c.stat() for c in cands[run]))
    scored, _, how = _choose(cands)
    assert how == "crossfit" and all(len(it) == 100 for it in scored.values())   # every item counts once
    v, lo, hi = S.estimate(list(scored.values()))
    assert lo <= 0.5 <= hi
    assert np.mean(naive) > 0.56   # the strongest of 12 noisy AUCs is biased upwards


def test_crossfit_finds_a_real_signal_and_single_candidate_keeps_all_items():
    rng = np.random.default_rng(3)
    cands = {r: [S.Items("mean", rng.normal(2 if k == 2 else 0, 1, 50), ids=np.arange(50)) for k in range(6)]
             for r in range(3)}
    scored, choice, how = _choose(cands)
    assert all(k == 2 for ks in choice.values() for k, _ in ks) and all(it.stat() > 1.5 for it in scored.values())
    scored, _, how = _choose({0: [cands[0][2]]})
    assert how == "single" and len(scored[0]) == 50


def test_crossfit_averages_candidates_tied_on_a_half_whatever_their_order():
    """Two outputs re-identify every image of half A (a tie); on half B one keeps doing so and one does not. The tie
    is not broken by the outputs' order: both score half B and the value is the same in either order."""
    ids = np.arange(40)
    a = ~S.half(ids, 0)
    first = S.Items("mean", np.where(a, 1.0, 0.0), ids=ids)
    second = S.Items("mean", np.ones(40), ids=ids)
    got = [_choose({0: cs})[0][0].stat() for cs in ([first, second], [second, first])]
    assert got[0] == pytest.approx(got[1]) and 0.5 < got[0] < 1.0


def test_crossfit_counts_clients_of_one_image_every_run_keeps_its_items():
    """Runs of three one-image victims pooled (3 items a run): a per-run held-out choice left runs with an empty or
    one-item half; the cross-fit chooses on the halves of all runs, and every run keeps all 3 items, scored by the
    output chosen on the other half: here the output that re-identifies (1.0) over one that does not (0.0)."""
    rng = np.random.default_rng(5)
    cands = {r: [S.Items("mean", np.zeros(3), ids=np.arange(3) + 10 * r),
                 S.Items("mean", np.ones(3), ids=np.arange(3) + 10 * r),
                 S.Items("mean", (rng.random(3) < 0.3).astype(float), ids=np.arange(3) + 10 * r)] for r in range(5)}
    scored, choice, how = _choose(cands)
    assert how == "crossfit" and all(len(it) == 3 for it in scored.values())
    assert all(it.stat() == 1.0 for it in scored.values())


def test_paired_difference_interval():
    rng = np.random.default_rng(4)
    a = [S.Items("mean", rng.normal(1.0, 1, 80), ids=np.arange(80)) for _ in range(3)]
    f = [S.Items("mean", rng.normal(0.0, 1, 80), ids=np.arange(80)) for _ in range(3)]
    d = S.paired(a, f)
    assert d["lo"] > 0.2 and d["hi"] < 2.0 and d["lo"] < d["mean"] < d["hi"] and d["n"] == 3
    d = S.paired_values(np.array([0.80, 0.82, 0.70, 0.71, 0.75, 0.76]), np.array([0.80, 0.81, 0.70, 0.72, 0.75, 0.76]),
                        np.array(["a", "a", "b", "b", "c", "c"]), "target_acc")
    assert d["lo"] <= 0 <= d["hi"] and d["n"] == 6 and d["call"] == "not distinguishable"
    assert S.paired_values(np.array([0.8, 0.7, 0.9]), np.array([0.75, 0.72, 0.93]), None, "target_acc")["call"] == \
        "inconclusive"                                                 # p large, interval wider than ±0.02


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
    from fdg_audit.audit.harness import selection
    from fdg_audit.attack import load_attack
    from fdg_audit.plugins import available
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
            kinds = seen[atk.adversary]   # "*": every kind but those it ignores (the generic attack)
            if (kinds - set(getattr(atk, "ignores", ())) if "*" in atk.consumes else set(atk.consumes) & kinds):
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
    """Runs of different seeds draw independent attack randomness; the same run seed gives the same draws; the worker
    (from the job's ``salt``) and an attack built in this process get the same salted Params; controls keep the seed."""
    from fdg_audit.attack import load_attack
    from fdg_audit.audit.checks import _make
    from fdg_audit.audit.harness import salted
    from fdg_audit.vocab import attack_params
    cls = load_attack("amplitude_phase_retrieval")
    _, atk, job = _make({"name": "amplitude_phase_retrieval"}, "cpu")
    in_worker = lambda s: attack_params(cls.Params, job["params"], job["label"], salted(atk, job, s)[1]["salt"]).seed  # noqa: E731
    assert len({in_worker(s) for s in (0, 1, 2)}) == 3 and in_worker(1) == in_worker(1)
    assert attack_params(cls.Params, job["params"], job["label"]).seed == 0 and "salt" not in job
    _, local, job = _make({"name": "amplitude_phase_retrieval"}, "cpu", isolate=False)
    assert salted(local, job, 1)[0].p.seed == in_worker(1) and local.p.seed == 0


def test_attack_seed_and_target_filters(tmp_path):
    from types import SimpleNamespace

    from fdg_audit.audit.harness import wanted
    from fdg_audit.errors import UserError
    from fdg_audit.runner import run_scenario
    atk = SimpleNamespace(p=SimpleNamespace(targets=["rot0"], seeds=[1], datasets=["small"]))
    run = lambda target, seed, ds="small": SimpleNamespace(target=target, seed=seed, dataset=ds)  # noqa: E731
    assert wanted(atk, run("rot0", 1))
    assert not wanted(atk, run("rot0", 0)) and not wanted(atk, run("rot15", 1)) and not wanted(atk, run("rot0", 1, "big"))
    assert wanted(SimpleNamespace(p=SimpleNamespace(targets=[], seeds=[], datasets=[])), run("x", 5))
    f = tmp_path / "s.toml"
    f.write_text('seeds = [0]\n[[methods]]\nname = "fedavg"\n[[attacks]]\nname = "mia_loss"\nseeds = [3]\n')
    with pytest.raises(UserError, match=r"attacks.mia_loss.seeds = \[3\]"):
        run_scenario(str(f), out=str(tmp_path / "runs"), quiet=True)
    f.write_text('[[datasets]]\nlabel = "d"\n[[methods]]\nname = "fedavg"\n[[attacks]]\nname = "all"\n'
                 'datasets = ["e"]\n')
    with pytest.raises(UserError, match=r"attacks.\w+.datasets = \['e'\]: give a list of this scenario's dataset labels \(d\)"):
        run_scenario(str(f), out=str(tmp_path / "runs"), quiet=True)
    assert not (tmp_path / "runs").exists()          # refused before anything ran


# ---------------------------------------------------------------- issue 19: every leakage number on equal terms

def _card(tmp_path, per_run, attacks=None, seeds=(0, 1, 2), reference="fedavg", privacy=(), prepare=None):
    """scorecard rows {(method, harm, setting): row} of a hand-made folder: ``per_run(run dict) -> [(attack, row)]``
    with row = dict(victim, output, metric, items, base_items[, artifact]); ``attacks``: attacks.json;
    ``privacy``: privacy.csv rows given the run id."""
    import json

    from fdg_audit.report import scorecard as SC
    from fdg_audit.report import tables as T
    from fdg_audit.store.runfolder import RunFolder
    from test_report import LEAK_FIELDS, fabricate, leak_row, write_csv
    root = fabricate(tmp_path / "r", acc=lambda m, v, t, s: 0.5, extra=False, seeds=seeds, reference=reference)
    if prepare:
        prepare(root)
    leak = []
    for r in json.loads((root / "summary.json").read_text())["runs"]:
        if r["status"] != "ok":
            continue
        by = {}
        for attack, row in per_run(r):
            by.setdefault(attack, []).append(dict(run=r["run"], attack=attack, adversary="server",
                                                  artifact="weights", round=0, status="ok") | row)
            b = row["base_items"]
            leak.append(leak_row(r["run"], attack, "weights", row["victim"], 0, row["metric"],
                                 float(row["items"].stat()), float(b.stat()) if b else 0.5, output=row["output"]))
        for attack, rows in by.items():
            RunFolder(root).save_items(attack, r["run"], rows)
    write_csv(root / "leakage.csv", leak, LEAK_FIELDS)
    if privacy:
        runs = [r["run"] for r in json.loads((root / "summary.json").read_text())["runs"] if r["status"] == "ok"]
        write_csv(root / "privacy.csv", [p | dict(run=run) for run in runs for p in privacy])
    if attacks:
        (root / "attacks.json").write_text(json.dumps(attacks))
    card = __import__("fdg_audit.report.model", fromlist=["build"]).build(T.load([root])).rows()
    return {(r["method"], r["harm"], r["setting"]): r for r in card}, root


def _psnr(victim, x, b, output=""):
    return dict(victim=victim, output=output, metric="psnr", items=S.Items("mean", np.asarray(x, float),
                ids=np.arange(len(x))), base_items=S.Items("mean", np.asarray(b, float), ids=np.arange(len(b))))


DESC = dict(name="x:Y", adversary="server", aux=["public"], consumes=["weights"],
            outputs={"": "pixels", "frame": "a known frame", "gen": "the data set's generator"},
            priors={"*": "none", "frame": "layout", "gen": "oracle"}, budget={"*": [400, 2], "gen": [50, 4]},
            knows=["architecture", "local_hyperparams"], rows={})


@pytest.mark.usefixtures("psnr_headline")
def test_a_cell_below_its_own_baseline_reads_so_and_has_no_delta(tmp_path):
    """The reference beats its baseline, this cell does not: "no reconstruction at this budget", no Δ, and the
    verdict does not list it as a leak."""
    rng = np.random.default_rng(0)
    cell, _ = _card(tmp_path, lambda r: [("pr", _psnr("B", rng.normal(8 if r["method"] == "feddg" else 20, 1, 40),
                                                      rng.normal(11, 1, 40)))])
    dg, avg = cell[("feddg", "reconstruction", "")], cell[("fedavg", "reconstruction", "")]
    assert avg["reading"] == "" and dg["reading"] == "no reconstruction at this budget"
    assert dg["diff_ref"] == dg["diff_call"] == dg["reference"] == ""
    from fdg_audit.report import clears
    assert clears(avg) and not clears(dg)


@pytest.mark.usefixtures("psnr_headline")
def test_psnr_headlines_and_every_interval_stay_within_0_and_the_cap(tmp_path):
    """Near-exact reconstructions spread around the 60 dB cap on one run (the bootstrap interval), and a failing
    attack near 0 dB: value, success share, median and baseline intervals all stay in range; the success share and
    median are the held-out images' own."""
    rng = np.random.default_rng(1)
    level = {"fedavg": 2.0, "feddg": 59.0}
    cell, _ = _card(tmp_path, lambda r: [("pr", _psnr("B", np.clip(rng.normal(level[r["method"]], 8, 40), 0, 60),
                                                      np.clip(rng.normal(1, 3, 40), 0, 60)))], seeds=(0,))
    for m in level:
        r = cell[(m, "reconstruction", "")]
        for k in ("ci", "success_ci", "median_ci", "baseline_ci"):
            lo, hi = float(r[f"{k}_low"]), float(r[f"{k}_high"])
            top = 1.0 if k == "success_ci" else 60.0
            assert 0.0 <= lo <= hi <= top, (m, k, lo, hi)
        assert 0 <= float(r["success_25dB"]) <= 1 and 0 <= float(r["median"]) <= 60
    assert float(cell[("feddg", "reconstruction", "")]["success_25dB"]) > 0.9
    assert float(cell[("fedavg", "reconstruction", "")]["success_25dB"]) < 0.1


@pytest.mark.usefixtures("psnr_headline")
def test_the_baseline_is_the_chosen_outputs_own_on_the_same_half(tmp_path):
    """Output "strong" leaks (30 dB) against a dark baseline (5 dB); output "weak" does not (12 dB) against a bright
    one (20 dB). The baseline paired with the strong output's value is its own (about 5 dB), not the strongest
    baseline of any output."""
    rng = np.random.default_rng(2)
    cell, _ = _card(tmp_path, lambda r: [("pr", _psnr("B", rng.normal(12, 1, 40), rng.normal(20, 1, 40), "weak")),
                                         ("pr", _psnr("B", rng.normal(30, 1, 40), rng.normal(5, 1, 40), "strong"))])
    r = cell[("feddg", "reconstruction", "")]
    assert 29 < float(r["value"]) < 31 and 4 < float(r["baseline"]) < 6


@pytest.mark.usefixtures("psnr_headline")
def test_a_cell_pools_its_victims_and_clients_of_one_image_count_per_size(tmp_path):
    """Clients of fixed sizes (client_sizes [1, 1, 1, 64]): an attack output's victims are pooled into one candidate,
    so the three 1-image clients form a held-out cell of their own size (before, a victim without images in both
    halves could never be chosen), and the 64-image client's cell is apart; methods are compared per size."""
    import json
    rng = np.random.default_rng(4)

    def per_run(r):
        level = {"fedavg": 1.0, "feddg": 0.0}[r["method"]]
        img = lambda v, x: dict(victim=v, output="", metric="psnr", items=S.Items(  # noqa: E731
            "mean", np.asarray(x, float), ids=np.arange(len(x)) + 1000 * int(v[-1])),
            base_items=S.Items("mean", np.full(len(x), 10.0), ids=np.arange(len(x)) + 1000 * int(v[-1])))
        return [("ui", img(f"B/{k}", [30.0 * level + 10 + rng.normal(0, 0.1)])) for k in range(3)] + \
            [("ui", img("B/3", rng.normal(12, 1, 8)))]

    def sized(root):
        summary = json.loads((root / "summary.json").read_text())
        for r in summary["runs"]:
            r["data"] = {"client_sizes": [1, 1, 1, 64]}
        (root / "summary.json").write_text(json.dumps(summary))
    cell, root = _card(tmp_path, per_run, prepare=sized)
    one, big = cell[("fedavg", "reconstruction", "clients of 1 image")], \
        cell[("fedavg", "reconstruction", "clients of 64 images")]
    assert one["selection"] == "single" and int(one["n_items"]) == 3 * 6 and float(one["value"]) > 39
    assert 11 < float(big["value"]) < 13 and int(big["n_items"]) == 8 * 6
    assert ("fedavg", "reconstruction", "") not in cell
    feddg = cell[("feddg", "reconstruction", "clients of 1 image")]
    assert feddg["diff_ref"] == "" and feddg["reading"]              # below its baseline: no Δ on its row
    from fdg_audit.report import model as M
    from fdg_audit.report import tables as T
    (c,) = [c for c in M.build(T.load([root])).comparisons if c.harm == "reconstruction" and not c.within
            and c.setting == "clients of 1 image" and c.a[1] == "feddg" and c.b[1] == "fedavg"]
    assert c.diff < -25                                              # compared with FedAvg at the same size


@pytest.mark.usefixtures("psnr_headline")
def test_reconstruction_cells_state_prior_budget_and_capabilities_and_the_oracle_is_never_the_headline(tmp_path):
    """attacks.json declares each output's prior and budget: the oracle output (60 dB) is left out of the headline
    and labelled in the per-victim table; a layout output is the headline with its prior, budget and capabilities;
    Δ only between cells of the same attack, prior and budget."""
    rng = np.random.default_rng(3)

    def per_run(r):
        out = [("pr", _psnr("B", np.full(40, 59.0), rng.normal(11, 1, 40), output="gen"))]
        frame = r["method"] == "feddg"   # FedDG's cell is won by the layout prior, FedAvg's by no prior
        out.append(("pr", _psnr("B", rng.normal(30 if frame else 15, 1, 40), rng.normal(11, 1, 40), output="frame")))
        out.append(("pr", _psnr("B", rng.normal(15 if frame else 25, 1, 40), rng.normal(11, 1, 40))))
        return out
    cell, root = _card(tmp_path, per_run, attacks={"pr": DESC})
    dg, avg = cell[("feddg", "reconstruction", "")], cell[("fedavg", "reconstruction", "")]
    assert (dg["prior"], dg["budget"]) == ("layout", "400x2") and (avg["prior"], avg["budget"]) == ("none", "400x2")
    assert 29 < float(dg["value"]) < 31 and 24 < float(avg["value"]) < 26          # never the 59 dB oracle
    assert dg["capabilities"] == "architecture+local_hyperparams+public_data+layout"
    assert avg["capabilities"] == "architecture+local_hyperparams+public_data"
    assert dg["diff_ref"] == ""                                                     # different priors: no Δ
    from fdg_audit.report import curves as CV
    from fdg_audit.report import tables as T
    from fdg_audit.report.threat import capabilities
    assert capabilities(DESC, "gen") == "architecture+local_hyperparams+public_data+generator"
    assert {r["output"] for r in CV.per_domain(T.load([root])) if r["oracle"]} == {"gen"}
    from fdg_audit.report import write_report
    md = write_report([root], tmp_path / "out").read_text()
    assert "| pr: gen (oracle: upper bound) |" in md
    from test_report import md_table
    legend = {(r["attack"], r["variant"]): r for r in md_table(md, "attack", after="## Attacks and their threat")}
    assert (legend[("pr", "frame")]["prior"], legend[("pr", "frame")]["budget"]) == ("layout", "400x2")
    assert legend[("pr", "gen")]["prior"] == "oracle" and legend[("pr", "gen")]["budget"] == "50x4"
    assert legend[("pr", "frame")]["knows"] == dg["capabilities"]     # stated once per attack, not on every row
    assert "knows architecture" not in md.split("## Attacks and their threat")[0]


def _auc_row(victim, n, shift, rng, output=""):
    """A victim's membership scores: n members N(shift, 1), n non-members N(0, 1); ids salted by the victim as the
    scorer does."""
    from fdg_audit.audit.scoring import _image_ids
    y = np.r_[np.ones(n), np.zeros(n)].astype(int)
    return dict(victim=victim, output=output, metric="auc", base_items=None,
                items=S.Items("auc", rng.normal(0, 1, 2 * n) + shift * y, y, _image_ids(np.arange(2 * n), victim)))


def test_a_small_membership_pool_is_not_resolvable_and_never_distinguishable(tmp_path):
    """6 runs x 2 victims x 40 candidates: the pooled held-out half has < 500 members, so the cell says "not
    resolvable" with its smallest detectable AUC (Hanley-McNeil, power 0.8 at alpha 0.05), a strong Δ to the
    reference is printed but "not resolvable", TPR@0.1% FPR is not given (< 1000 non-members)."""
    from fdg_audit.metrics import membership as MM
    rng = np.random.default_rng(4)
    shift = {"fedavg": 0.8, "feddg": 2.5}
    cell, root = _card(tmp_path, lambda r: [("mia", _auc_row(v, 20, shift[r["method"]], rng)) for v in "BC"])
    dg = cell[("feddg", "membership", "")]
    n1, n0 = int(dg["pool_members"]), int(dg["pool_nonmembers"])
    assert 0 < n1 < 500 and 0 < n0 < 500 and n1 + n0 == int(dg["n_items"])
    assert float(dg["min_auc"]) == pytest.approx(MM.min_detectable_auc(n1, n0))
    assert dg["reading"].startswith("not resolvable") and f"{float(dg['min_auc']):.3f}" in dg["reading"]
    assert dg["tpr@0.001fpr"] == "" and (dg["tpr@0.01fpr"] != "") == (n0 >= 100)
    assert dg["diff_ref"] != "" and dg["diff_call"] == "not resolvable" and dg["diff_p_holm"] == ""
    from fdg_audit.report import write_report
    md = write_report([root], tmp_path / "out").read_text()
    verdict = md.split("## Verdict")[1].split("\n## ")[0].split("\n- ", 1)[1]   # the methods' lines
    assert "membership (server): not resolvable" in verdict and "istinguishable from" not in verdict


def test_a_large_membership_pool_resolves_and_gives_low_fpr_tprs(tmp_path):
    rng = np.random.default_rng(5)
    cell, _ = _card(tmp_path, lambda r: [("mia", _auc_row(v, 400, 3.0, rng)) for v in "BC"])
    dg = cell[("feddg", "membership", "")]
    assert int(dg["pool_members"]) >= 500 and int(dg["pool_nonmembers"]) >= 1000 and dg["reading"] == ""
    assert float(dg["tpr@0.01fpr"]) > 0.5 and dg["tpr@0.001fpr"] != "" and float(dg["min_auc"]) < 0.54


def test_membership_cells_pool_every_victim_calibrated_within_its_model(tmp_path):
    """Three victims per run, each 60 members N(2, 1) and 60 non-members N(0, 1) on its own offset (0, 10, 20: the
    scale of one model's losses says nothing of another's), plus the harness's victim-pooled scores. The cell pools
    every victim's items (3 x 120 per run, one candidate, so no held-out half), not one victim's held-out half, and
    scores them calibrated within each victim's model, so the offsets cost nothing: AUC near the binormal 0.92,
    where the raw pool gives about 0.64."""
    rng = np.random.default_rng(7)

    def rows(r):
        vs = [_auc_row(v, 60, 2.0, rng) for v in "BCD"]
        for k, v in enumerate(vs):
            v["items"].x[:] += 10.0 * k
        pooled = S.Items("auc", np.concatenate([v["items"].x for v in vs]), np.concatenate([v["items"].y for v in vs]),
                         np.concatenate([v["items"].ids for v in vs]))
        return [("mia", v) for v in vs] + [("mia", dict(vs[0], victim="pooled", items=pooled))]
    cell, _ = _card(tmp_path, rows)
    dg = cell[("feddg", "membership", "")]
    n = int(dg["n_items"])
    assert n > int(dg["n_runs"]) * 3 * 60 and int(dg["pool_members"]) + int(dg["pool_nonmembers"]) == n
    assert 0.86 < float(dg["value"]) < 0.97


def test_low_fpr_tprs_break_ties_at_random_where_calibrated_quantiles_tie(tmp_path):
    """60 victims per run of 6 members and 6 non-members each (the DP scenario's clients): an attack well above
    chance, a pool of thousands, yet within-model quantiles take 12 values, so the non-members ranked first in their
    model (several % of them) tie at the top and no threshold reaches 1% FPR. TPR@1% is that of random tie-breaking
    (the interpolated ROC: above 0), where the step rule reads the TPR at FPR 0, which is 0 whatever the attack."""
    rng = np.random.default_rng(8)

    def rows(r):
        vs = [_auc_row(f"c{k}", 6, 1.0, rng) for k in range(60)]
        pooled = S.Items("auc", np.concatenate([v["items"].x for v in vs]), np.concatenate([v["items"].y for v in vs]),
                         np.concatenate([v["items"].ids for v in vs]))
        return [("mia", dict(vs[0], victim="pooled", items=pooled))]
    dg = _card(tmp_path, rows)[0][("feddg", "membership", "")]
    assert int(dg["pool_nonmembers"]) >= 1000 and float(dg["value"]) > 0.7
    assert 0.005 < float(dg["tpr@0.01fpr"]) < 0.2 and 0 < float(dg["tpr@0.001fpr"]) < float(dg["tpr@0.01fpr"])


def test_min_detectable_auc_has_its_power():
    """At the smallest detectable AUC for 100 + 100, a one-sided test against 0.5 rejects 80% of the time (binormal
    scores), and the size shrinks the detectable AUC towards 0.5."""
    from scipy.stats import norm

    from fdg_audit.metrics import membership as MM
    a = MM.min_detectable_auc(100, 100)
    assert 0.55 < a < 0.65 and MM.min_detectable_auc(500, 500) < a and MM.min_detectable_auc(1, 1) == 1.0
    rng = np.random.default_rng(6)
    crit = 0.5 + norm.ppf(0.95) * MM.hanley_mcneil_se(0.5, 100, 100)
    y = np.r_[np.ones(100), np.zeros(100)].astype(int)
    hits = [S.Items("auc", rng.normal(0, 1, 200) + np.sqrt(2) * norm.ppf(a) * y, y).stat() > crit for _ in range(800)]
    assert 0.75 <= np.mean(hits) <= 0.85


def test_a_domain_the_victims_name_gives_is_vacuous(tmp_path):
    """Domain predictions of a single-domain victim: the known-victim baseline is 1.0, so a perfect attack is
    "vacuous", never a leak and never a Δ."""
    def dom(r):
        true = np.zeros(30, int)   # every row of the victim is from its own domain
        hit = lambda p: S.Items("balanced_acc", (p == true).astype(float), true, np.arange(30))  # noqa: E731
        return [("st", dict(victim="B", output="", metric="domain_balanced_acc", items=hit(true),
                            base_items=hit(np.zeros(30, int))))]
    cell, _ = _card(tmp_path, dom)
    for m in ("fedavg", "feddg"):
        r = cell[(m, "domain", "")]
        assert float(r["baseline"]) == 1.0 and r["reading"].startswith("vacuous") and r["diff_ref"] == ""


def test_a_count_read_off_its_own_message_is_sent_in_the_clear(tmp_path):
    """A dataset size read off the ``n_samples`` message is "sent in the clear" (the protocol gives it away, no
    attack needed), never a leak and never a Δ; the same attack's estimate from the weights is a finding."""
    def size(r):
        art = "n_samples" if r["method"] == "feddg" else "weights"
        err = np.array([0.0]) if art == "n_samples" else np.array([0.05])
        one = lambda v, victim: S.Items("mean", v, ids=np.arange(1))  # noqa: E731
        return [("dataset_size", dict(victim=v, output="", metric="n_samples_rel_error", artifact=art,
                                      items=one(err, v), base_items=one(np.array([0.75]), v))) for v in "BC"]
    cell, root = _card(tmp_path, size)
    clear, found = cell[("feddg", "dataset_size", "")], cell[("fedavg", "dataset_size", "")]
    assert clear["artifact"] == "n_samples" and clear["reading"].startswith("sent in the clear")
    assert clear["diff_ref"] == "" and found["artifact"] == "weights" and found["reading"] == ""
    from fdg_audit.report import model, tables
    states = {c.id.split(".")[1]: c.state for c in model.build(tables.load([root])).cells if c.harm == "dataset_size"}
    assert states["feddg"] == "sent in the clear" and states["fedavg"] == "leak", states


@pytest.mark.usefixtures("psnr_headline")
def test_a_claim_that_held_in_some_runs_says_in_how_many(tmp_path):
    """runs_clear counts the runs whose own value beats their own baseline; page one writes "k above baseline"
    beside the run count exactly when some but not all did (FedDG: one run of six below its baseline)."""
    from fdg_audit.report import model, pageone, tables
    low = lambda r: r["method"] == "feddg" and r["seed"] == 0 and r["target"] == "A"  # noqa: E731
    cell, root = _card(tmp_path, lambda r: [("inv", _psnr(v, [12.0] * 4 if low(r) else [30.0] * 4, [15.0] * 4))
                                            for v in "BC"])
    assert cell[("feddg", "reconstruction", "")]["runs_clear"] == "5/6"
    assert cell[("fedavg", "reconstruction", "")]["runs_clear"] == "6/6"
    said = {c.group[1]: pageone.runs(c) for c in model.build(tables.load([root])).cells
            if c.harm == "reconstruction" and not c.channel}
    assert said == {"fedavg": "6 runs", "feddg": "6 runs, 5 above baseline"}, said


def test_outputs_declared_apart_get_their_own_row(tmp_path):
    """A fingerprint's exact copies compete in the membership row; its perturbed copies (``rows``) form a row of
    their own setting and never compete for the headline."""
    rng = np.random.default_rng(7)
    desc = dict(name="x:Y", adversary="server", aux=["candidates"], consumes=["weights"],
                outputs={"exact": "exact copies", "perturbed": "perturbed copies"}, priors={}, budget={}, knows=[],
                rows={"perturbed": "perturbed copies"})
    cell, _ = _card(tmp_path, lambda r: [("fp", _auc_row(v, 30, s, rng, output=o)) for v in "BC"
                                         for o, s in (("exact", 6.0), ("perturbed", 1.0))], attacks={"fp": desc})
    main, apart = cell[("feddg", "membership", "")], cell[("feddg", "membership", "perturbed copies")]
    assert float(main["value"]) > 0.99 and 0.65 < float(apart["value"]) < 0.9
    assert main["capabilities"] == apart["capabilities"] == "candidates"


def test_attacks_declare_their_threat_model_for_attacks_json():
    """Attack.threat resolves the declarations against the parameters: the budget an attack declares (iterations x
    restarts), none inferred from the names of its fields; the harness refuses a prior or capability outside the
    contract's vocabulary."""
    from dataclasses import dataclass

    from fdg_audit.api.attack import AttackParams
    from fdg_audit.errors import UserError
    from fdg_audit.audit.checks import _threat

    @dataclass
    class P(AttackParams):
        iterations: int = 30
        restarts: int = 3
        stages: list = None

    class A(Attack):
        name, consumes, Params = "a", ("weights",), P
        priors = {"*": "none"}
    assert A().threat() == dict(priors={"*": "none"}, budget={}, knows=[], rows={})   # fields named so: no budget
    A.budget = {"*": (("iterations",), "restarts")}
    assert A().threat()["budget"] == {"*": [30, 3]}
    A.budget = {"*": (("iterations", "stages"), "")}
    assert A(P(stages=[5, 7])).threat()["budget"] == {"*": [42, 1]}
    with pytest.raises(UserError, match="not in the priors"):
        _threat(dict(priors={"*": "psychic"}), "a")
    with pytest.raises(UserError, match="not in the priors"):
        _threat(dict(knows=["telepathy"]), "a")


def test_reconstruction_is_grouped_by_the_clients_data_size_with_intervals_in_range(tmp_path):
    """Runs whose data config gives clients fixed sizes: each reconstruction row joins the point of its victim's size
    (client "<domain>/<k>" holds client_sizes[k] images), averaged over runs with a t-interval cut to the metric's
    range; victims without a size (a whole domain, "pooled") stay out; an oracle output is flagged."""
    import json

    from fdg_audit.report import curves as CV
    from fdg_audit.report import tables as T
    from test_report import LEAK_FIELDS, fabricate, leak_row, write_csv
    root = fabricate(tmp_path / "r", extra=False)
    summary = json.loads((root / "summary.json").read_text())
    for r in summary["runs"]:
        r["data"] = {"client_sizes": [1, 64]}
    (root / "summary.json").write_text(json.dumps(summary))
    rng = np.random.default_rng(0)
    leak = []
    for r in summary["runs"]:
        if r["status"] == "ok":
            for out, small in (("main", rng.choice([0.9, 1.0])), ("gen", 1.0)):
                leak += [leak_row(r["run"], "pr", "weights", "B/0", 1, CV.HEADLINE, small, 0.0, output=out),
                         leak_row(r["run"], "pr", "weights", "B/1", 1, CV.HEADLINE, 0.0, 0.0, output=out),
                         leak_row(r["run"], "pr", "weights", "B/1", 1, "psnr", 30.0 + 5 * rng.random(), 12.0,
                                  output=out),
                         leak_row(r["run"], "pr", "weights", "B", 1, CV.HEADLINE, 0.5, 0.0, output=out)]
    write_csv(root / "leakage.csv", leak, LEAK_FIELDS)
    (root / "attacks.json").write_text(json.dumps({"pr": DESC}))
    res = T.load([root])
    rows = CV.by_size(res)
    pts = {(r["key"][1], r["output"], r["metric"], r["size"]): r for r in rows}
    assert {k[3] for k in pts} == {1, 64}                 # the whole-domain victim "B" has no size
    small, big = pts[("fedavg", "main", CV.HEADLINE, 1)], pts[("fedavg", "main", CV.HEADLINE, 64)]
    assert small["value"]["n"] == 6 and 0.9 <= small["value"]["mean"] <= 1.0   # 2 targets x 3 seeds
    assert 0.0 <= small["value"]["lo"] <= small["value"]["hi"] <= 1.0
    assert big["value"]["mean"] == 0.0 and small["budget"] == "400x2" and small["prior"] == "none"
    assert pts[("fedavg", "gen", CV.HEADLINE, 1)]["oracle"] and not small["oracle"]
    p = pts[("feddg", "main", "psnr", 64)]
    assert 30 <= p["value"]["mean"] <= 35 and p["baseline"]["mean"] == 12.0 and p["value"]["hi"] <= 60.0
    md = "\n".join(CV.curve_md(res, rows, ["size_curve_digits.png"]))
    assert "| 1 images | 64 images |" in md and "oracle: upper bound" in md and "plots/size_curve_digits.png" in md


@pytest.mark.usefixtures("psnr_headline")
def test_an_artifact_outside_every_mechanism_gets_its_own_row_at_its_own_epsilon(tmp_path):
    """Client-level DP covers the weights (epsilon 8) but not FedDG's amplitude bank: the bank's reconstruction is
    a row of its own at epsilon inf, and the weights' row, which fails, stays at epsilon 8 instead of borrowing the
    bank's leak (the strongest output of both would be the bank's on every run)."""
    rng = np.random.default_rng(3)
    dp = [dict(party="B", mechanism="client_dp", round=2, adversary="server", headline="True", covers="weights delta",
               epsilon=8.0, delta=1e-5)]
    per_run = lambda r: [("ui", _psnr("B", rng.normal(8, 1, 20), rng.normal(12, 1, 20)))] + (   # noqa: E731
        [("pr", _psnr("B", rng.normal(40, 2, 20), rng.normal(12, 1, 20)) | dict(artifact="amplitude_bank"))]
        if r["method"] == "feddg" else [])
    cell, _ = _card(tmp_path, per_run, privacy=dp)
    bank, weights = cell[("feddg", "reconstruction", "amplitude_bank outside DP")], cell[("feddg", "reconstruction", "")]
    assert bank["epsilon"] == "inf" and float(bank["value"]) > 35 and bank["artifact"] == "amplitude_bank"
    assert weights["epsilon"] == "8" and weights["reading"] == "no reconstruction at this budget"
    assert weights["artifact"] == "weights" and cell[("fedavg", "reconstruction", "")]["epsilon"] == "8"


def test_calls_are_firm_below_0_01_and_from_0_1_within_the_margin():
    """Holm-adjusted p below 0.01: distinguishable; in [0.01, 0.1): borderline (not a firm claim); from 0.1 on: not
    distinguishable only when the 95% interval holds 0 and lies inside ±margin, else inconclusive (a wide interval is
    no evidence of equality); below 3 runs: not testable whatever p is; no margin (no metric): never the firm "not
    distinguishable"."""
    narrow = (-0.05, 0.05)
    assert [S.call(p, 5, *narrow, 0.1) for p in (0.0, 0.0099, 0.01, 0.065, 0.0999, 0.1, 0.5)] == \
        ["distinguishable"] * 2 + ["borderline"] * 3 + ["not distinguishable"] * 2
    assert S.call(0.5, 5, -0.05, 0.12, 0.1) == "inconclusive" and S.call(0.15, 5, -0.60, -0.25, 0.1) == "inconclusive"
    assert S.call(0.15, 5, -0.07, -0.03, 0.1) == "inconclusive"         # small, but 0 left out: may turn significant
    assert S.call(0.5, 5, *narrow) == "inconclusive"                      # no margin given
    assert S.call(0.001, 2, *narrow, 0.1) == "not testable" and S.call(float("nan"), 5, *narrow, 0.1) == "not testable"
    comps = [dict(p=0.004, n=5, lo=0.1, hi=0.3, metric="reid"), dict(p=0.02, n=5, lo=0.0, hi=0.2, metric="reid"),
             dict(p=0.2, n=5, lo=-0.05, hi=0.05, metric="reid"),
             dict(p=0.3, n=5, lo=-0.05, hi=0.05, metric="target_acc"),
             dict(p=0.4, n=5, lo=-0.01, hi=0.01, metric="target_acc")]   # Holm: 0.02, 0.08, 0.6, 0.6, 0.6
    assert [c["call"] for c in S.holm_calls(comps)] == \
        ["borderline", "borderline", "not distinguishable", "inconclusive", "not distinguishable"]
    # the flip of issue 32's replicate check: a large, one-signed difference whose Holm p is 0.15 is not a firm "equal"
    rng = np.random.default_rng(3)
    c = S.compare(rng.normal(-0.43, 0.1, 5), metric="label_acc")
    assert c["hi"] < -0.1 and S.holm_calls([c] + [dict(p=0.001, n=5, lo=0, hi=0, metric="")] * 150)[0]["call"] in \
        ("distinguishable", "borderline", "inconclusive")


# ---------------------------------------------------------------- PSNR beside re-identification; Δ within range

def _reid_runs(tmp_path, per_run):
    """A hand-made folder whose every run saves ``per_run(run) -> ([items-file row], [leakage.csv row])`` for the
    attack "ui" on the weights; returns (root, Results)."""
    import json

    from fdg_audit.report import tables as T
    from fdg_audit.store.runfolder import RunFolder
    from test_report import LEAK_FIELDS, fabricate, write_csv
    root = fabricate(tmp_path / "r", acc=lambda m, v, t, s: 0.5, extra=False)
    leak = []
    for r in json.loads((root / "summary.json").read_text())["runs"]:
        if r["status"] == "ok":
            items, rows = per_run(r)
            RunFolder(root).save_items("ui", r["run"], [dict(run=r["run"], attack="ui", adversary="server",
                                                             artifact="weights", round=0, status="ok", output="main")
                                                        | x for x in items])
            leak += rows
    write_csv(root / "leakage.csv", leak, LEAK_FIELDS)
    return root, T.load([root])


def _mean(metric, victim, x, b, output="main"):
    ids = np.arange(len(x))
    return dict(victim=victim, metric=metric, output=output, items=S.Items("mean", np.asarray(x, float), ids=ids),
                base_items=S.Items("mean", np.asarray(b, float), ids=ids))


def test_a_reid_cell_shows_the_same_attacks_psnr_success_shares_and_cpu_beside_it(tmp_path):
    """Output "b" re-identifies (90%) at about 24 dB, output "c" (5%) at 12 dB; "b" is chosen on held-out halves.
    The cell's PSNR companions are b's own on the held-out images of every run (aligned PSNR and its baseline,
    shares at >= 20 / >= 25 dB), its CPU seconds b's cost row (mean over runs, c's differ), and "also" says them."""
    from test_report import leak_row

    from fdg_audit.report import scorecard as SC
    from fdg_audit.report.verdict import side
    rng = np.random.default_rng(5)
    truth = {}

    def per_run(r):
        items, rows = [], []
        for o, rate, level, cpu in (("b", 0.9, 24.0, 3.0 + r["seed"]), ("c", 0.05, 12.0, 50.0)):
            x, b = rng.normal(level, 3, 40), rng.normal(11, 1, 40)
            truth[(r["run"], o)] = x, b
            items += [_mean("reid", "B", rng.uniform(size=40) < rate, np.full(40, 0.01), o),
                      _mean("psnr", "B", x, b, o), _mean("success@20dB", "B", x >= 20, b >= 20, o),
                      _mean("success@25dB", "B", x >= 25, b >= 25, o)]
            rows.append(leak_row(r["run"], "ui", "weights", "B", 0, "cpu_seconds", cpu, float("nan"), output=o))
        return items, rows
    root, res = _reid_runs(tmp_path, per_run)
    card = SC.scorecard(res)
    md = __import__("fdg_audit.report", fromlist=["write_report"]).write_report([root], tmp_path / "out").read_text()
    g = ("digits", "feddg", "")
    sel = SC.selections(res)[(g, "reconstruction", "server", "")]
    assert {s["chosen"]["output"] for s in sel.values()} == {"b"} and len(sel) == 6
    held = {run: s["items"].ids for run, s in sel.items()}
    want = lambda f: np.mean([f(*truth[(run, "b")], ids) for run, ids in held.items()])  # noqa: E731
    row = next(r for r in card if r["method"] == "feddg" and r["harm"] == "reconstruction" and not r["setting"])
    assert float(row["psnr"]) == pytest.approx(want(lambda x, b, i: x[i].mean()), rel=1e-4)
    assert float(row["baseline_psnr"]) == pytest.approx(want(lambda x, b, i: b[i].mean()), rel=1e-4)
    assert float(row["success_20dB"]) == pytest.approx(want(lambda x, b, i: (x[i] >= 20).mean()), rel=1e-4)
    assert float(row["success_25dB"]) == pytest.approx(want(lambda x, b, i: (x[i] >= 25).mean()), rel=1e-4)
    assert float(row["psnr_ci_low"]) < float(row["psnr"]) < float(row["psnr_ci_high"]) <= 60
    assert float(row["cpu_seconds"]) == pytest.approx(4.0)            # b's 3, 4 and 5 s over seeds, never c's 50
    also = side(row)
    assert also.startswith(f"aligned PSNR {float(row['psnr']):.1f} [") and \
        f"(baseline {float(row['baseline_psnr']):.1f} dB)" in also
    assert f">= 20 dB: {float(row['success_20dB']):.2f} [" in also and ">= 25 dB: " in also
    assert also.endswith("4 CPU s per victim")
    assert also.replace(">=", "\\>=") in md.split("## Appendix")[1]          # the verdict's line says it


def test_delta_intervals_stay_within_the_range_of_a_difference(tmp_path):
    """Re-identification rates of 0 or 1 per run, in opposite runs for the two methods (the same attack, both beyond
    the baseline): the Student-t interval of the paired Δ reaches beyond ±1, which no difference of two rates can;
    the scorecard and comparisons.csv cut it to [-1, 1]."""
    import csv

    from fdg_audit.report import scorecard as SC
    from fdg_audit.report import write_report
    up = lambda r: (r["seed"] + (r["target"] == "A")) % 2 == (r["method"] == "feddg")  # noqa: E731
    root, res = _reid_runs(tmp_path, lambda r: ([_mean("reid", "B", np.full(40, float(up(r))), np.full(40, 0.01))],
                                                []))
    runs = sorted((r["target"], r["seed"]) for r in res.ok if r["method"] == "feddg")
    d = [1.0 if up(dict(target=t, seed=s, method="feddg")) else -1.0 for t, s in runs]
    raw = S.compare(d, strata=[t for t, _ in runs])
    assert raw["lo"] < -1 and raw["hi"] > 1                            # what an uncut interval says
    write_report([root], tmp_path / "out")
    with open(tmp_path / "out" / "scorecard.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["harm"] == "reconstruction" and r["method"] == "feddg"]
    with open(tmp_path / "out" / "comparisons.csv", newline="") as f:
        (c,) = [r for r in csv.DictReader(f) if r["harm"] == "reconstruction"]
    assert {r["setting"] for r in rows} == {""}                       # one row, one comparison
    for lo, hi, v in [(r["diff_ref_ci_low"], r["diff_ref_ci_high"], r["diff_ref"]) for r in rows] + \
            [(c["lo"], c["hi"], c["diff"])]:
        assert float(lo) == -1.0 and float(hi) == 1.0 and float(v) == pytest.approx(raw["mean"], abs=1e-9)
    assert SC.cut_diff(dict(lo=-3.0, hi=0.5), "auc") == dict(lo=-1.0, hi=0.5)
    assert SC.cut_diff(dict(lo=-99.0, hi=99.0), "psnr") == dict(lo=-60.0, hi=60.0)


def test_a_membership_cell_shows_its_spread_over_victims_against_each_victims_own_baseline():
    """Per-victim AUCs of the output a cell chose: median and range, and how many victims' own 95% interval clears
    their own baseline (max(0.5, blind AUC)): D's interval clears 0.5 but not its blind baseline 0.65. Another
    output's victims and the victim-pooled row stay out."""
    from fdg_audit.report import cells as C
    row = lambda v, m, x, b, out="": dict(run="R", attack="mia", artifact="weights", output=out, round=2,  # noqa: E731
                                          victim=v, metric=m, value=x, baseline=b)
    leak = []
    for v, a, lo, b in (("B", 0.9, 0.8, 0.5), ("C", 0.55, 0.45, 0.5), ("D", 0.7, 0.6, 0.65), ("pooled", 0.99, 0.98, 0.5)):
        leak += [row(v, "auc", a, b), row(v, "auc_ci_low", lo, b)]
    leak += [row("E", "auc", 1.0, 0.5, "other"), row("E", "auc_ci_low", 0.99, 0.5, "other")]
    sel = {"R": dict(parts=[(dict(attack="mia", artifact="weights", output="", round=2), False)])}
    got = C.spread(sel, C.victim_index(leak))
    assert float(got["victim_auc_median"]) == pytest.approx(0.7) and float(got["victim_auc_min"]) == 0.55
    assert float(got["victim_auc_max"]) == 0.9 and got["victims_clear"] == "1/3"
    # two outputs chosen in the run (one per half): each victim counts once, its AUC averaged over them, and it
    # clears only if it clears under both (B and C do not; E, in the other output only, does)
    leak += [row("B", "auc", 0.7, 0.5, "other"), row("B", "auc_ci_low", 0.45, 0.5, "other"),
             row("C", "auc", 0.65, 0.5, "other"), row("C", "auc_ci_low", 0.55, 0.5, "other")]
    sel["R"]["parts"].append((dict(attack="mia", artifact="weights", output="other", round=2), True))
    got = C.spread(sel, C.victim_index(leak))
    assert got["victims_clear"] == "1/4" and float(got["victim_auc_max"]) == pytest.approx(1.0)   # E alone clears
    assert float(got["victim_auc_min"]) == pytest.approx(0.6)            # C: (0.55 + 0.65) / 2


def test_tied_outputs_count_each_image_once():
    """Tied outputs' items (the same images) merge by id into one value per image: the mean is that of the per-image
    means, and the count is the number of images, not images x outputs; AUC scores stay side by side."""
    ids = np.arange(6)
    a, b = S.Items("mean", np.ones(6), ids=ids), S.Items("mean", np.zeros(6), ids=ids)
    m = S.merge([a, b])
    assert len(m) == 6 and np.allclose(m.x, 0.5) and m.stat() == pytest.approx(0.5)
    assert len(S.merge([a.sub(ids < 3), b.sub(ids >= 3)])) == 6              # disjoint halves: every item kept
    auc = S.Items("auc", np.arange(4.0), y=np.array([0, 1, 0, 1]), ids=np.arange(4))
    assert len(S.merge([auc, auc])) == 8


def test_differences_without_spread_get_the_exact_sign_flip_p_not_zero():
    """Three runs that all differ by +0.75 gave a zero-width interval and p = 0 (the t-test divides by a zero
    spread), so Holm called them distinguishable; the exact sign-flip p of 3 pairs is 2/8, and the call is not firm.
    With spread, the t-test's p stays."""
    flat = S.compare([0.75, 0.75, 0.75], metric="reid")
    assert flat["p"] == pytest.approx(0.25) and flat["call"] != "distinguishable"
    spread = S.compare([0.7, 0.75, 0.8, 0.72, 0.78], metric="reid")
    assert spread["p"] == pytest.approx(S.t_test_p([0.7, 0.75, 0.8, 0.72, 0.78])) and spread["p"] < 0.001


def test_a_cell_chooses_the_channel_that_adds_most_to_its_free_guess_not_the_highest_raw_rate():
    """Two channels of one method: update inversion of whole-domain weights re-identifies 0.55 of images where its
    matched chance is 0.85 (noise picks the best of 240 images), phase retrieval of the bank 0.50 where chance is
    0.01. The cell reports the bank (what the attack adds over a free guess), with the bank's own baseline, not the
    weights' higher raw rate; a candidate without a per-item baseline keeps the choice on raw values."""
    from fdg_audit.report import select as SEL
    rng = np.random.default_rng(7)
    per_run = {}
    for run in ("r0", "r1", "r2"):
        ids = np.arange(40) + 100 * int(run[1])
        per_run[run] = [
            dict(attack=a, artifact=art, output="", metric="reid", round=1, ok=True,
                 items=S.Items("mean", (rng.random(40) < p).astype(float), ids=ids),
                 base=S.Items("mean", np.full(40, b), ids=ids))
            for a, art, p, b in (("update_inversion", "weights", 0.55, 0.85),
                                 ("amplitude_phase_retrieval", "amplitude_bank", 0.50, 0.01))]
    out = SEL._select(per_run, {})
    assert {o["chosen"]["artifact"] for o in out.values()} == {"amplitude_bank"}
    assert all(np.allclose(o["base"].x, 0.01) for o in out.values())
    for cs in per_run.values():   # no per-item baseline: the raw rates decide (the weights' 0.55 here)
        for c in cs:
            c["base"] = 0.5
    assert {o["chosen"]["artifact"] for o in SEL._select(per_run, {}).values()} == {"weights"}
