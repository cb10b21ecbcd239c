"""FedADG: what crosses the bus, uniform aggregation, loss options; the generator-leakage attack."""
import csv
import json

from conftest import tiny_scenario

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fdg_audit.api.attack import federate
from fdg_audit.data import DataConfig, load_data
from fdg_audit.errors import UserError
from fdg_audit.models import ModelConfig
from methods.fedadg import Generator, Params, smoothed_ce


def _run(**kw):
    data = load_data(DataConfig(dataset="digits", domains=["rot0", "rot15", "rot30"], per_domain=60))
    clients = {d.name: (d.train, d.val) for d in data.domains[:2]}
    p = Params(**dict(dict(rounds=2, batch_size=16, lr=0.05), **kw))
    return federate("fedadg", p, ModelConfig(), clients, data.num_classes, seed=0)


def _by(view, **match):
    return {(m.sender, m.receiver, m.round): m for m in view.messages(**match)}


def test_protocol_kinds_and_private_discriminator():
    view = _run()
    client_kinds = {m.kind for m in view.messages() if m.sender != "server"}
    assert client_kinds == {"weights", "generator", "metric"}
    names = {a["name"] for m in view.messages() for a in m.env.arrays}
    assert "rp.weight" not in names                                                  # D's projection never leaves
    gen_arrays = {a["name"]: a["shape"] for m in view.messages(kind="generator") for a in m.env.arrays}
    assert gen_arrays == {"net.0.weight": [64, 32 + 10], "net.0.bias": [64], "net.2.weight": [64, 64],
                          "net.2.bias": [64]}                                        # G (D's last layer is 64 -> 1)
    w_names = {a["name"] for m in view.messages(kind="weights") for a in m.env.arrays}
    assert w_names == set(view.new_model().state_dict())                             # F∘C is a plain model
    acc = [m.payload.scalars["val_acc"] for m in view.messages(kind="metric")]
    assert len(acc) == 4 and all(0 <= a <= 1 for a in acc)


def test_server_averages_model_and_generator_uniformly():
    view = _run()
    for kind in ("weights", "generator"):
        ups = [m.payload.arrays for m in view.messages(kind=kind, round=1) if m.sender != "server"]
        nxt = [m.payload.arrays for m in view.messages(kind=kind, round=2, sender="server")][0]
        assert len(ups) == 2 and sorted(nxt) == sorted(ups[0]) and len(nxt) >= 4                # G: 4, F∘C: more
        for k, v in nxt.items():
            assert torch.allclose(v, (ups[0][k] + ups[1][k]) / 2, atol=1e-6), (kind, k)


def test_defaults_are_the_code_loss_options_and_the_paper_options_change_what_is_sent():
    assert (Params().loss_weights, Params().gen_loss) == ("official", "official")         # the paper's do not train
    sha = lambda v: {m.sha256 for m in v.messages(round=1) if m.sender != "server"}  # noqa: E731
    paper = _run(rounds=1, loss_weights="paper", gen_loss="paper")
    official_g, official_w = _run(rounds=1, loss_weights="paper"), _run(rounds=1, gen_loss="paper")
    assert sha(paper) != sha(official_g) and sha(paper) != sha(official_w)
    gen = lambda v: {m.sha256 for m in v.messages(kind="generator", round=1) if m.sender != "server"}  # noqa: E731
    w = lambda v: {m.sha256 for m in v.messages(kind="weights", round=1) if m.sender != "server"}  # noqa: E731
    assert gen(paper) != gen(official_g) and w(paper) != w(official_w)
    with pytest.raises(UserError, match="gen_loss"):
        Params(gen_loss="eq4")


def test_label_smoothing_puts_eps_over_k_minus_1_off_target():
    z = torch.randn(5, 4)
    y = torch.tensor([0, 1, 2, 3, 0])
    assert torch.allclose(smoothed_ce(z, y, 0.0), F.cross_entropy(z, y))
    eps = 0.3
    target = torch.full((5, 4), eps / 3).scatter_(1, y[:, None], 1 - eps)
    assert torch.allclose(smoothed_ce(z, y, eps), -(target * z.log_softmax(1)).sum(1).mean())


def test_generator_from_arrays_rebuilds_sizes():
    g = Generator(7, 10, 12)
    h = Generator.from_arrays({k: v.clone() for k, v in g.state_dict().items()}, 10)
    z, c = torch.rand(3, 7), F.one_hot(torch.tensor([1, 2, 3]), 10).float()
    assert h.noise_dim == 7 and torch.equal(g(z, c), h(z, c))


def test_generator_leakage_controls_and_harness(run_toml, one_thread):
    root = run_toml(tiny_scenario(
        name="adg", threads=None, model=None,
        data=dict(family=None, domains=["rot0", "rot15", "rot30", "rot45"], targets=["rot0"], per_domain=None),
        train=dict(rounds=2, lr=0.05, batch_size=None), methods=[dict(name="fedadg")],
        attacks=[dict(name="generator_leakage", decoder_steps=300)]))
    cs = [c for c in json.loads((root / "controls.json").read_text()) if c["attack"] == "generator_leakage"]
    assert [c["positive"] for c in cs] == [True, True, False] and all(c["passed"] for c in cs), cs   # in its worker
    rows = list(csv.DictReader(open(root / "leakage.csv")))
    dom = [r for r in rows if r["metric"] == "domain_balanced_acc"]
    assert {r["victim"] for r in dom} == {"rot15", "rot30", "rot45"}
    assert all(float(r["baseline"]) == pytest.approx(1 / 3) for r in dom)
    psnr = [r for r in rows if r["metric"] == "psnr"]
    assert len(psnr) == 3 and all(np.isfinite(float(r["value"])) and np.isfinite(float(r["baseline"])) for r in psnr)
    assert all(r["status"] == "ok" for r in rows)
