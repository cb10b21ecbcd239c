"""FedDG / ELCFS: the frequency tools, the amplitude bank on the bus, the relay, and the episodic step."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fdg_audit.bus import Payload
from fdg_audit.data import DataConfig, load_data
from fdg_audit.errors import UserError
from fdg_audit.seeding import run_seq as seed_sequence
from fdg_audit.store.ledger import Ledger
from fdg_audit.models import ModelConfig
from methods.feddg import FedDGClient, Params, amplitude, central, half_window, mix

from conftest import tiny_scenario

FEDDG = dict(data=dict(family="appearance", domains=["grey", "colour", "inverted", "texture"], per_domain=30,
                       targets=["grey"]), methods=[dict(name="feddg")])
TINY = tiny_scenario(FEDDG)


def images(n=6, c=3, h=28, w=28, seed=0):
    return torch.rand(n, c, h, w, generator=torch.Generator().manual_seed(seed))


def test_amplitude_and_phase_reconstruct_the_image():
    x = images()
    f = torch.fft.fft2(x)
    back = torch.fft.ifft2(torch.polar(f.abs(), f.angle())).real
    assert torch.allclose(back, x, atol=1e-5)
    ref = np.abs(np.fft.fft2(x.numpy().astype(np.float64), axes=(-2, -1)))   # the official extract_amp_spectrum
    assert np.allclose(amplitude(x, torch.float64).numpy(), ref)
    assert np.allclose(amplitude(x).numpy(), ref, rtol=1e-4, atol=1e-3)


def test_window_is_centred_on_the_dc_term():
    x = images(h=28, w=28)
    amp = amplitude(x)
    assert central(amp, 0).shape[-2:] == (1, 1)
    assert torch.allclose(central(amp, 0)[..., 0, 0], x.sum((-2, -1)), rtol=1e-5)   # DC = pixel sum
    assert central(amp, 2).shape[-2:] == (5, 5)
    assert half_window(Params(L=0.1), 28, 28) == 2 and half_window(Params(variant="official"), 28, 28) == 0
    assert half_window(Params(L=0.9), 28, 28) == 13    # capped so the window fits


@pytest.mark.parametrize("b", [0, 2, 5])
def test_interpolation_identities(b):
    x, other = images(seed=1), images(seed=2)
    own, theirs = central(amplitude(x), b), central(amplitude(other), b)
    lam = torch.rand(len(x))
    assert torch.allclose(mix(x, theirs, torch.zeros(len(x)), b), x, atol=1e-5)      # lam = 0
    assert torch.allclose(mix(x, own, lam, b), x, atol=1e-5)                        # own amplitude
    y = mix(x, theirs, lam, b, clamp=False)                                         # real, Hermitian-consistent
    want = (1 - lam.view(-1, 1, 1, 1)) * own + lam.view(-1, 1, 1, 1) * theirs
    assert torch.allclose(central(amplitude(y), b), want, rtol=1e-4, atol=1e-3)
    if b:   # at b = 0 only the DC term mixes: every pixel moves by the channel means' difference (~0.01 here)
        assert not torch.allclose(y, x, atol=1e-2)
    f, g = torch.fft.fft2(x), torch.fft.fft2(y)                                      # the phase stays x's
    keep = (f.abs() > 1e-2) & (g.abs() > 1e-2)
    assert torch.allclose(torch.polar(torch.ones_like(f.abs()), f.angle())[keep],
                          torch.polar(torch.ones_like(g.abs()), g.angle())[keep], atol=1e-3)


def test_official_variant_transfers_the_channel_mean():
    x, other = images(seed=3), images(seed=4) * 0.5
    y = mix(x, central(amplitude(other), 0), torch.ones(len(x)), 0, clamp=False)
    assert torch.allclose(y.mean((-2, -1)), other.mean((-2, -1)), atol=1e-5)
    assert torch.allclose(y - y.mean((-2, -1), keepdim=True), x - x.mean((-2, -1), keepdim=True), atol=1e-5)


def test_bad_options_are_user_errors():
    for kw in (dict(variant="x"), dict(bank_content="half"), dict(bank_dtype="float16"), dict(bank_fraction=0.0)):
        with pytest.raises(UserError):
            Params(**kw)


def _client(params=None):
    data = load_data(DataConfig(dataset="digits", family="appearance", domains=["grey", "colour", "texture"], per_domain=30))
    ctx = dict(params=params or Params(batch_size=8), device="cpu", model_cfg=ModelConfig(), shape=(3, 28, 28, 10),
               seedseq=seed_sequence(0, "unit"), id="grey", party=1, domain=data.domain("grey"))
    client = FedDGClient(ctx)
    others = {f"{d}/amp": amplitude(data.domain(d).train.x) for d in ("colour", "texture")}
    client.on_bank_relay(Payload(others))
    return client


def test_outer_loss_sends_gradient_to_the_model():
    client = _client()
    model, (x, y) = client.model, (client.train.x[:8], client.train.y[:8])

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def episodic():
        client.gen = torch.Generator().manual_seed(0)
        return grads(client.episodic_loss(model, x, y))

    client.gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        xt = client.transform(x)
    assert not torch.allclose(xt, x, atol=1e-3)
    g_in, g_out = grads(F.cross_entropy(model(x), y)), grads(F.cross_entropy(model(xt), y))
    g_total = episodic()                                  # beta = 1e-3, the official default
    assert (g_total - g_in).norm() > 0.5 * g_out.norm()   # the outer term reaches the real model
    client.params.meta_step_size = 0.0                    # theta' = theta: the outer gradient is exactly g_out
    assert torch.allclose(episodic() - g_in, g_out, atol=1e-6)


def test_transform_uses_only_the_relayed_banks():
    client = _client()
    assert client.windows.shape == (len(client.windows), 3, 5, 5) and client.counts.sum() == len(client.windows)
    client.gen = torch.Generator().manual_seed(1)
    x = client.train.x[:8]
    xt = client.transform(x)
    assert xt.shape == x.shape and xt.min() >= 0 and xt.max() <= 1


@pytest.mark.parametrize("opts", [{}, dict(bank_fraction=0.5, bank_content="window", bank_dtype="float64")])
def test_bank_in_ledger_is_the_clients_amplitude_and_relay_is_exact(run_toml, opts):
    sets = [f"methods.feddg.{k}={v!r}".replace("'", '"') for k, v in opts.items()]
    run = run_toml(TINY, *sets)
    led, p = Ledger.open(run), Params(**opts)
    data = load_data(DataConfig(dataset="digits", family="appearance", domains=["grey", "colour", "inverted", "texture"], per_domain=30))
    run_id = led.envelopes[0].run
    ups = led.select(phase="bank", kind="amplitude_bank", receiver="server")
    clients = sorted(e.sender for e in ups)
    assert clients == ["colour", "inverted", "texture"]
    banks = {}
    for e in ups:
        amp = led.payload(e).arrays["amp"]
        idx = np.load(run / "truth" / run_id / e.sender / "amp.npz")["idx"]
        train = data.domain(e.sender).train
        assert len(idx) == max(1, int(len(train.y) * p.bank_fraction))
        rows = torch.as_tensor([int(np.flatnonzero(train.idx == i)[0]) for i in idx])
        want = amplitude(train.x[rows], getattr(torch, p.bank_dtype))
        if p.bank_content == "window":
            want = central(want, half_window(p, 28, 28))
        assert amp.dtype == getattr(torch, p.bank_dtype)
        assert torch.allclose(amp, want.to(amp.dtype), rtol=1e-5, atol=1e-4)
        banks[e.sender] = amp
    relays = led.select(phase="bank_relay")
    assert sorted(e.receiver for e in relays) == clients and {e.sender for e in relays} == {"server"}
    for e in relays:
        got = led.payload(e).arrays
        assert sorted(got) == sorted(f"{o}/amp" for o in clients if o != e.receiver)
        for o in clients:
            if o != e.receiver:
                assert torch.equal(got[f"{o}/amp"], banks[o])
    kinds = {e.kind for e in led.envelopes if e.sender != "server"}
    assert kinds == {"n_samples", "amplitude_bank", "weights"}


def test_feddg_runs_in_the_process_engine_with_the_same_ledger(run_toml):
    local = Ledger.open(run_toml(TINY, name="a"))
    proc = Ledger.open(run_toml(tiny_scenario(FEDDG, engine="process"), name="b"))
    assert [e.sha256 for e in proc.envelopes] == [e.sha256 for e in local.envelopes]
    assert any(e.kind == "amplitude_bank" for e in proc.envelopes)


def test_reused_inner_gradient_equals_the_second_backward_pass():
    from torch.func import functional_call
    client = _client()
    model, (x, y), p = client.model, (client.train.x[:8], client.train.y[:8]), client.params

    def official():       # the official code: back-propagate L_in a second time (retain_graph)
        xt = client.transform(x)
        loss_in = F.cross_entropy(model(x), y)
        names, params = zip(*[(k, v) for k, v in model.named_parameters()])
        grads = torch.autograd.grad(loss_in, params, retain_graph=True)
        fast = {k: v - p.meta_step_size * g.clamp(-p.clip_value, p.clip_value) for k, v, g in zip(names, params, grads)}
        return loss_in + F.cross_entropy(functional_call(model, fast, (xt,)), y)

    out = []
    for fn in (official, lambda: client.episodic_loss(model, x, y)):
        client.gen = torch.Generator().manual_seed(3)
        model.zero_grad()
        loss = fn()
        loss.backward()
        out.append((loss.item(), torch.cat([q.grad.flatten() for q in model.parameters()])))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)          # the same loss value
    assert torch.allclose(out[0][1], out[1][1], rtol=1e-5, atol=1e-7)  # and the same gradient


def test_per_example_gradients_are_each_examples_own_episodic_gradient():
    from torch.func import functional_call
    client = _client()
    client.params.meta_step_size = 0.05           # make the inner step matter
    model, (x, y), p = client.model, (client.train.x[:5], client.train.y[:5]), client.params
    client.gen = torch.Generator().manual_seed(4)
    got = client.per_example_grads(model, x, y)
    client.gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        xt = client.transform(x)                  # the same mixing draws
    names, params = zip(*model.named_parameters())
    for i in range(len(x)):                       # each example: inner step from its own gradient, outer on T(x_i)
        g_in = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        fast = {k: (v - p.meta_step_size * g.clamp(-p.clip_value, p.clip_value)).detach().requires_grad_()
                for k, v, g in zip(names, params, g_in)}
        g_out = torch.autograd.grad(F.cross_entropy(functional_call(model, fast, (xt[i:i + 1],)), y[i:i + 1]),
                                    list(fast.values()))
        for j, (a, b) in enumerate(zip(g_in, g_out)):
            assert torch.allclose(got[j][i], a + b, rtol=1e-4, atol=1e-6), names[j]
    assert all(g.shape == (len(x), *q.shape) for g, q in zip(got, params))


def test_window_relay_sends_only_the_windows_and_trains_the_same(run_toml):
    full = Ledger.open(run_toml(TINY, name="a"))
    win = Ledger.open(run_toml(TINY, "methods.feddg.relay=\"window\"", name="b"))
    relay = lambda led: [e for e in led.envelopes if e.phase == "bank_relay"]  # noqa: E731
    assert sum(e.wire_bytes for e in relay(win)) < 0.05 * sum(e.wire_bytes for e in relay(full))
    for e in relay(win):
        assert all(a["shape"][-2:] == [5, 5] for a in e.arrays)
    ups = lambda led: [e.sha256 for e in led.envelopes if e.kind == "weights"]  # noqa: E731
    assert ups(win) == ups(full)                  # the clients use only the window: identical training


def test_feddg_trains_under_example_level_dp_sgd(run_toml):
    text = tiny_scenario(FEDDG, train=dict(rounds=2),
                         privacy=dict(dp_sgd=True, noise_multiplier=1.0, max_grad_norm=1.0, accountant="rdp"))
    root = run_toml(text)
    import csv
    rows = [r for r in csv.DictReader(open(root / "privacy.csv")) if r["mechanism"] == "dp_sgd"]
    assert {r["party"] for r in rows} == {"colour", "inverted", "texture"}
    assert all(r["adjacency"] == "one example (add/remove)" and float(r["epsilon"]) > 0 for r in rows)
    led = Ledger.open(root)
    ups = led.select(kind="weights", receiver="server")
    assert ups and all(e.filters[0]["mechanism"] == "dp_sgd" for e in ups)
