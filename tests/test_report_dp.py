"""The report's privacy section (fdg_audit/report/dp.py) on synthetic scorecard and privacy.csv rows."""
import math

import pytest

from fdg_audit.report.dp import dp_section, lines_of, stream_shares

CLIENT = lambda sigma: {"client": {"clip": 1.0, "noise_multiplier": sigma, "mode": "local"}}  # noqa: E731
AUDIT = {"client": {"clip": 1.0, "noise_multiplier": 1.0, "mode": "local"}, "audit": {"canaries": 64}}
DPSGD_BANK = {"dp_sgd": True, "noise_multiplier": 1.0, "artifacts": {"amplitude_bank": {"clip": 50.0}}}


def run(label, plugin, privacy=None, sweep=None):
    """A summary.json run entry: the lines come from its plugin and privacy config, never from its label."""
    return dict(run=f"rotated/{label}/t/s0", status="ok", dataset="rotated", method=label, variant="", plugin=plugin,
                privacy=privacy or {}, sweep=sweep or {})


def card(method, eps, harm, value, metric="acc"):
    return dict(dataset="rotated", method=method, variant="", epsilon=eps, harm=harm, adversary="server",
                metric=metric, value=value, ci_low=value - 0.05, ci_high=value + 0.05, baseline=0.1)


def priv(run, party, mech, rnd, eps, adjacency=""):
    return dict(run=run, party=party, mechanism=mech, round=rnd, epsilon=eps, adjacency=adjacency)


RUNS = [run("a", "fedavg"), run("a_lo", "fedavg", CLIENT(1.0)), run("a_hi", "fedavg", CLIENT(2.0)),
        run("b", "csac"), run("b_lo", "csac", CLIENT(1.0)), run("b_check", "csac", AUDIT),
        run("d", "feddg", DPSGD_BANK)]


def test_lines_follow_plugin_and_mechanisms_and_keep_canary_runs_apart():
    lines = lines_of(RUNS + [run("c", "feddg"), run("e", "ccst"), run("a_lr", "fedavg", CLIENT(1.0), {"train.lr": 0.5})])
    g = lambda label: ("rotated", label, "")  # noqa: E731
    avg = "fedavg (client-level DP (local))"
    assert lines[g("a_lo")] == lines[g("a_hi")] == lines[g("a")] == [avg]      # budgets on one line; no DP at ∞
    assert lines[g("b")] == lines[g("b_lo")] == ["csac (client-level DP (local))"]
    assert lines[g("b_check")] == ["csac (client-level DP (local)) + audit canaries"]   # canaries perturb training
    assert lines[g("d")] == ["feddg (DP-SGD, noise on amplitude_bank)"] and lines[g("c")] == lines[g("d")]
    assert lines[g("e")] == ["ccst"]                                              # no DP run: a line of its own
    assert lines[g("a_lr")] == ["fedavg [lr=0.5] (client-level DP (local))"]       # another sweep value


def test_section_plots_each_harm_against_epsilon_and_lists_stream_shares(tmp_path):
    rows = [card(m, e, "accuracy", v) for m, e, v in (("a", "inf", 0.9), ("a_lo", 7.9, 0.5), ("a_hi", 1.9, 0.2),
                                                      ("b", "inf", 0.8), ("b_lo", 8.0, 0.4), ("b_check", 8.0, 0.1))]
    rows += [card("a", "inf", "membership", 0.7, "auc"), card("a_hi", 1.9, "membership", 0.5, "auc")]
    prows = [priv("r/d/t/s0", "a", "dp_sgd", 1, 3.0, "one example (add/remove)"),
             priv("r/d/t/s0", "a", "dp_sgd", 2, 4.0, "one example (add/remove)"),
             priv("r/d/t/s0", "b", "dp_sgd", 2, 4.5, "one example (add/remove)"),
             priv("r/d/t/s0", "a", "gaussian_rows:amplitude_bank", 0, 1.0, "one example (zero-out)"),
             priv("r/d/t/s0", "a", "total", 2, 5.0), priv("r/d/t/s0", "b", "total", 2, 5.5),
             priv("r/a_lo/t/s0", "a", "client_dp", 2, 7.9)]
    lines = dp_section(rows, RUNS, prows, tmp_path / "plots")
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["dp_rotated_accuracy_server_acc.png", "dp_rotated_membership_server_auc.png"]
    assert all((tmp_path / "plots" / p).stat().st_size > 5000 for p in pngs)
    assert sum(line.startswith("![") for line in lines) == 2
    table = [line for line in lines if line.startswith("| r/")]
    assert table == ["| r/d/t/s0 | dp_sgd | one example (add/remove) | 4.50 | 5.50 | 0.82 |",
                     "| r/d/t/s0 | gaussian_rows:amplitude_bank | one example (zero-out) | 1.00 | 5.50 | 0.18 |"]


def test_kinds_outside_every_mechanism_are_listed(tmp_path):
    ev = dict(mechanism="client_dp", epsilon=7.9)
    envs = [dict(run="r/a_lo", sender="a", kind="weights", filters=[ev]),
            dict(run="r/a_lo", sender="a", kind="amplitude_bank", filters=[]),
            dict(run="r/a_lo", sender="server", kind="amplitude_bank", filters=[]),
            dict(run="r/a", sender="a", kind="amplitude_bank", filters=[])]     # no mechanism at all: not listed
    lines = dp_section([card("a_lo", 7.9, "accuracy", 0.5)], RUNS, [], tmp_path / "plots", envs)
    assert "| r/a_lo | amplitude_bank |" in lines and not any(line.startswith("| r/a |") for line in lines)


def test_no_section_without_finite_epsilon(tmp_path):
    assert dp_section([card("a", "inf", "accuracy", 0.9)], RUNS, [], tmp_path) == []
    # only an audit run (e.g. a scenario whose every run carries canaries): drawn, on the canary line
    audit_only = dp_section([card("b_check", 8.0, "accuracy", 0.1)], RUNS, [], tmp_path)
    assert sum(line.startswith("![") for line in audit_only) == 1
    assert stream_shares([priv("r", "a", "client_dp", 1, 2.0)]) == []


def test_lines_group_a_methods_budgets(tmp_path, monkeypatch):
    import fdg_audit.report.dp as dp
    seen = {}
    monkeypatch.setattr(dp, "_plot", lambda path, title, metric, lines, inf_x, finite, *_: seen.update(lines=lines,
                                                                                                   inf_x=inf_x))
    dp.dp_section([card("a", "inf", "accuracy", 0.9), card("a_lo", 8.0, "accuracy", 0.5),
                   card("a_hi", 2.0, "accuracy", 0.3), card("b_check", 8.0, "accuracy", 0.1)], RUNS, [], tmp_path)
    assert sorted(seen["lines"]) == ["csac (client-level DP (local)) + audit canaries",
                                     "fedavg (client-level DP (local))"]    # canary runs never join a clean line
    pts = sorted(seen["lines"]["fedavg (client-level DP (local))"])
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
