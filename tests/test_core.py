"""Core testbed: codec, bus + ledger, engines, seeding, scenario config, CLI errors, FedAvg."""
import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fdg_audit.api.method import MethodPlugin
from fdg_audit.bus import Bus, decode, encode
from fdg_audit.errors import UserError
from fdg_audit.store.ledger import Ledger
from fdg_audit.models import ModelConfig, build_model
from fdg_audit.runner import plan
from fdg_audit.scenario import load_raw
from methods.fedavg import FedAvg, FedAvgServer

from conftest import tiny_scenario

CORE = dict(name="tiny", data=dict(per_domain=80, domains=None), train=dict(rounds=2, lr=0.05))   # default domains
TINY = tiny_scenario(CORE)


def keys(root, run=None):
    return [(e.run, e.round, e.phase, e.sender, e.receiver, e.kind, e.wire_bytes, e.sha256)
            for e in Ledger.open(root).envelopes if run is None or e.run == run]


def test_codec_roundtrip_is_exact_and_deterministic():
    arrays = {"w": torch.randn(3, 4), "i": torch.arange(5), "d": np.eye(2), "b": torch.tensor([True, False])}
    data = encode(arrays, {"n": 7, "name": "x"})
    assert data == encode(arrays, {"name": "x", "n": 7})
    p = decode(data)
    assert p.scalars == {"n": 7, "name": "x"}
    for k, v in arrays.items():
        v = torch.as_tensor(v)
        assert p[k].dtype == v.dtype and p[k].shape == v.shape and torch.equal(p[k], v)
    header_bytes = len(data) - sum(torch.as_tensor(v).numel() * torch.as_tensor(v).element_size()
                                   for v in arrays.values())
    assert 0 < header_bytes < 400


def test_bus_broadcast_records_one_envelope_per_receiver(tmp_path):
    led = Ledger(tmp_path)
    bus = Bus(led, "r", "m")
    got = bus.broadcast("train", "server", ["a", "b", "c"], "weights", {"w": torch.ones(2)})
    assert set(got) == {"a", "b", "c"} and len(led.envelopes) == 3
    assert len({e.sha256 for e in led.envelopes}) == 1 and [e.receiver for e in led.envelopes] == ["a", "b", "c"]
    got["a"].arrays["w"] += 1  # receivers get copies: mutating one changes nothing else
    assert torch.equal(got["b"].arrays["w"], torch.ones(2))
    with pytest.raises(ValueError, match="unknown artifact kind"):
        bus.send("x", "a", "server", "not_a_kind", {})


def test_process_engine_ledger_equals_in_process(run_toml):
    a = run_toml(TINY, "threads=1")  # workers use one thread each: compare at the same thread count
    b = run_toml(TINY, "engine='process'", "threads=1")
    assert len(keys(a)) > 0 and keys(a) == keys(b)
    sa, sb = (json.loads((r / "summary.json").read_text())["runs"][0] for r in (a, b))
    assert sa["target_acc"] == sb["target_acc"]


def test_same_seed_same_ledger_other_seed_differs(run_toml):
    a, b, c = run_toml(TINY), run_toml(TINY), run_toml(TINY, "seeds=[1]")
    assert keys(a) == keys(b)
    wa = [k[-1] for k in keys(a) if k[5] == "weights"]
    wc = [k[-1] for k in keys(c) if k[5] == "weights"]
    assert wa != wc


def test_payload_files_match_envelopes_and_ledger_reopens(run_toml):
    root = run_toml(TINY)
    led = Ledger.open(root)
    assert led.envelopes
    for e in led.envelopes:
        data = led.payload_path(e.sha256).read_bytes()
        assert len(data) == e.wire_bytes and hashlib.sha256(data).hexdigest() == e.sha256
        assert [a["name"] for a in e.arrays] == list(led.payload(e).arrays)


