"""An attack parameter's path from the scenario to its use (fdg_audit/vocab.py ``AttackParams``: 4 hops): the
[[attacks]] table reaches the worker's job spec as written, the worker and the harness build the attack with one
function (``worker.build``), and an out-of-range value is one line before any run."""
import pytest

from conftest import tiny_scenario
from fdg_audit.audit import checks, harness, worker
from fdg_audit.errors import UserError
from fdg_audit.runner import run_scenario
from fdg_audit.scenario import load_raw, parse
from fdg_audit.vocab import AttackEntry

TABLE = {"name": "update_inversion", "label": "ui", "iterations": 7, "restarts": 1, "max_victims": 1}


def _scenario(tmp_path, table: dict):
    f = tmp_path / "s.toml"
    f.write_text(tiny_scenario(attacks=[table]))
    return f


def test_the_table_reaches_the_worker_as_written(tmp_path, monkeypatch):
    """Hops 1-2: parse gives the entry; the job spec the probe worker gets (before training) holds the table's
    params unchanged: no step between fills defaults, renames or re-checks them."""
    f = _scenario(tmp_path, TABLE)
    entry = parse(load_raw(f)).attacks[0]
    want = {k: v for k, v in TABLE.items() if k not in ("name", "label")}
    assert entry == AttackEntry("update_inversion", "ui", want)
    jobs = []

    def probe(job, outputs):
        jobs.append(job)
        raise UserError("stop after the probe")
    monkeypatch.setattr(checks, "run_isolated", probe)
    checks._DESCRIBED.clear()
    with pytest.raises(UserError, match="stop after the probe"):
        run_scenario(str(f), out=str(tmp_path / "runs"), quiet=True)
    assert [(j["attack"], j["label"], j["params"], j["mode"]) for j in jobs] == \
        [("update_inversion", "ui", want, "describe")]
    assert not (tmp_path / "runs").exists()   # nothing trained


def test_the_worker_and_the_harness_build_an_attack_alike():
    """Hop 3: the worker's ``build`` is what the harness uses in process (``make_attack``, and ``salted`` per
    run): the same Params from the same job, the run's seed salting only ``seed``."""
    label, atk, job = checks.make_attack(TABLE, "cpu")
    assert (label, job["params"]) == ("ui", {k: v for k, v in TABLE.items() if k not in ("name", "label")})
    built = worker.build(job)
    assert type(built) is type(atk) and built.p == atk.p and atk.p.iterations == 7
    run_atk, run_job = harness.salted(atk, job, 3)
    assert run_job["params"] == job["params"] and run_job["salt"] == 3
    assert run_atk.p == worker.build(run_job).p
    assert run_atk.p.seed != atk.p.seed and {**vars(run_atk.p), "seed": 0} == {**vars(atk.p), "seed": 0}


@pytest.mark.parametrize("key,value,words", [("iterations", 0, "iterations"),
                                             ("max_victims", -1, "attacks.ui.max_victims = -1"),
                                             ("iterations", "many", "attacks.ui.iterations")])
def test_an_out_of_range_value_is_one_line_before_any_run(tmp_path, key, value, words):
    """A plugin's own field (iterations, checked by the attack) and a shared one (max_victims, by AttackParams),
    each refused from the probe worker in one line naming it, and nothing trained; the in-process build gives the
    same line."""
    f = _scenario(tmp_path, {**TABLE, key: value})
    checks._DESCRIBED.clear()
    with pytest.raises(UserError) as e:
        run_scenario(str(f), out=str(tmp_path / "runs"), quiet=True)
    msg = str(e.value)
    assert words in msg and "\n" not in msg
    assert not (tmp_path / "runs").exists()
    with pytest.raises(UserError) as local:
        checks.make_attack({**TABLE, key: value}, "cpu")
    assert str(local.value) == msg
