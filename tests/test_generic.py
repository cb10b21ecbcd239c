"""The generic attack (attacks/generic.py): every kind a client uploads gets linkability, decoder and attribute
cells, FedLowFreq's new kind (tests/fedlowfreq, a plugin written from methods/README.md) included, and FedDG's bank
is linked to its images well above chance."""
import csv
import re

import numpy as np
import torch

from attacks.generic import arrays_of, link_scores, per_image
from fdg_audit.audit.coverage import coverage_markdown
from fdg_audit.bus import Payload
from conftest import leakage_rows, tiny_scenario


def test_rows_that_follow_the_image_count_are_per_image_and_exact_copies_link_first():
    rng = np.random.default_rng(0)
    arts = [{"amp": rng.random((n, 3)), "mean": rng.random(4)} for n in (4, 2, 4)]
    assert per_image(arts, [4, 2, 4]) == ["amp"]
    assert per_image(arts, [4, 4, 4][:1] * 3) == []          # one size only: nothing can be told apart
    bank = torch.tensor(rng.random((5, 3)))
    singles = [Payload({"amp": bank[i:i + 1]}) for i in range(5)] + \
              [Payload({"amp": torch.tensor(rng.random((1, 3)))}) for _ in range(5)]
    s = link_scores(arrays_of(Payload({"amp": bank})), singles, ["amp"])
    assert s[:5].min() > s[5:].max()
    # an aggregate: a member's class row moves the observed row toward it; compared on the entries it fills
    obs = {"cls": np.array([[1.0, 1.0], [0.0, 0.0]])}
    near, far = Payload({"cls": torch.tensor([[1.1, 0.9], [0.0, 0.0]])}), Payload({"cls": torch.tensor([[3.0, 3.0],
                                                                                                      [0.0, 0.0]])})
    s = link_scores(obs, [near, far], [])
    assert s[0] > s[1]


def test_every_uploaded_kind_is_attacked_fedlowfreq_included(run_toml, one_thread):
    """FedAvg, FedDG and FedLowFreq with the generic attack: a link, decoder and domain cell for FedLowFreq's own
    kind and for FedDG's bank (linked to its images: AUC near 1), with baselines, and the controls passed."""
    text = tiny_scenario(
        data=dict(per_domain=60), train=dict(rounds=1, batch_size=8),
        methods=[{"name": "fedavg"}, {"name": "feddg"}, {"name": "fedlowfreq:FedLowFreq", "label": "fedlowfreq"}],
        attacks=[{"name": "generic_artifact", "pairs": 8, "max_size": 8, "steps": 60}])
    root = run_toml(text)
    rows = leakage_rows(root, attack="generic_artifact")
    assert rows and all(r["status"] == "ok" for r in rows), {r["status"] for r in rows}
    low = [r for r in rows if r["artifact"] == "class_lowfreq_amplitude"]
    assert {"auc", "blind_auc", "reid", "domain_balanced_acc"} <= {r["metric"] for r in low}
    for r in low:
        if r["metric"] in ("auc", "reid"):
            assert r["baseline"] != "" and 0.0 <= float(r["value"]) <= 1.0
    bank = [float(r["value"]) for r in rows if r["artifact"] == "amplitude_bank" and r["metric"] == "auc"
            and r["victim"] != "pooled"]
    assert bank and min(bank) >= 0.9
    kinds = {r["artifact"] for r in rows}
    assert not {"weights", "n_samples"} & kinds     # model states and sizes are left to the weight and size attacks
    # coverage.csv: every kind sent has a row; the strongest measurement, or "not attacked" and why
    with open(root / "coverage.csv") as f:
        cov = {(r["method"], r["kind"]): r for r in csv.DictReader(f)}
    assert cov[("fedlowfreq", "class_lowfreq_amplitude")]["status"] == "measured"
    assert cov[("fedlowfreq", "class_lowfreq_amplitude")]["attack"] == "generic_artifact"
    bank_cov = cov[("feddg", "amplitude_bank")]   # measured, its strongest output above its baseline
    assert bank_cov["status"] == "measured" and float(bank_cov["value"]) > float(bank_cov["baseline"])
    assert cov[("fedavg", "weights")]["status"].startswith("not attacked: generic_artifact leaves it out")
    md = coverage_markdown(root)
    assert "| fedavg | weights | client+server | **NOT ATTACKED**: generic_artifact leaves it out" in md
    assert re.search(r"\| fedlowfreq \| class_lowfreq_amplitude \| client[^|]* \| generic_artifact", md), md


def test_the_plan_says_who_reads_each_kind_and_warns_for_a_kind_nobody_reads(run_toml, capsys):
    run_toml(tiny_scenario(methods=[{"name": "fedlowfreq:FedLowFreq", "label": "fedlowfreq"}],
                           attacks=[{"name": "dataset_size"}]))
    err = capsys.readouterr().err
    assert "method fedlowfreq sends 'class_lowfreq_amplitude' and no attack of this plan reads it" in err
    assert "'n_samples' and no attack" not in err