def test_selecting_a_runs_envelopes_equals_a_scan_and_follows_the_list():
    """Ledger.select(run=...) on an opened or in-memory ledger reads an index by run: the same envelopes in the same
    order as a scan of all, also after envelopes are appended or the list is replaced."""
    from fdg_audit.bus import Envelope
    from fdg_audit.store.ledger import MemoryLedger
    mk = lambda run, seq, kind="weights": Envelope(run, "fedavg", seq // 3, "fit", seq, "a", "server", kind,  # noqa: E731
                                                   [], [], 1, f"{run}{seq}")
    led = MemoryLedger()
    for i in range(12):
        led.append(mk(f"r{i % 3}", i, "n_samples" if i % 4 == 0 else "weights"), b"x")
    scan = lambda **m: [e for e in led.envelopes if all(getattr(e, k) == v for k, v in m.items())]  # noqa: E731
    for run in ("r0", "r1", "r2", "r9"):
        assert led.select(run=run) == scan(run=run)
        assert led.select(run=run, kind="weights") == scan(run=run, kind="weights")
    led.append(mk("r1", 12), b"x")                                   # appended after the index was built
    assert led.select(run="r1") == scan(run="r1") and led.select(run="r1")[-1].seq == 12
    led.envelopes = [mk("r5", 0)]                                    # a new list
    assert led.select(run="r5") == led.envelopes and led.select(run="r1") == []
    assert led.select(run=["r5", "r1"]) == led.envelopes             # 'any of': a scan, as before


def test_fedavg_wire_bytes_per_round(run_toml):
    root = run_toml(TINY)
    envs = Ledger.open(root).envelopes
    k = 5  # six rotated domains, one held out
    model = build_model(ModelConfig(arch="cnn_small"), 1, 10, 28)
    model_bytes = len(encode(model.state_dict()))
    n_bytes = len(encode({}, {"n": 64}))
    by_round = {}
    for e in envs:
        by_round[e.round] = by_round.get(e.round, 0) + e.wire_bytes
    assert by_round[0] == k * n_bytes and [e.kind for e in envs if e.round == 0] == ["n_samples"] * k
    for t in (1, 2):
        assert by_round[t] == 2 * k * model_bytes


def test_fedavg_averages_with_sample_weights():
    s = [{"w": torch.tensor([0.0, 2.0]), "n": torch.tensor(2)}, {"w": torch.tensor([4.0, 6.0]), "n": torch.tensor(5)}]
    from methods.fedavg import weighted_average
    out = weighted_average(s, [0.75, 0.25])
    assert torch.allclose(out["w"], torch.tensor([1.0, 3.0])) and out["n"].dtype == torch.int64 and out["n"] == 3


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fdg_audit", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


