"""COPA, FedSR and FedGA: what each sends (from the ledger), and each method's core rule."""
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fdg_audit.bus import Payload
from fdg_audit.data import DataConfig, load_data
from fdg_audit.errors import UserError
from fdg_audit.seeding import run_seq as seed_sequence
from fdg_audit.store.ledger import Ledger
from fdg_audit.models import ModelConfig, build_model
from methods import copa, fedga, fedsr

from conftest import tiny_scenario

CLIENTS = ["rot0", "rot30", "rot60"]
COPA = dict(data=dict(domains=[*CLIENTS, "rot75"], targets=["rot75"]), train=dict(rounds=2, lr=0.05))


def scenario(*methods, engine="local"):
    """The tiny scenario with ``methods``: (name, label, {its settings}) each."""
    return tiny_scenario(COPA, engine=engine, methods=[dict(name=name, label=label, **(opts[0] if opts else {}))
                                                       for name, label, *opts in methods])


def runs(root):
    return {r["method"]: r for r in json.loads((root / "summary.json").read_text())["runs"]}


# ------------------------------------------------------------------------------------------ COPA

def test_copa_sends_every_head_to_every_client_and_averages_f(run_toml):
    root = run_toml(scenario(("methods.copa:COPA", "copa"), ("methods.copa:COPA", "noisy", dict(agg_noise=0.5))))
    led = Ledger.open(root)
    assert all(r["status"] == "ok" for r in runs(root).values())
    env = [e for e in led.envelopes if e.run.split("/")[1] == "copa"]
    assert {e.kind for e in env if e.sender != "server"} == {"weights", "head"}
    net = copa.build(_party(copa.Params()))
    f_keys = sorted(k for k in net.state_dict() if not k.startswith("head."))
    assert any("mean_logits" in k for k in f_keys)                                  # HBIN replaced the norms
    at = lambda t, **kw: [e for e in env if e.round == t and all(getattr(e, k) == v for k, v in kw.items())]  # noqa
    names = sorted(f"{c}/{k}" for c in CLIENTS for k in ("bias", "weight"))
    for t in (1, 2):
        down = at(t, phase="heads")
        assert sorted(e.receiver for e in down) == CLIENTS and {e.kind for e in down} == {"head"}
        for e in down:                                                              # own head AND the others'
            assert sorted(a["name"] for a in e.arrays) == names
        ups = {e.sender: led.payload(e).arrays for e in at(t, phase="train", receiver="server")}
        assert sorted(ups) == CLIENTS and all(sorted(u) == f_keys for u in ups.values())     # F only, no head
        heads = {e.sender: led.payload(e).arrays for e in at(t, kind="head", receiver="server")}
        assert sorted(heads) == CLIENTS and all(sorted(h) == ["bias", "weight"] for h in heads.values())
        if t == 1:
            up1, heads1 = ups, heads
    nxt = led.payload(at(2, phase="train", receiver="rot0")[0]).arrays
    for k in f_keys:                                                                # F_2 = uniform mean of the F_i
        want = sum(up1[c][k].double() for c in CLIENTS) / 3
        assert torch.allclose(nxt[k].double(), want.round() if "num_batches" in k else want, atol=1e-6), k
    relay = led.payload(at(2, phase="heads", receiver="rot30")[0]).arrays
    for c in CLIENTS:                                                               # heads relayed unchanged
        assert all(torch.equal(relay[f"{c}/{k}"], heads1[c][k]) for k in ("weight", "bias"))
    noisy = [e for e in led.envelopes if e.run.split("/")[1] == "noisy"]
    up = [led.payload(e).arrays for e in noisy if e.round == 1 and e.phase == "train" and e.sender != "server"]
    nxt = led.payload([e for e in noisy if e.round == 2 and e.phase == "train" and e.receiver == "rot0"][0]).arrays
    dev = nxt["neck.1.weight"] - sum(u["neck.1.weight"] for u in up) / 3
    assert 0.4 < dev.std().item() < 0.6                                             # white noise of std 0.5 on F
    assert torch.allclose(nxt["trunk.0.1.running_mean"], sum(u["trunk.0.1.running_mean"] for u in up) / 3, atol=1e-6)


