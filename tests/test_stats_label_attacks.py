"""BN-statistics domain inference, dataset size, label distribution, and the label-skew data option."""

import numpy as np
import pytest
import torch

from attacks.labels import LabelDistribution, estimate_counts, round_to_total
from attacks.stats import DatasetSize, NormStatsDomain
from fdg_audit.data import DataConfig, load_data
from fdg_audit.errors import UserError

from conftest import tiny_scenario

BASE = dict(data=dict(family="appearance", per_domain=100, domains=["grey", "colour", "inverted", "texture"],
                      label_skew=0.5, targets=["grey"]), train=dict(lr=0.05))


from conftest import leakage_rows as rows  # noqa: E402


def test_controls_pass():
    # each attack's controls by name: an attack whose control() returns [] (or drops one) fails here
    want = {"label_distribution": ["FedSGD one step", "FedAvg 4 steps"],
            "norm_stats_domain": ["three synthetic domains"], "dataset_size": ["BN step count"]}
    for atk in (LabelDistribution(), NormStatsDomain(), DatasetSize()):
        cs = atk.control()
        assert len(cs) == len(want[atk.name]) and all(c.name.startswith(w) for c, w in zip(cs, want[atk.name])), cs
        for c in cs:
            assert c.passed, (atk.name, c)


def test_label_skew_option_drops_classes_in_train_only_and_is_deterministic():
    plain = load_data(DataConfig(dataset="digits", family="appearance"))
    a = load_data(DataConfig(dataset="digits", family="appearance", label_skew=0.3))
    b = load_data(DataConfig(dataset="digits", family="appearance", label_skew=0.3))
    for dp, da, db in zip(plain.domains, a.domains, b.domains):
        assert np.array_equal(da.train.idx, db.train.idx) and torch.equal(da.val.y, dp.val.y)
        assert set(da.train.idx) <= set(dp.train.idx) and len(da.train.y) < len(dp.train.y)
    assert any((np.bincount(d.train.y.numpy(), minlength=10) == 0).any() for d in a.domains)
    with pytest.raises(UserError, match="label_skew"):
        load_data(DataConfig(dataset="digits", label_skew=-1.0))


def test_count_estimator_algebra():
    v = round_to_total(np.array([2.4, -1.0, 7.7, 0.3]), 10)
    assert v.sum() == 10 and (v >= 0).all() and np.array_equal(v, np.round(v))
    # T steps with the same per-step gradient g = (S - n_c)/n (every image seen T B / n times in total)
    n, T, lr, mu = 40, 5, 0.1, 0.9
    true = np.array([10, 0, 25, 5])
    q = torch.tensor([0.3, 0.2, 0.4, 0.1], dtype=torch.float64)
    g = (n * q - torch.as_tensor(true, dtype=torch.float64)) / n
    b0 = torch.zeros(4, dtype=torch.float64)
    assert np.array_equal(estimate_counts(b0, b0 - lr * T * g, q, q, n, T, lr), true)          # plain SGD
    w = sum((1 - mu ** (T - s + 1)) / (1 - mu) for s in range(1, T + 1))                        # heavy ball
    assert np.array_equal(estimate_counts(b0, b0 - lr * w * g, q, q, n, T, lr, momentum=mu), true)
    assert not np.array_equal(estimate_counts(b0, b0 - lr * w * g, q, q, n, T, lr), true)       # momentum matters


def test_bn_run_sizes_labels_and_domains(run_toml):
    root = run_toml(tiny_scenario(BASE, model=dict(norm="batch"),
                                  methods=[dict(name="fedavg"),
                                           dict(name="fedavg", label="uniform", weighting="uniform")],
                                  attacks=[dict(name="dataset_size"), dict(name="label_distribution"),
                                           dict(name="norm_stats_domain", shadow_batches=4)]))
    r = rows(root)
    size = {(x["method"], x["victim"]): x for x in r if x["metric"] == "n_samples_rel_error"}
    assert all(float(x["value"]) == 0.0 and x["output"] == "sent" for (m, _), x in size.items() if m == "fedavg")
    uni = [x for (m, _), x in size.items() if m == "uniform"]
    assert len(uni) == 3 and all(x["output"] == "bn_steps" for x in uni)
    data = load_data(DataConfig(dataset="digits", family="appearance", per_domain=100, label_skew=0.5))
    for x in uni:                                                       # within half a batch of the truth
        assert float(x["value"]) * len(data.domain(x["victim"]).train.y) <= 8 + 1e-9
    acc = [x for x in r if x["metric"] == "label_count_acc" and x["attack"] == "label_distribution"]
    assert len(acc) == 6
    assert np.mean([float(x["value"]) for x in acc]) > np.mean([float(x["baseline"]) for x in acc]) + 0.15
    dist = {(x["run"], x["victim"]): float(x["value"]) for x in r
            if x["metric"] == "label_dist_acc" and x["attack"] == "label_distribution"}
    sent = [x for x in acc if x["method"] == "fedavg"]   # n sent: the totals agree, so the two scores agree
    assert len(dist) == 6 and len(sent) == 3
    assert all(dist[(x["run"], x["victim"])] == pytest.approx(float(x["value"])) for x in sent)
    dom = [x for x in r if x["attack"] == "norm_stats_domain"]
    assert len(dom) == 6 and all(x["metric"] == "domain_balanced_acc" for x in dom)


def test_group_norm_run_skips_bn_attack_and_estimates_size_from_the_update(run_toml):
    root = run_toml(tiny_scenario(BASE, model=dict(norm="group"), methods=[dict(name="fedavg", weighting="uniform")],
                                  attacks=[dict(name="dataset_size", max_steps=40), dict(name="norm_stats_domain")]))
    r = rows(root)
    assert all(x["status"].startswith("skipped") for x in r if x["attack"] == "norm_stats_domain")
    size = [x for x in r if x["attack"] == "dataset_size"]
    assert len(size) == 3 and all(x["output"] == "update_norm" and np.isfinite(float(x["value"])) for x in size)


def test_label_distribution_score_does_not_charge_a_size_error_twice():
    """label_dist_acc scores the class proportions: an estimate with the right proportions but twice the
    victim's size keeps label_dist_acc = 1 (the size error is dataset_size's), while label_count_acc drops."""
    from fdg_audit.api.attack import Aux, Estimate
    from fdg_audit.audit.scoring import Truth, score
    data = load_data(DataConfig(dataset="digits", family="appearance", per_domain=100, domains=["grey", "colour"]))
    truth = Truth.__new__(Truth)
    truth.data = data
    y = data.domain("colour").train.y.numpy()
    counts = np.bincount(y, minlength=10)
    rows = {r["metric"]: r for r in score(Estimate("colour", "weights", 1, "label_counts", 2.0 * counts), truth, {},
                                          Aux(num_classes=10, domains=["grey", "colour"]))[0]}
    assert rows["label_dist_acc"]["value"] == pytest.approx(1.0)
    assert rows["label_count_acc"]["value"] == pytest.approx(0.5)
    assert rows["label_dist_acc"]["baseline"] == pytest.approx(rows["label_count_acc"]["baseline"])
    assert rows["label_dist_acc"]["baseline"] < 1