@pytest.mark.parametrize("text,needle", [
    (tiny_scenario(CORE, train=dict(roundz=3)), "unknown key train.roundz: allowed keys are"),
    (tiny_scenario(CORE, data=dict(dataset="folder", root="/no/such/PACS")), "/no/such/PACS"),
    (tiny_scenario(CORE, methods=[dict(name="fedavgg")]), "fedavgg"),
    (tiny_scenario(CORE, model=dict(width=3)), "unknown key model.width"),
    (tiny_scenario(CORE, train=dict(optimizer="adamw")), "optimizer = 'adamw'"),
    (tiny_scenario(CORE, train=dict(rounds=0)), "rounds = 0"),
])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, text, needle):
    """The first case through ``python -m fdg_audit`` (the process's exit code and stderr), the others through the
    same ``main`` in this process (a fresh interpreter per case costs seconds each)."""
    f = tmp_path / "bad.toml"
    f.write_text(text)
    argv = ["scenario", str(f), "--out", str(tmp_path / "runs"), "--quiet"]
    if "roundz" in needle:
        r = cli(*argv)
        code, err = r.returncode, r.stderr
    else:
        from fdg_audit.cli import main
        code, err = main(argv), capsys.readouterr().err
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_plugin_lists_registered_names(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(tiny_scenario(CORE, methods=[dict(name="nope")]))
    with pytest.raises(UserError, match="registered name.*fedavg"):
        plan(load_raw(f))


def test_set_overrides_and_sweep_expansion(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(tiny_scenario(CORE, sweep={"methods.fedavg.lr": [0.1, 0.01]}))
    runs = plan(load_raw(f, ["seeds=[0, 1]", "data.targets=['rot0', 'rot15']", "methods.fedavg.batch_size=8"]))
    assert len(runs) == 2 * 2 * 2
    assert {r["params"].lr for r in runs} == {0.1, 0.01} and {r["params"].batch_size for r in runs} == {8}
    assert len({r["run_id"] for r in runs}) == 8
    with pytest.raises(UserError, match="no entry 'nope' in methods"):
        load_raw(f, ["methods.nope.lr=1"])


class Exploding(MethodPlugin):
    """A method whose server fails in round 1: the runner must keep the other runs' results."""
    name, Params, Client, kinds = "exploding", FedAvg.Params, FedAvg.Client, FedAvg.kinds

    class Server(FedAvgServer):
        def step(self, t):
            raise RuntimeError("boom")


def test_failed_run_is_recorded_and_others_kept(tmp_path):
    from fdg_audit.runner import run_scenario
    f = tmp_path / "s.toml"
    f.write_text(tiny_scenario(CORE, methods=[dict(name="fedavg"), dict(name="tests.test_core:Exploding",
                                                                        label="exploding")]))
    with pytest.raises(RuntimeError, match="1 run\\(s\\) failed"):
        run_scenario(str(f), out=str(tmp_path / "runs"), quiet=True)
    root = next((tmp_path / "runs" / "tiny").iterdir())
    runs = {r["method"]: r for r in json.loads((root / "summary.json").read_text())["runs"]}
    assert runs["fedavg"]["status"] == "ok" and runs["exploding"]["status"] == "failed"
    assert "boom" in runs["exploding"]["error"]
    assert "rotated/fedavg/rot0/s0" in (root / "metrics.csv").read_text()


def test_fedavg_beats_single_source_on_held_out_domain(run_toml):
    """FedAvg over five rotated sources beats the average single-source model on the held-out rot30."""
    base = tiny_scenario(CORE, data=dict(per_domain=None), train=dict(rounds=6, local_epochs=2))
    acc = lambda r: json.loads((r / "summary.json").read_text())["runs"][0]["target_acc"]
    fed = acc(run_toml(base, "data.targets=['rot30']", "train.lr=0.02"))
    single = [acc(run_toml(base, "data.targets=['rot30']", "train.lr=0.02", f"data.domains=['rot30', '{s}']"))
              for s in ("rot0", "rot15", "rot45", "rot60", "rot75")]
    assert fed > np.mean(single) + 0.1


def test_attack_seeds_attack_some_runs_and_train_all(run_toml):
    """``attack_seeds``: every seed trains (the accuracy comparisons pair them all), the attacks read only the runs
    of these seeds unless an attack names its own; a list naming no trained seed is one line before any training,
    ``--set seeds=[..]`` keeps those of them it trains, and the preview keeps its one seed attacked."""
    from conftest import leakage_rows
    from fdg_audit.runner import preview_of
    from fdg_audit.scenario import parse
    text = tiny_scenario(seeds=[0, 1, 2, 3], attack_seeds=[1], data=dict(seeds=[1, 2, 3, 7]),
                         attacks=[dict(name="dataset_size"), dict(name="label_distribution", seeds=[2])])
    root = run_toml(text)
    runs = json.loads((root / "summary.json").read_text())["runs"]
    assert sorted(int(r["seed"]) for r in runs) == [1, 2, 3]   # the data set's seeds of those the scenario trains
    seeds = lambda attack: {r["seed"] for r in leakage_rows(root, attack=attack)}  # noqa: E731
    assert seeds("dataset_size") == {"1"} and seeds("label_distribution") == {"2"}
    # payloads are kept for the seeds an attack reads; seed 3 trains for accuracy only: its envelopes are recorded,
    # its payloads not (one it shares byte for byte with an attacked run, e.g. a data size, is in the store anyway)
    envs = [json.loads(line) for line in (root / "messages.jsonl").read_text().splitlines()]
    seed_of = lambda e: int(e["run"].rsplit("/s", 1)[1])  # noqa: E731
    kept = {e["sha256"] for e in envs if seed_of(e) != 3}
    assert all(e["stored"] for e in envs if seed_of(e) != 3)
    own = [e for e in envs if seed_of(e) == 3 and e["sha256"] not in kept]
    assert own and not any(e["stored"] for e in own)
    with pytest.raises(UserError, match=r"datasets\[1\].seeds = \[5\] names none of this scenario's seeds"):
        parse(dict(seeds=[0, 1], datasets=[dict(label="a"), dict(label="b", seeds=[5])]))
    with pytest.raises(UserError, match=r"attack_seeds = \[3\] names none of this scenario's seeds"):
        run_toml(tiny_scenario(seeds=[0, 1], attack_seeds=[3]), name="bad")
    assert not (root.parent.parent / "bad").exists()
    raw = preview_of(dict(seeds=[4, 5], attack_seeds=[5], attacks=[dict(name="dataset_size")],
                          datasets=[dict(label="a", seeds=[5]), dict(label="b")]))
    assert parse(raw).attacks[0].params["seeds"] == [4] and raw["seeds"] == [4]
    assert [d.seeds for d in parse(raw).datasets] == [[4], []]   # the preview's one seed trains every data set
    assert parse(dict(seeds=[0, 2], attack_seeds=[0, 1], attacks=[dict(name="dataset_size")])).attacks[0].params == \
        {"seeds": [0]}