def _party(params, cls=None, norm="group"):
    """A client of class ``cls`` on rot0, or (cls None) a bare object with what a model builder reads."""
    shape, cfg = (1, 28, 28, 10), ModelConfig(norm=norm)
    if cls is None:
        return SimpleNamespace(params=params, shape=shape, model_cfg=cfg, device=torch.device("cpu"))
    data = load_data(DataConfig(dataset="digits", domains=["rot0", "rot30", "rot60"], per_domain=40))
    return cls(dict(params=params, device="cpu", model_cfg=cfg, shape=shape, seedseq=seed_sequence(0, "unit"),
                    id="rot0", party=1, domain=data.domain("rot0")))


def test_copa_loss_trains_f_through_frozen_heads():
    torch.manual_seed(0)
    net = build_model(ModelConfig(), 1, 10, 28)
    x, xa, y = torch.rand(8, 1, 28, 28), torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    W, b = torch.randn(2, 10, net.feature_dim), torch.randn(2, 10)
    assert torch.allclose(copa.copa_loss(net, x, y, xa, W[:0], b[:0]), F.cross_entropy(net(x), y))
    f = net.features(xa)
    want = F.cross_entropy(net(x), y) + sum(F.cross_entropy(f @ W[j].T + b[j], y) for j in range(2))
    loss = copa.copa_loss(net, x, y, xa, W, b)
    assert torch.allclose(loss, want, atol=1e-5)
    loss.backward()
    g_head, g_trunk = net.head.weight.grad.clone(), net.trunk[0][0].weight.grad.clone()
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    assert torch.allclose(g_head, net.head.weight.grad, atol=1e-6)                   # own head: only its own CE
    assert not torch.allclose(g_trunk, net.trunk[0][0].weight.grad, atol=1e-4)       # F also learns from C'_j


def test_hbin_mixes_batch_and_instance_statistics():
    torch.manual_seed(0)
    h = torch.randn(6, 4, 5, 5) * 3 + 1
    m = copa.HBIN(4)
    big = torch.tensor([20.0, -20.0])
    m.mean_logits.data, m.var_logits.data = big, big                                 # pure BN
    assert torch.allclose(m(h), F.batch_norm(h, None, None, training=True, eps=1e-5), atol=1e-4)
    m.mean_logits.data, m.var_logits.data = -big, -big                               # pure IN
    assert torch.allclose(m(h), F.instance_norm(h, eps=1e-5), atol=1e-4)
    bn = nn.BatchNorm2d(4)
    bn(h)
    m2 = copa.HBIN(4)
    m2(h)
    assert torch.allclose(m2.running_mean, bn.running_mean) and torch.allclose(m2.running_var, bn.running_var)
    m2.eval()
    m2.mean_logits.data, m2.var_logits.data = big, big
    assert torch.allclose(m2(h), bn.eval()(h), atol=1e-5)                            # test time: running stats
    with pytest.raises(UserError):
        copa.build(_party(copa.Params(), norm="none"))
    assert copa.to_hbin(build_model(ModelConfig(norm="batch"), 1, 10, 28).trunk) == 2


def test_copa_ensemble_and_augmentation():
    torch.manual_seed(0)
    net = build_model(ModelConfig(), 1, 10, 28).eval()
    x = torch.rand(5, 1, 28, 28)
    W, b = torch.randn(3, 10, net.feature_dim), torch.randn(3, 10)
    out = copa.HeadEnsemble(net, W, b)(x)
    f = net.features(x)
    want = torch.stack([torch.softmax(f @ W[j].T + b[j], 1) for j in range(3)]).mean(0).log()
    assert torch.allclose(out, want, atol=1e-5)
    p = copa.Params(aug_jitter=0, aug_noise=0)
    xa = copa.augment(x, torch.Generator().manual_seed(1), p)
    assert xa.shape == x.shape and not torch.allclose(xa, x)
    for i in range(5):                                                               # an integer translation
        assert any(torch.allclose(xa[i], torch.roll(x[i], (dy, dx), (1, 2)), atol=1e-5) or
                   torch.allclose(xa[i, :, 3:-3, 3:-3], torch.roll(x[i], (dy, dx), (1, 2))[:, 3:-3, 3:-3], atol=1e-5)
                   for dy in range(-2, 3) for dx in range(-2, 3))
    with pytest.raises(UserError):
        copa.Params(norm_layer="switch")


# ------------------------------------------------------------------------------------------ FedSR

