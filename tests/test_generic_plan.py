"""Plan-time help around the generic attack: the cost guard, the short form of attacks = "all" with --set exclude,
and the one-line errors of issue 50 (a [data] typo named as data, a plugin name's advice)."""
import pytest

from fdg_audit.api import UserError
from fdg_audit.scenario import load_raw, parse
from conftest import tiny_scenario


def test_set_exclude_works_on_the_short_form(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(tiny_scenario(attacks="all"))
    names = {a.name for a in parse(load_raw(f, ['attacks.all.exclude=["mia_lira", "mia_rmia"]'])).attacks}
    assert "mia_loss" in names and not {"mia_lira", "mia_rmia"} & names
    assert "mia_lira" in {a.name for a in parse(load_raw(f)).attacks}


def test_the_cost_guard_stops_over_budget_naming_the_knobs_and_yes_runs(run_toml, tmp_path):
    text = tiny_scenario(attack_budget_s=0.5, attacks=[{"name": "update_inversion", "iterations": 2, "restarts": 1,
                                                         "max_images": 1}])
    with pytest.raises(UserError, match=r"estimated at \d+ CPU s, over attack_budget_s = 0.5 \(dearest: "
                                        r"update_inversion .*iterations/restarts.*--yes"):
        run_toml(text)
    assert not (tmp_path / "runs").exists()       # nothing trained
    # --yes: the same plan passes the guard with the same estimate
    from fdg_audit.audit.checks import check_attacks
    from fdg_audit.runner import cost_guard
    from fdg_audit.scenario import plan
    f = tmp_path / "y.toml"
    f.write_text(text)
    runs = plan(load_raw(f))
    described = check_attacks([dict(name=a.name, label=a.label, **a.params) for a in runs[0]["sc"].attacks])
    est = cost_guard(runs, described, 0.5, yes=True, quiet=True)
    assert est["update_inversion"] > 0.5
    assert cost_guard(runs, described, 1e9, quiet=True) == est


def test_a_data_typo_is_named_as_data_and_plugin_names_get_install_advice(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(tiny_scenario(data=dict(per_domian=40)))
    with pytest.raises(UserError, match=r"data\.per_domian"):
        parse(load_raw(f))
    f.write_text(tiny_scenario(methods=[{"name": "my_new_method"}]))
    from fdg_audit.scenario import plan
    with pytest.raises(UserError, match=r"pip install -e <its folder>"):
        plan(load_raw(f))
