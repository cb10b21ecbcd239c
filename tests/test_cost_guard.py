"""The cost guard (runner.cost_guard, coverage.estimate): every attack the main job runs gets an estimate from its own
declared costs; an attack that declares none is named as not estimated, never counted as 0; a victim's cost follows
its local steps where the attack unrolls local training."""
import math

import pytest

from conftest import public_split, tiny_scenario
from fdg_audit.api.attack import Attack
from fdg_audit.audit.checks import check_attacks
from fdg_audit.errors import UserError
from fdg_audit.runner import cost_guard
from fdg_audit.scenario import load_raw, plan

HERE = __name__


class Costless(Attack):
    """Reads the weights and declares no cost."""
    name, consumes, adversary = "costless", ("weights",), "server"

    def run(self, view, aux):
        return []


def _plan(tmp_path, text: str, sets=()):
    f = tmp_path / "s.toml"
    f.write_text(public_split(text))
    runs = plan(load_raw(f, list(sets)))
    return runs, check_attacks(runs[0]["sc"].attacks)


def test_every_attack_of_the_main_job_is_estimated(tmp_path, capsys):
    from pathlib import Path
    main_job = Path(__file__).parents[1] / "scenarios" / "feddg_vs_csac.toml"
    runs = plan(load_raw(main_job, ["seeds=[0]"]))
    described = check_attacks(runs[0]["sc"].attacks)
    est = cost_guard(runs, described, math.inf)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("attacks: about ") and "not estimated" not in line, line
    assert {"update_inversion", "update_inversion_domain", "amplitude_phase_retrieval", "generic_artifact",
            "mia_loss", "dataset_size"} <= set(est)
    assert all(s is not None and s > 0 for s in est.values()), est
    assert "feature_inversion" not in est   # reads a kind no method of the plan sends: no job, no estimate


def test_an_attack_without_a_cost_is_named_and_not_counted(tmp_path, capsys):
    runs, described = _plan(tmp_path, tiny_scenario(attacks=[{"name": "dataset_size"}, {"name": f"{HERE}:Costless"}]))
    est = cost_guard(runs, described, math.inf)
    label = f"{HERE}:Costless"
    assert est[label] is None and est["dataset_size"] > 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.endswith(f"not estimated (not in the total): {label}"), line
    with pytest.raises(UserError, match=r"over attack_budget_s = 0\.001 \(dearest: dataset_size \d+ s; not estimated "
                                        r"\(not in the total\): test_cost_guard:Costless\)"):
        cost_guard(runs, described, 0.001, quiet=True)


def test_a_victims_cost_follows_its_local_steps(tmp_path):
    """Update inversion unrolls the victim's local steps: batches of 8 (4 times the steps of one batch of 32 on these
    clients of 32 training images) cost more than twice as much, every other setting equal."""
    attack = [{"name": "update_inversion", "iterations": 1000, "restarts": 1, "max_images": 4}]
    one = cost_guard(*_plan(tmp_path, tiny_scenario(attacks=attack, train=dict(batch_size=32))), math.inf, quiet=True)
    four = cost_guard(*_plan(tmp_path, tiny_scenario(attacks=attack, train=dict(batch_size=8))), math.inf, quiet=True)
    assert four["update_inversion"] > 2 * one["update_inversion"], (one, four)


def test_a_curious_clients_inversion_costs_its_modelled_parties_not_every_client(tmp_path):
    """A curious client inverts one aggregate per round, the other clients' mean modelled by at most max_parties
    virtual clients: with 10 clients per domain its estimate grows with max_parties and stays far below the
    server's inversion of every client (it was estimated as that once: 1,566 CPU min for a scenario that took 11)."""
    data = dict(clients_per_domain=10, per_domain=80)
    def est(**kw):
        attack = [dict(name="update_inversion", iterations=200, restarts=1, max_images=4, **kw)]
        (folder := tmp_path / str(kw)).mkdir()
        got = cost_guard(*_plan(folder, tiny_scenario(attacks=attack, data=data)), math.inf, quiet=True)
        return got["update_inversion"]
    server, one, four = est(), est(adversary_view="client", max_parties=1), est(adversary_view="client", max_parties=4)
    assert one < four < server / 4, (one, four, server)


def test_time_left_follows_estimated_costs(monkeypatch):
    """The attack phase's time left comes from the estimates of the jobs left (scaled by measured / estimated so far),
    not from the job count: one 900 s job after nine jobs estimated at 10 s that took 20 s each is about
    1800 s left, not 20 s; an unestimated job counts as a mean estimated one; without estimates the count rules."""
    import fdg_audit.progress as P
    from fdg_audit.audit.harness import _weights
    clock = [0.0]
    monkeypatch.setattr(P.time, "perf_counter", lambda: clock[0])
    chosen = {f"r{i}": ["cheap"] for i in range(9)} | {"r9": ["dear"]}
    atks = [("cheap", None, None), ("dear", None, None)]
    w = _weights(chosen, atks, {"cheap": 90.0, "dear": 900.0})
    assert w == [10.0] * 9 + [900.0]
    cases = ((w, "30m00s"), (None, "20s"), (_weights(chosen, atks, {"cheap": 90.0, "dear": None}), "20s"))
    for weights, want in cases:   # the count-based line said "about 20s left" in the first case too
        clock[0] = 0.0
        eta = P.Eta("attack jobs", 10, weights)
        for _ in range(9):
            clock[0] += 20.0   # measured twice the estimate: the 900 s job is about 1800 s left
            line = eta.tick()
        assert line.endswith(f"about {want} left"), line
