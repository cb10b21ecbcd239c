"""Plan-time help around the generic attack: the cost guard, the short form of attacks = "all" with --set exclude,
and the one-line errors of issue 50 (a [data] typo named as data, a plugin name's advice)."""
import pytest

from fdg_audit.api import UserError
from fdg_audit.scenario import load_raw, parse
from conftest import tiny_scenario
from test_trust import copy, root  # noqa: F401  (fixtures: a finished run folder and a copy)


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
    described = check_attacks(runs[0]["sc"].attacks)
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


def test_new_method_and_new_attack_write_packages_that_work(tmp_path, monkeypatch, capsys, one_thread):
    """The skeletons: files with their entry point, a method that runs a round sending only what it declares, an
    attack whose controls pass; a bad or taken name is one line."""
    import sys
    from fdg_audit.cli import main
    from fdg_audit.data import DataConfig, load_data
    from fdg_audit.models import ModelConfig
    from fdg_audit.store.ledger import MemoryLedger
    from fdg_audit.train.federation import RunSpec, run_federation
    monkeypatch.chdir(tmp_path)
    assert main(["new-method", "zz_method"]) == 0 and main(["new-attack", "zz_attack"]) == 0
    assert 'zz_method = "zz_method:ZzMethod"' in (tmp_path / "zz_method" / "pyproject.toml").read_text()
    assert (tmp_path / "zz_attack" / "tests" / "test_zz_attack.py").exists()
    assert main(["new-method", "zz_method"]) == 2 and main(["new-method", "Bad-Name"]) == 2
    assert "already exists" in capsys.readouterr().err
    monkeypatch.syspath_prepend(str(tmp_path / "zz_method" / "src"))
    monkeypatch.syspath_prepend(str(tmp_path / "zz_attack" / "src"))
    from zz_attack import ZzAttack
    from zz_method import KIND, ZzMethod
    cfg = DataConfig(dataset="digits", per_domain=24, domains=["rot0", "rot15", "rot30"])
    led = MemoryLedger()
    run_federation(RunSpec("c/zz/rot0/s0", "zz_method:ZzMethod", ZzMethod.Params(rounds=1, batch_size=8), cfg,
                           ModelConfig(), "rot0"), led, load_data(cfg))
    assert KIND in {e.kind for e in led.envelopes} <= set(ZzMethod.kinds)
    assert all(c.passed for c in ZzAttack().control())
    sys.modules.pop("zz_method", None), sys.modules.pop("zz_attack", None)


def test_started_from_the_clone_without_its_dependencies_is_one_line():
    """``python -m fdg_audit`` from the clone's folder before installing (here: no site-packages, so no dependency)
    ended in an ImportError traceback; now one line that says to install it, exit 2."""
    import subprocess
    import sys
    from pathlib import Path
    clone = Path(__import__("fdg_audit").__file__).parents[1]
    p = subprocess.run([sys.executable, "-S", "-m", "fdg_audit", "plugins"], cwd=clone, capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.startswith("error: fdg_audit cannot start") and "pip install" in p.stderr, p.stderr


def test_attack_says_that_report_md_is_not_updated(copy, capsys):  # noqa: F811
    """``attack`` re-scores a folder but leaves report.md as it was: its last line says so and names the command."""
    import shlex
    from fdg_audit.cli import main
    assert main(["attack", str(copy), "--attacks", "dataset_size", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"report.md not updated: python -m fdg_audit report {shlex.quote(str(copy))}" in out, out
