"""FADA and the federation's target-client role: the target's labels never reach the bus or model selection, what
crosses the bus (representations = the public encode of the same round's upload), the dynamic-attention update,
participation < 1 and client-level DP, and the report's domain-adaptation label."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_scenario
from fdg_audit.api.method import Client, MethodPlugin, Reply, Server, TrainParams, load_arrays
from fdg_audit.bus import decode
from fdg_audit.data import DataConfig, Domain, Split, load_data
from fdg_audit.errors import UserError
from fdg_audit.train.federation import RunSpec, run_federation
from fdg_audit.store.ledger import Ledger, MemoryLedger
from fdg_audit.models import ModelConfig
from fdg_audit.report import headline
from fdg_audit.report import tables as T
from methods.fada import FADA, Params

CFG = DataConfig(dataset="digits", domains=["rot0", "rot15", "rot30"])
SOURCES, TARGET = ["rot0", "rot15"], "rot30"
P = dict(rounds=3, batch_size=32, lr=0.05)


def _run(data, method="fada", engine="local", **kw):
    led, truth = MemoryLedger(), {}
    params = Params(**{**P, **kw}) if method == "fada" else TrainParams(rounds=1)
    spec = RunSpec("t/fada", method, params, CFG, ModelConfig(), TARGET, engine=engine, workers=1)
    res = run_federation(spec, led, data, truth_sink=lambda run, c, name, arrs: truth.__setitem__((c, name), arrs))
    return led, res, truth


def _payload(led, e):
    return decode(led.raw(e))


def _relabel(data, f):
    """The data set with the target domain's labels replaced by f(y) (images unchanged)."""
    doms = [Domain(d.name, *(Split(s.x, f(s.y), s.idx) for s in (d.train, d.val))) if d.name == TARGET else d
            for d in data.domains]
    return dataclasses.replace(data, domains=doms)


@pytest.fixture(scope="module")
def data():
    return load_data(CFG)


@pytest.fixture(scope="module")
def base(data):
    return _run(data)


def test_target_labels_never_reach_the_ledger_or_model_selection(data, base):
    led, res, _ = base
    led2, res2, _ = _run(_relabel(data, lambda y: (y + 1) % 10))
    assert [(e.sender, e.receiver, e.kind, e.sha256) for e in led.envelopes] == \
        [(e.sender, e.receiver, e.kind, e.sha256) for e in led2.envelopes]        # every byte on the bus is the same
    sel = lambda r: (r["selected_round"], [h.get("source_val_acc") for h in r["history"]])  # noqa: E731
    assert sel(res) == sel(res2)                                                  # so is model selection
    assert res["target_acc"] != res2["target_acc"]                # the harness alone scores with the true labels
    assert res["adaptation"] and res["clients"] == SOURCES        # the target is a client, not a source
    up = {e.kind for e in led.envelopes if e.sender == TARGET}
    down = {e.kind for e in led.envelopes if e.receiver == TARGET}
    assert up == {"weights", "features", "metric"} and down == {"weights", "discriminator", "source_weights"}
    assert res["target_acc"] > 0.25                               # above chance (0.1) on tiny digits, 3 rounds


class ProbeClient(Client):
    def on_labels(self, msg):
        return Reply("metric", {"train": self.train.y, "val": self.val.y})


class ProbeServer(Server):
    def step(self, t):
        self.ask("labels", to=self.active + [self.target])


class LabelProbe(MethodPlugin):
    """A method that sends its clients' labels: the core must have masked the target's before building it."""
    name, Params, Server, Client, kinds, adaptation = "label_probe", TrainParams, ProbeServer, ProbeClient, \
        ("metric",), True


@pytest.mark.parametrize("engine", ["local", "process"])
def test_the_target_client_is_built_without_labels_on_every_engine(data, engine):
    led, res, _ = _run(data, method="test_fada:LabelProbe", engine=engine)
    got = {e.sender: _payload(led, e).arrays for e in led.envelopes}
    assert sorted(got) == sorted(SOURCES + [TARGET]) and res["clients"] == SOURCES
    assert all((got[TARGET][k] == -1).all() for k in ("train", "val"))
    assert len(got[TARGET]["train"]) == len(data.domain(TARGET).train.y)
    assert all((got[c]["train"] >= 0).all() for c in SOURCES)


def test_the_process_engine_records_the_same_ledger(one_thread):
    small = DataConfig(dataset="digits", domains=CFG.domains, per_domain=40)
    d = load_data(small)
    sig = lambda led: [(e.sender, e.receiver, e.kind, e.sha256) for e in led.envelopes]  # noqa: E731
    leds = [MemoryLedger(), MemoryLedger()]
    for led, engine in zip(leds, ("local", "process")):
        run_federation(RunSpec("t/e", "fada", Params(rounds=2, batch_size=16), small, ModelConfig(), TARGET,
                               engine=engine, workers=1), led, d)
    assert sig(leds[0]) == sig(leds[1]) and {e.kind for e in leds[0].envelopes} >= {"discriminator", "features"}