def test_fedsr_sends_only_the_model_never_r(run_toml):
    root = run_toml(scenario(("methods.fedsr:FedSR", "fedsr"),
                             ("methods.fedsr:FedSR", "off", dict(variant="official"))))
    led = Ledger.open(root)
    assert all(r["status"] == "ok" for r in runs(root).values())
    keys = sorted(fedsr.FedSRNet(build_model(ModelConfig(), 1, 10, 28), 0, 10, 20).state_dict())
    assert any(k.startswith("cls.") for k in keys) and not any("r_" in k for k in keys)
    for e in led.envelopes:
        assert e.kind == "weights" and e.round > 0                                   # uniform: no n_samples
        assert sorted(a["name"] for a in e.arrays) == keys and not e.scalars
    for run in {e.run for e in led.envelopes}:
        for t in (1, 2):
            assert len(led.select(run=run, round=t, receiver="server")) == 3


@pytest.mark.parametrize("steps", [0, 5])
def test_fedsr_client_keeps_r_local_and_trains_one_epoch_by_default(steps):
    client = _party(fedsr.Params(batch_size=4, local_steps=steps), fedsr.FedSRClient)
    calls = []
    loss = client.loss
    client.loss = lambda *a: calls.append(1) or loss(*a)
    server_state = fedsr.build(client).state_dict()
    reply = client.on_train(Payload(server_state))
    assert len(calls) == (steps or -(-len(client.train.y) // 4)) and len(client.train.y) > 5 * 4
    assert sorted(reply.arrays) == sorted(server_state)                               # the model, nothing else
    assert client.r_mu.shape == (10, client.model.z_dim) == (10, 64)
    assert client.r_mu.abs().sum() > 0 and not torch.equal(client.r_sigma, torch.ones_like(client.r_sigma))
    private = [client.r_mu.detach(), client.r_sigma.detach()]
    assert not any(v.shape == r.shape and torch.equal(v, r) for v in reply.arrays.values() for r in private)


@pytest.mark.parametrize("variant", ["paper", "official"])
def test_fedsr_objective(variant):
    torch.manual_seed(0)
    p = fedsr.Params(variant=variant, alpha_l2r=0.3, alpha_cmi=0.2)
    model = fedsr.FedSRNet(build_model(ModelConfig(), 1, 10, 28), 16, 10, 20)
    x, y = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    eps = torch.randn(6, 16)
    r_mu, r_raw, scale = torch.randn(10, 16), torch.randn(10, 16), torch.tensor(1.7)
    got = fedsr.fedsr_loss(model, x, y, eps, r_mu, r_raw, scale, p)
    mu, sigma = model.dist(x)
    z = mu + sigma * eps
    l2r = z.norm(dim=1).mean() if variant == "official" else (z ** 2).sum(1).mean()
    s = scale if variant == "official" else 1.0
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mu * s, sigma * s),
                                           torch.distributions.Normal(r_mu[y], F.softplus(r_raw)[y])).sum(1).mean()
    want = F.cross_entropy(model.cls(z), y) + 0.3 * l2r + 0.2 * kl
    assert torch.allclose(got, want, atol=1e-5)
    model.eval()                                                                      # 20-sample softmax average
    out = model(x)
    assert torch.allclose(out.exp().sum(1), torch.ones(6), atol=1e-5) and torch.equal(out, model(x))
    model.net.head.bias.data[16:] = -30                                              # sigma ~ 0: one deterministic z
    assert torch.allclose(model(x), torch.log_softmax(model.cls(model.dist(x)[0]), 1), atol=1e-4)


# ------------------------------------------------------------------------------------------ FedGA

