"""The attack framework: adversary views match envelopes, truth stays with the scorer, leakage.csv and controls,
re-running attacks on a finished run folder (API and ``python -m fdg_audit attack``)."""
import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fdg_audit.api.attack import AdversaryView, Attack, Aux, Control, Scores, Skipped
from fdg_audit.audit.harness import load_runs, run_attacks
from fdg_audit.audit.scoring import Truth
from fdg_audit.cli import main
from fdg_audit.data import DomainSet
from fdg_audit.errors import UserError
from fdg_audit.store.ledger import Ledger
from fdg_audit.runner import run_scenario

SEEN = []   # (view, aux) of every Spy.run call in this process

from conftest import leakage_rows as rows, tiny_scenario


class Spy(Attack):
    """Records what it is given; scores every candidate at random; skips one victim with a reason."""
    name = "spy"
    consumes = ("weights",)
    adversary = "client"
    aux = ("public", "domain_samples", "candidates")

    def run(self, view, aux):
        SEEN.append((view, aux))
        rng = np.random.default_rng(0)
        victims = [c for c in view.clients if c != view.me]
        outs = [Scores(v, "weights", 1, rng.random(len(aux.candidates[v]))) for v in victims]
        return outs + [Skipped(victims[0], "weights", 1, "nothing to invert")]


class CandidatesOnly(Spy):
    aux = ("candidates",)


class WeakAttack(Spy):
    """Its positive control fails: it could not find leakage even where there is some."""
    def control(self):
        return [Control("planted member found", "auc", 0.55, 0.9)]


class SpuriousAttack(Spy):
    """Its negative control fails: it 'finds' leakage in data that has none."""
    def control(self):
        return [Control("non-members vs non-members", "auc", 0.4, 0.1, positive=False),
                Control("planted member found", "auc", 1.0, 0.9)]


class CrashingAttack(Spy):
    def run(self, view, aux):
        raise RuntimeError("boom")


class BadAux(Spy):
    aux = ("shadow_runs",)


# written out (not tiny_scenario): test_trust.py edits this text line by line
SCENARIO = """
name = "fw"
threads = 1
report = false
[data]
dataset = "digits"
family = "rotated"
domains = ["rot0", "rot15", "rot30", "rot45"]
per_domain = 40
targets = ["rot45"]
[model]
arch = "cnn_small"
[train]
rounds = 2
batch_size = 32
[[methods]]
name = "fedavg"
"""
HERE = __name__


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    out = tmp_path_factory.mktemp("fw")
    (out / "s.toml").write_text(SCENARIO)
    return run_scenario(str(out / "s.toml"), out=str(out / "runs"), quiet=True)


def view_of(root, adversary, me):
    run = next(iter(load_runs(Path(root))[0].values()))
    return run, AdversaryView(Ledger.open(root), run.protocol(), adversary, me, torch.device("cpu"))


# ------------------------------------------------------------------------------------------ views

def test_curious_client_sees_only_its_own_traffic(root):
    run, view = view_of(root, "client", "rot0")
    envs = [e for e in Ledger.open(root).envelopes if e.run == run.run]
    others = [e for e in envs if e.sender in ("rot15", "rot30")]
    assert others                                                     # other clients did upload ...
    got = [m.env for m in view.messages()]
    assert got == [e for e in envs if "rot0" in (e.sender, e.receiver)]   # ... but only its own traffic is seen
    assert not any(m.sender in ("rot15", "rot30") or m.receiver in ("rot15", "rot30") for m in view.messages())
    assert {m.sender for m in view.messages(kind="weights")} == {"server", "rot0"}
    assert all(m.receiver == "rot0" for m in view.messages(sender="server"))
    assert view.messages(kind="weights", sender=["rot15", "rot30"]) == []


def test_server_and_eavesdropper_views_match_envelopes(root):
    run, server = view_of(root, "server", "server")
    envs = [e for e in Ledger.open(root).envelopes if e.run == run.run]
    assert [m.env for m in server.messages()] == [e for e in envs if "server" in (e.sender, e.receiver)] == envs
    assert all("server" in (m.sender, m.receiver) for m in server.messages())   # no client-to-client traffic
    _, eve = view_of(root, "eavesdropper", "eavesdropper")
    assert [m.env for m in eve.messages()] == envs
    m = server.messages(kind="weights", sender="rot15", round=1)[0]
    net = server.model(m.payload.arrays)
    assert isinstance(net, torch.nn.Module) and not net.training