def test_features_are_the_public_encode_of_the_same_round_upload(data, base):
    led, _, truth = base
    party = SimpleNamespace(shape=(1, 28, 28, 10), model_cfg=ModelConfig(), device=torch.device("cpu"))
    net, p = FADA.build(party), Params(**P)
    names = set(net.state_dict())
    for e in led.envelopes:
        assert not any(a["name"].split("/")[-1].split(".")[0] in ("ds", "ci", "rec", "mine") for a in e.arrays)
        if e.kind == "weights":
            assert {a["name"] for a in e.arrays} == names
    for t in (1, 3):
        for c in SOURCES + [TARGET]:
            (f,) = [e for e in led.envelopes if (e.kind, e.sender, e.round) == ("features", c, t)]
            (w,) = [e for e in led.envelopes if (e.kind, e.sender, e.round) == ("weights", c, t)]
            assert f.receiver == "server"
            feats = _payload(led, f)["features"]
            assert feats.shape == (p.feature_batches * p.batch_size, net.feature_dim)
            tr = data.domain(c).train
            pos = {int(i): j for j, i in enumerate(tr.idx)}
            x = tr.x[[pos[int(i)] for i in truth[(c, f"features_r{t}")]["idx"]]]
            load_arrays(net, _payload(led, w).arrays)
            assert torch.allclose(FADA.encode(net, x), feats, atol=1e-5)
            assert torch.allclose(FADA.classify(net, feats), net.eval()(x), atol=1e-4)   # the head sees D_di(f)
    disc = [e for e in led.envelopes if e.kind == "discriminator"]
    assert {e.round for e in disc} == {2, 3}                      # a DI exists once features have arrived
    for e in disc:
        names = {a["name"] for a in e.arrays}
        assert names == ({f"{c}/{k}" for c in SOURCES for k in ("0.weight", "0.bias", "2.weight", "2.bias")}
                         if e.receiver == TARGET else {"0.weight", "0.bias", "2.weight", "2.bias"})


def test_dynamic_attention_update_of_the_target_model(base):
    led, _, _ = base
    p, last = Params(**P), {}
    pick = lambda **m: [_payload(led, e) for e in led.envelopes  # noqa: E731
                        if all(getattr(e, k) == v for k, v in m.items())]
    for t in (1, 2):
        (disp,) = pick(kind="metric", round=t)
        gain = torch.tensor([last.get(c, disp[c]) - disp[c] for c in SOURCES], dtype=torch.float64)
        last.update(disp.scalars)
        alpha = torch.softmax(gain / p.attention_temp, 0)
        (relay,) = pick(kind="source_weights", round=t)
        P0 = pick(kind="weights", sender="server", receiver=TARGET, round=t)[0].arrays
        P1 = pick(kind="weights", sender="server", receiver=TARGET, round=t + 1)[0].arrays
        ups = {c: pick(kind="weights", sender=c, round=t)[0].arrays for c in SOURCES + [TARGET]}
        for k, v in P0.items():
            assert all(torch.equal(relay.arrays[f"{c}/{k}"], ups[c][k]) for c in SOURCES)  # the relay is the uploads
            want = ups[TARGET][k].double() + sum(a * (ups[c][k].double() - v.double()) for c, a in zip(SOURCES, alpha))
            assert torch.allclose(P1[k].double(), want, atol=1e-5), (t, k)


def test_participation_client_dp_and_the_report_label(run_toml):
    root = run_toml(tiny_scenario(
        name=None, seeds=[0], model=None,
        data=dict(family=None, domains=["rot0", "rot15", "rot30", "rot45"], targets=["rot45"]),
        train=dict(rounds=2, batch_size=8, local_steps=2, participation=0.5),
        privacy=dict(client=dict(clip=1.0, noise_multiplier=0.5)), methods=[dict(name="fada", feature_batches=1)]))
    led = Ledger.open(root)
    for t in (1, 2):
        asked = {e.receiver for e in led.envelopes if (e.kind, e.sender, e.round) == ("weights", "server", t)}
        assert "rot45" in asked and len(asked) == 3                   # 2 of 3 sources, and the target every round
        ups = [e for e in led.envelopes if e.kind == "weights" and e.sender != "server" and e.round == t]
        assert len(ups) == 3 and all(any(f.get("mechanism") == "client_dp" for f in e.filters) for e in ups)
    (run,) = json.loads((root / "summary.json").read_text())["runs"]
    assert run["status"] == "ok" and run["adaptation"] is True
    note = T.adaptation_note(T.load([root]))
    assert T.ADAPTATION in note and note in headline(root)


def test_bad_settings_are_one_line_errors():
    for kw in (dict(source_adv="x"), dict(attention="x"), dict(attention_temp=0.0), dict(feature_batches=0)):
        with pytest.raises(UserError):
            Params(**kw)