def test_ga_update_on_hand_made_gaps():
    a = np.full(3, 1 / 3)
    # paper: mu = -0.1, deviations (0.4, 0.1, -0.5), max deviation 0.4
    got = fedga.ga_update(a, [0.3, 0.0, -0.6], 0.1, "paper")
    assert np.allclose(got, [1 / 3 + 0.1, 1 / 3 + 0.025, 1 / 3 - 0.125])
    # official: no centring, / max|gap| = 0.2, sign -1, step d/3
    got = fedga.ga_update(a, [0.1, -0.2, 0.05], 0.3, "official")
    raw = np.array([1 / 3 - 0.05, 1 / 3 + 0.1, 1 / 3 - 0.025])
    assert np.allclose(got, raw / raw.sum())
    # clipping: the paper keeps a_k >= 0, the official code clips to [0, 1]; both renormalise
    got = fedga.ga_update([0.05, 0.5, 0.45], [0.0, 1.0, 1.0], 0.5, "paper")          # + 0.5 * (-2, 1, 1)
    assert np.allclose(got, np.array([0.0, 1.0, 0.95]) / 1.95)
    got = fedga.ga_update([0.05, 0.5, 0.9], [1.0, -1.0, -0.5], 0.9, "official")        # + 0.3 * (-1, 1, 0.5)
    assert np.allclose(got, np.array([0.0, 0.8, 1.0]) / 1.8)
    a = [0.2, 0.3, 0.5]                                          # a zero denominator leaves the weights alone
    assert np.allclose(fedga.ga_update(a, [0.4, 0.4, 0.4], 0.2, "paper"), a)
    assert np.allclose(fedga.ga_update(a, [0.0, 0.0, 0.0], 0.2, "official"), a)
    raw = np.array(a) - 0.2 / 3                                  # the code's equal gaps still shift every a_k
    assert np.allclose(fedga.ga_update(a, [0.4, 0.4, 0.4], 0.2, "official"), raw / raw.sum())
    assert fedga.step_size(fedga.Params(rounds=10), 10) == 0
    assert np.isclose(fedga.step_size(fedga.Params(rounds=10), 1), 0.18)
    # official: the code's comm = T runs T + 1 rounds (rounds = T + 1), steps d + d/T, d, ..., d/T
    off = fedga.Params(rounds=11, variant="official")
    assert np.allclose([fedga.step_size(off, t) for t in (1, 2, 11)], [0.22, 0.2, 0.02])
    # the code's step is d/3 whatever K: K = 4, gaps (0.1, -0.2, 0.05, 0), d = 0.3 -> a_k - 0.1 * gap_k / 0.2
    raw = 0.25 - np.array([0.05, -0.1, 0.025, 0.0])
    assert np.allclose(fedga.ga_update(np.full(4, 0.25), [0.1, -0.2, 0.05, 0.0], 0.3, "official"), raw / raw.sum())
    with pytest.raises(UserError):
        fedga.Params(rounds=1, variant="official")
    with pytest.raises(UserError):
        fedga.Params(variant="blog")


@pytest.mark.parametrize("variant", ["paper", "official"])
def test_fedga_metrics_in_the_ledger_drive_the_aggregation(run_toml, variant):
    root = run_toml(scenario(("methods.fedga:FedGA", "ga", dict(variant=variant, rounds=3))))
    led = Ledger.open(root)
    assert runs(root)["ga"]["status"] == "ok"
    assert {e.kind for e in led.envelopes if e.sender != "server"} == {"weights", "metric"}
    assert [e.phase for e in led.select(round=0)] == ["sync"] * 3
    a, p = np.full(3, 1 / 3), fedga.Params(rounds=3, variant=variant)
    for t in (1, 2, 3):
        m = led.select(round=t, kind="metric")
        assert len(m) == 6 and {e.receiver for e in m} == {"server"} and all(not e.arrays for e in m)
        before = {e.sender: led.payload(e).scalars["before"] for e in m if e.phase == "before"}
        after = {e.sender: led.payload(e).scalars["after"] for e in m if e.phase == "after"}
        assert sorted(before) == sorted(after) == CLIENTS
        down = led.select(round=t, sender="server")
        assert sorted(e.receiver for e in down) == CLIENTS and {e.phase for e in down} == {"after"}   # one model down
        ups = {e.sender: led.payload(e).arrays for e in led.select(round=t, kind="weights", receiver="server")}
        glob = led.payload(down[0]).arrays
        for k in ("neck.1.weight", "trunk.1.0.bias"):                                # theta = sum a_k theta_k
            assert torch.allclose(glob[k].double(), sum(w * ups[c][k].double() for w, c in zip(a, CLIENTS)), atol=1e-6)
        if variant == "official":
            assert all(0 <= v <= 1 for v in list(before.values()) + list(after.values()))
        a = fedga.ga_update(a, [after[c] - before[c] for c in CLIENTS], fedga.step_size(p, t), variant)
        if t < 3:
            assert not np.allclose(a, 1 / 3)


def test_all_methods_scenario_plans():
    from fdg_audit.runner import plan
    from fdg_audit.scenario import load_raw
    runs_ = plan(load_raw(Path(__file__).parents[1] / "scenarios" / "all_methods.toml"))
    names = {r["method"].label for r in runs_}
    assert names == {"fedavg", "feddg", "csac", "ccst", "fpl", "fedadg", "copa", "fedsr", "fedga", "fada",
                     "perada"}
