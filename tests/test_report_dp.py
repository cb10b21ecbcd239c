"""The report's privacy section (fdg_audit/report/dp.py) on synthetic scorecard and privacy.csv rows."""
import math

import pytest

from fdg_audit.report.dp import dp_section, line_of, stream_shares


def card(method, eps, harm, value, metric="acc"):
    return dict(dataset="rotated", method=method, variant="", epsilon=eps, harm=harm, adversary="server",
                metric=metric, value=value, ci_low=value - 0.05, ci_high=value + 0.05, baseline=0.1)


def priv(run, party, mech, rnd, eps, adjacency=""):
    return dict(run=run, party=party, mechanism=mech, round=rnd, epsilon=eps, adjacency=adjacency)


def test_section_plots_each_harm_against_epsilon_and_lists_stream_shares(tmp_path):
    rows = [card(m, e, "accuracy", v) for m, e, v in (("fedavg", "inf", 0.9), ("fedavg_eps8", 7.9, 0.5),
                                                      ("fedavg_eps2", 1.9, 0.2), ("csac", "inf", 0.8),
                                                      ("csac_eps8", 8.0, 0.4), ("csac_eps8_audit", 8.0, 0.1))]
    rows += [card("fedavg", "inf", "membership", 0.7, "auc"), card("fedavg_eps2", 1.9, "membership", 0.5, "auc")]
    prows = [priv("r/feddg_dpsgd_bank/t/s0", "a", "dp_sgd", 1, 3.0, "one example (add/remove)"),
             priv("r/feddg_dpsgd_bank/t/s0", "a", "dp_sgd", 2, 4.0, "one example (add/remove)"),
             priv("r/feddg_dpsgd_bank/t/s0", "b", "dp_sgd", 2, 4.5, "one example (add/remove)"),
             priv("r/feddg_dpsgd_bank/t/s0", "a", "gaussian_rows:amplitude_bank", 0, 1.0, "one example (zero-out)"),
             priv("r/feddg_dpsgd_bank/t/s0", "a", "total", 2, 5.0), priv("r/feddg_dpsgd_bank/t/s0", "b", "total", 2, 5.5),
             priv("r/fedavg_eps8/t/s0", "a", "client_dp", 2, 7.9)]
    lines = dp_section(rows, prows, tmp_path / "plots")
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["dp_rotated_accuracy_server_acc.png", "dp_rotated_membership_server_auc.png"]
    assert all((tmp_path / "plots" / p).stat().st_size > 5000 for p in pngs)
    assert sum(line.startswith("![") for line in lines) == 2
    table = [line for line in lines if line.startswith("| r/")]
    assert table == ["| r/feddg_dpsgd_bank/t/s0 | dp_sgd | one example (add/remove) | 4.50 | 5.50 | 0.82 |",
                     "| r/feddg_dpsgd_bank/t/s0 | gaussian_rows:amplitude_bank | one example (zero-out) | 1.00 | 5.50 | 0.18 |"]
    assert line_of("fedavg_eps8") == line_of("fedavg_eps2") == "fedavg" and line_of("feddg_dpsgd_bank") == "feddg_dpsgd_bank"


def test_kinds_sent_outside_every_mechanism_are_listed(tmp_path):
    ev = dict(mechanism="client_dp", epsilon=7.9)
    envs = [dict(run="r/feddg_eps8", sender="a", kind="weights", filters=[ev]),
            dict(run="r/feddg_eps8", sender="a", kind="amplitude_bank", filters=[]),
            dict(run="r/feddg_eps8", sender="server", kind="amplitude_bank", filters=[]),
            dict(run="r/feddg", sender="a", kind="amplitude_bank", filters=[])]     # no mechanism at all: not listed
    lines = dp_section([card("feddg_eps8", 7.9, "accuracy", 0.5)], [], tmp_path / "plots", envs)
    assert "| r/feddg_eps8 | amplitude_bank |" in lines and not any(line.startswith("| r/feddg |") for line in lines)


def test_no_section_without_finite_epsilon(tmp_path):
    assert dp_section([card("fedavg", "inf", "accuracy", 0.9)], [], tmp_path) == []
    assert stream_shares([priv("r", "a", "client_dp", 1, 2.0)]) == []


def test_lines_group_a_methods_budgets(tmp_path, monkeypatch):
    import fdg_audit.report.dp as dp
    seen = {}
    monkeypatch.setattr(dp, "_plot", lambda path, title, metric, lines, inf_x, finite: seen.update(lines=lines,
                                                                                                   inf_x=inf_x))
    dp.dp_section([card("fedavg", "inf", "accuracy", 0.9), card("fedavg_eps8", 8.0, "accuracy", 0.5),
                   card("fedavg_eps2", 2.0, "accuracy", 0.3)], [], tmp_path)
    pts = sorted(seen["lines"]["fedavg"])
    assert [p[0] for p in pts] == [2.0, 8.0, math.inf] and seen["inf_x"] == pytest.approx(32.0)


def test_report_md_carries_the_section_built_from_scorecard_rows(run_toml, tmp_path):
    """End to end: two tiny runs (no DP, client-level DP) -> report.md's ε section, plotted from scorecard.csv."""
    import csv

    from fdg_audit.report import write_report
    root = run_toml("""
        seeds = [0]
        report = false
        threads = 1
        [data]
        dataset = "digits"
        family = "rotated"
        domains = ["rot0", "rot15", "rot30"]
        targets = ["rot0"]
        per_domain = 16
        [train]
        rounds = 1
        local_steps = 1
        batch_size = 8
        [[methods]]
        name = "fedavg"
        [[methods]]
        name = "fedavg"
        label = "fedavg_eps8"
        privacy = { client = { clip = 0.5, noise_multiplier = 1.0 } }
        """)
    md = write_report([root], tmp_path / "rep").read_text()
    with open(tmp_path / "rep" / "scorecard.csv") as f:
        eps = {r["method"]: r["epsilon"] for r in csv.DictReader(f) if r["harm"] == "accuracy"}
    assert eps["fedavg"] == "inf" and 0 < float(eps["fedavg_eps8"]) < math.inf
    assert "## Privacy: accuracy and leakage against ε" in md
    assert "](plots/dp_rotated_accuracy" in md
    assert any(p.name.startswith("dp_rotated_accuracy") for p in (tmp_path / "rep" / "plots").glob("*.png"))