# ------------------------------------------------------------------------------------------ truth stays out

def test_ground_truth_never_reaches_the_attack(root):
    SEEN.clear()   # in-process (debugging) mode, so that SEEN fills; tests/test_trust.py covers the worker process
    run_attacks(root, [{"name": f"{HERE}:Spy"}, {"name": f"{HERE}:CandidatesOnly"}], quiet=True, isolate=False)
    (view, aux), (_, only) = SEEN
    assert {f.name for f in dataclasses.fields(Aux)} == {"public", "domain_samples", "candidates", "num_classes",
                                                         "domains", "layout"}          # no membership field exists
    for obj in (view, aux):
        for v in vars(obj).values():
            assert not isinstance(v, (Truth, DomainSet, Ledger)), type(v)
    for pool in aux.candidates.values():   # ids are pool positions: global ids would reveal the train/val split
        assert np.array_equal(pool.idx, np.arange(len(pool)))
    data = next(iter(load_runs(Path(root))[1].values()))
    source_train = set(np.concatenate([d.train.idx for d in data.domains if d.name != "rot45"]))
    assert len(aux.public) == 40 and not set(aux.public.idx) & source_train     # public = held-out domain only
    for d in aux.domains:                                                # public samples are never training data
        assert not set(aux.domain_samples[d].idx) & source_train
    assert sorted(aux.domain_samples) == aux.domains == ["rot0", "rot15", "rot30"] and aux.num_classes == 10
    assert only.public is None and only.domain_samples == {} and only.candidates    # only what was declared
    assert only.layout == {}
    assert view.me == "rot0" and view.clients == ["rot0", "rot15", "rot30"] and view.shape == (1, 28, 10)
    assert isinstance(view.params, dict) and view.params["rounds"] == 2         # the public protocol


# ------------------------------------------------------------------------------------------ leakage.csv

def test_leakage_csv_columns_pooling_and_skips(root):
    run_attacks(root, [{"name": f"{HERE}:Spy"}], quiet=True)
    with open(Path(root) / "leakage.csv") as f:
        header = next(csv.reader(f))
    for col in ("run", "method", "attack", "adversary", "artifact", "round", "victim", "output", "metric", "value",
                "baseline", "status"):
        assert col in header
    spy = rows(root, attack="spy")
    assert {r["victim"] for r in spy} == {"rot15", "rot30", "pooled"}
    assert {r["method"] for r in spy} == {"fedavg"} and {r["adversary"] for r in spy} == {"rot0"}
    auc = rows(root, attack="spy", victim="rot15", metric="auc")[0]
    blind = float(rows(root, attack="spy", victim="rot15", metric="blind_auc")[0]["value"])   # the folder's own draw
    assert float(auc["baseline"]) == max(0.5, blind) and 0 <= float(auc["value"]) <= 1 and auc["status"] == "ok"
    n = len(rows(root, attack="spy", victim="rot15", metric="skipped"))
    assert n == 1 and rows(root, attack="spy", metric="skipped")[0]["status"] == "skipped: nothing to invert"
    # 4 candidates per victim cannot resolve 1% FPR; pooled over two victims still cannot (nan), 0% always can
    assert np.isnan(float(rows(root, attack="spy", victim="rot15", metric="tpr@0.01fpr")[0]["value"]))
    assert not np.isnan(float(rows(root, attack="spy", victim="pooled", metric="tpr@0fpr")[0]["value"]))


@pytest.mark.parametrize("cls", ["WeakAttack", "SpuriousAttack"])
def test_a_failed_control_makes_numbers_not_measurable(root, cls):
    run_attacks(root, [{"name": f"{HERE}:Spy"}, {"name": f"{HERE}:{cls}", "label": "broken"}], quiet=True)
    broken = rows(root, attack="broken")
    assert broken and all(r["status"] == "not measurable (control failed)" for r in broken if r["metric"] == "auc")
    assert all(r["status"] == "ok" for r in rows(root, attack="spy", metric="auc"))
    ctl = [c for c in json.loads((Path(root) / "controls.json").read_text()) if c["attack"] == "broken"]
    assert not all(c["passed"] for c in ctl)


def test_rerunning_keeps_other_attacks_and_records_crashes(root):
    run_attacks(root, [{"name": f"{HERE}:Spy"}], quiet=True)
    n = len(rows(root, attack="spy"))
    run_attacks(root, [{"name": f"{HERE}:CrashingAttack", "label": "crash"}], quiet=True)
    assert len(rows(root, attack="spy")) == n                      # replaced per attack label, never duplicated
    (r,) = rows(root, attack="crash")
    assert r["metric"] == "failed" and r["status"] == "failed: RuntimeError: boom"
    run_attacks(root, [{"name": f"{HERE}:Spy", "as_client": "rot45"}], quiet=True)   # the held-out domain
    assert [r["status"] for r in rows(root, attack="spy")] == ["skipped: rot45 is not a client of this run"]


def test_user_errors_are_one_line(root, capsys):
    for cfg, msg in (({"name": "no_such_attack"}, "neither a registered name"),
                     ({"name": f"{HERE}:Spy", "bogus": 1}, "unknown key attacks.spy.bogus"),
                     ({"name": f"{HERE}:BadAux"}, "aux ['shadow_runs'] unknown")):
        with pytest.raises(UserError, match=msg.replace("[", r"\[").replace("]", r"\]")) as e:
            run_attacks(root, [cfg], quiet=True)
        assert "\n" not in str(e.value)
    assert main(["attack", str(root), "--attacks", "no_such_attack"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: attack 'no_such_attack'") and err.count("\n") == 1


def test_cli_reruns_attacks_on_a_finished_run(root):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    (Path(root) / "leakage.csv").unlink(missing_ok=True)   # the attack writes it anew
    p = subprocess.run([sys.executable, "-m", "fdg_audit", "attack", str(root), "--attacks", f"{HERE}:Spy",
                        "--quiet"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().startswith(f"leakage: {Path(root) / 'leakage.csv'}; coverage: {Path(root) / 'coverage.csv'}")
    assert {r["victim"] for r in rows(root, attack="spy")} == {"rot15", "rot30", "pooled"}


def test_a_name_on_the_command_line_takes_the_folders_settings_for_it(root, tmp_path, capsys):
    """``attack RUN_DIR --attacks NAME`` runs NAME with the settings the folder's scenario gave it (here the curious
    client rot15 instead of the default first client), not with the attack's defaults."""
    import shutil
    copy = shutil.copytree(root, tmp_path / "copy")
    cfg = copy / "config.resolved.toml"
    cfg.write_text(cfg.read_text() + f'\n[[attacks]]\nname = "{HERE}:Spy"\nas_client = "rot15"\n')
    (copy / "leakage.csv").unlink(missing_ok=True)
    assert main(["attack", str(copy), "--attacks", f"{HERE}:Spy", "--quiet"]) == 0, capsys.readouterr().err
    assert {r["victim"] for r in rows(copy, attack=f"{HERE}:Spy")} == {"rot0", "rot30", "pooled"}


def test_attacking_a_finished_folder_reads_its_run_records_and_never_plans(root, monkeypatch, capsys):
    import fdg_audit.scenario as S
    def boom(*a, **k):
        raise AssertionError("the scenario was planned again")
    monkeypatch.setattr(S, "plan", boom)
    monkeypatch.setattr(S, "variants", boom)
    (Path(root) / "leakage.csv").unlink(missing_ok=True)
    assert main(["attack", str(root), "--attacks", f"{HERE}:Spy", "--quiet"]) == 0, capsys.readouterr().err
    assert {r["victim"] for r in rows(root, attack="spy")} == {"rot15", "rot30", "pooled"}
    described = json.loads((Path(root) / "attacks.json").read_text())["spy"]   # what the attack said of itself
    assert described["adversary"] == "client" and described["aux"] == ["public", "domain_samples", "candidates"]


def test_a_damaged_run_record_is_one_line(root, capsys, tmp_path):
    import shutil
    copy = shutil.copytree(root, tmp_path / "copy")
    s = json.loads((copy / "summary.json").read_text())
    s["runs"][0]["data"] = {}
    (copy / "summary.json").write_text(json.dumps(s))
    assert main(["attack", str(copy), "--attacks", f"{HERE}:Spy", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "has no data record" in err and err.count("\n") == 1
