"""CCST and FPL: encoder/decoder exactness, style statistics, the bank relay, K-domain augmentation, FINCH and its
degeneracy, the vectorised FPL loss against a per-sample port of the official loop, and the prototype protocol."""
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
from methods import ccst
from methods.ccst import CCST, build_encoder, decode, image_styles, learned_encoder, overall_style, stylize
from methods.ccst import Params as CCSTParams
from methods.fpl import cluster_prototypes, finch, prototype_loss

from conftest import tiny_scenario

APPEARANCE = dict(data=dict(family="appearance", domains=["grey", "colour", "inverted", "texture"], targets=["grey"]),
                  train=dict(rounds=2, lr=0.05))


def test_linear_encoder_decodes_exactly_and_stylize_moves_the_statistics():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(6, 3, 28, 28, generator=gen)
    enc = build_encoder(CCSTParams(encoder="linear"), 3)
    assert torch.allclose(decode(enc, enc(x), x), x, atol=1e-4)          # least squares inverts phi exactly
    m, s = image_styles(enc, x)
    assert torch.allclose(stylize(enc, x, m, s), x, atol=1e-4)            # own style: AdaIN is the identity
    y = (torch.rand(6, 3, 1, 1, generator=gen) * 0.5 + 0.2 * torch.rand(6, 3, 28, 28, generator=gen))
    tm, ts = image_styles(enc, y)
    z = stylize(enc, x, tm, ts)
    zm, zs = image_styles(enc, z)
    before = ((m - tm) ** 2).mean() + ((s - ts) ** 2).mean()
    after = ((zm - tm) ** 2).mean() + ((zs - ts) ** 2).mean()
    assert after < 0.05 * before


def test_overall_style_is_the_pooled_population_statistic_and_encoders_are_public():
    x = torch.rand(5, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    p = CCSTParams()
    enc = build_encoder(p, 3)
    f = enc(x).transpose(0, 1).flatten(1).double()
    m, s = overall_style(enc, x, chunk=2)                                  # chunked running sums
    assert torch.allclose(m[0].double(), f.mean(1), atol=1e-5)
    assert torch.allclose(s[0].double(), (f.var(1, unbiased=False) + 1e-5).sqrt(), atol=1e-5)
    again = build_encoder(dict(vars(p)), 3)                                # rebuilt from view.params (a dict)
    assert torch.equal(again(x), enc(x))
    relu = build_encoder(CCSTParams(encoder="relu", encoder_width=8), 3)
    assert relu(x).shape[1] == 8
    ccst._train_learned.cache_clear()                                      # retrained from the public seed: the same
    assert torch.equal(build_encoder(p, 3)(x), enc(x)) and enc(x).shape == (5, 64, 6, 6)
    with pytest.raises(UserError, match="encoder"):
        CCSTParams(encoder="vgg")
    with pytest.raises(UserError):
        build_encoder(CCSTParams(encoder_weights="/nonexistent/vgg.pth"), 3)


def _rows(ids, idx):
    """Positions of the image ids ``idx`` in the id array ``ids``."""
    order = np.argsort(ids)
    return order[np.searchsorted(ids, idx, sorter=order)]


def test_learned_encoder_is_a_trained_feature_extractor_with_a_decoder():
    p = CCSTParams()
    assert p.encoder == "learned"
    data = load_data(DataConfig(dataset="digits", family="appearance", per_domain=40))
    x = data.domain("colour").train.x[:32]
    learned, rand = build_encoder(p, 3), build_encoder(CCSTParams(encoder="relu"), 3)
    assert torch.allclose(ccst.public_photos(3, 16, 4, torch.Generator().manual_seed(0)),
                          ccst.public_photos(3, 16, 4, torch.Generator().manual_seed(0)))   # public data, seeded
    init = ccst.LearnedEncoder(3, 64)                                      # the same architecture, untrained
    with torch.no_grad():
        err, err0 = (F.mse_loss(m.decode(m(x), x.shape[-2:]), x) for m in (learned, init))
    assert err < 0.25 * x.var() and err < 0.25 * err0                      # its decoder inverts phi on unseen digits
    assert rand(x).shape[1] == learned(x).shape[1] == 64
    assert ccst.encoder_label(p) == "learned-encoder"
    assert ccst.encoder_label(dict(encoder="linear")) == "random-linear-encoder-lower-bound"


def _client(K: int, style: str = "overall", bank_size: int = 0):
    data = load_data(DataConfig(dataset="digits", family="appearance", per_domain=40))
    dom = data.domain("colour")
    truth = {}
    ctx = dict(id="colour", params=CCSTParams(K=K, style=style, bank_size=bank_size), device="cpu",
               model_cfg=ModelConfig(), shape=(3, 28, 28, 10), seedseq=seed_sequence(0, "r"), party=1, domain=dom,
               truth_sink=lambda cid, name, arrs: truth.__setitem__(name, arrs))
    client = CCST.Client(ctx)
    assert client.encoder is None                                          # the learned encoder comes from the server
    p = client.params
    client.on_encoder(Payload(learned_encoder(3, p.encoder_width, p.encoder_seed, p.encoder_steps)))
    return client, data, truth


def test_ccst_augmentation_draws_K_domains_per_image_own_kept_others_stylised():
    client, data, _ = _client(K=2)
    enc = client.encoder
    bank = {}
    for d in ("colour", "inverted", "texture"):
        m, s = overall_style(enc, data.domain(d).train.x)
        bank[f"{d}/mean"], bank[f"{d}/std"] = m, s
    client.on_bank(Payload(bank))
    n = len(client.train.y)
    aug, dom = client.aug, client.aug_domain
    assert len(aug.y) == 2 * n and np.array_equal(np.bincount(_rows(client.train.idx, aug.idx)),
                                                  np.full(n, 2))
    assert np.all(dom.reshape(n, 2)[:, 0] != dom.reshape(n, 2)[:, 1])        # without replacement
    own = dom == 0                                                           # sorted names: colour first
    rows = np.repeat(np.arange(n), 2)
    assert torch.equal(aug.x[torch.as_tensor(own)], client.train.x[torch.as_tensor(rows[own])])
    moved = (aug.x[torch.as_tensor(~own)] - client.train.x[torch.as_tensor(rows[~own])]).abs().amax((1, 2, 3))
    assert moved.min() > 0.05
    assert 0.2 < own.mean() < 0.5                                            # own drawn in about 2 of 3 sets
    assert torch.equal(aug.y, client.train.y[torch.as_tensor(rows)])


def test_ccst_single_style_uploads_J_entries_with_their_ids():
    client, _, truth = _client(K=0, style="single", bank_size=5)
    r = client.on_style(None)
    assert r.kind == "style_bank" and r.arrays["mean"].shape == (5, 64) and r.arrays["std"].shape == (5, 64)
    idx = truth["style"]["idx"]
    rows = _rows(client.train.idx, idx)
    assert len(idx) == 5 and np.array_equal(client.train.idx[rows], idx)
    m, s = image_styles(client.encoder, client.train.x[torch.as_tensor(rows)])
    assert torch.allclose(r.arrays["mean"], m) and torch.allclose(r.arrays["std"], s)


def test_ccst_run_relays_the_whole_bank_uniform_weights_no_n_samples(run_toml):
    root = run_toml(tiny_scenario(APPEARANCE, data=dict(label_skew=0.0),
                                  methods=[dict(name="ccst", style="single", bank_size=3)]))
    envs = Ledger.open(root).envelopes
    led = Ledger.open(root)
    ups = {e.sender: led.payload(e) for e in envs if e.kind == "style_bank" and e.sender != "server"}
    relays = [e for e in envs if e.kind == "style_bank" and e.sender == "server"]
    assert sorted(ups) == ["colour", "inverted", "texture"] and len(relays) == 3
    assert {e.receiver for e in relays} == set(ups) and len({e.sha256 for e in relays}) == 1
    bank = led.payload(relays[0])
    for c, p in ups.items():
        assert p["mean"].shape == (3, 64)
        assert torch.equal(bank[f"{c}/mean"], p["mean"]) and torch.equal(bank[f"{c}/std"], p["std"])
    assert all(e.round == 0 for e in envs if e.kind == "style_bank")
    assert not any(e.kind == "n_samples" for e in envs)
    enc = [e for e in envs if e.kind == "encoder"]                         # the learned encoder: once, down, same bytes
    assert sorted(e.receiver for e in enc) == sorted(ups) and {e.sender for e in enc} == {"server"}
    assert len({e.sha256 for e in enc}) == 1 and all(e.round == 0 for e in enc)
    assert sorted(led.payload(enc[0]).arrays) == sorted(learned_encoder(3, 64, 2023, 300))
    assert [e.phase for e in envs if e.round == 0][:3] == ["encoder"] * 3     # before any style is computed


def test_finch_first_neighbour_degeneracy_and_real_clusters():
    rng = np.random.default_rng(0)
    for n in (2, 3):
        for _ in range(50):                                                  # <= 3 points: always one cluster
            assert len(np.unique(finch(rng.normal(size=(n, 8)))[-1])) == 1
    a, b = rng.normal(size=8), rng.normal(size=8)
    pts = np.stack([a, a + 0.01 * rng.normal(size=8), b, b + 0.01 * rng.normal(size=8)])
    assert len(np.unique(finch(pts)[-1])) == 2                              # two tight pairs: two clusters
    lab = finch(pts)[-1]
    assert lab[0] == lab[1] and lab[2] == lab[3] and lab[0] != lab[2]
    P, c = cluster_prototypes([torch.tensor(pts[:2], dtype=torch.float32), torch.tensor(pts[2:], dtype=torch.float32)],
                              [torch.tensor([3, 3]), torch.tensor([3, 3])])
    assert P.shape == (2, 8) and c.tolist() == [3, 3]
    three = [torch.randn(1, 8) for _ in range(3)]
    P, c = cluster_prototypes(three, [torch.tensor([1])] * 3)
    assert P.shape == (1, 8) and torch.allclose(P[0], torch.cat(three).mean(0), atol=1e-6)


def _official_loss(f, y, P, pc, tau):
    """Per-sample port of the official FPL loop (hierarchical_info_loss), for comparison."""
    total, B = 0.0, len(y)
    for i in range(B):
        if not (pc == y[i]).any():
            continue
        pos, neg = P[pc == y[i]], P[pc != y[i]]
        l = torch.cosine_similarity(f[i:i + 1], torch.cat([pos, neg]), dim=1) / tau
        e = torch.exp(l)
        total = total - torch.log(e[:len(pos)].sum() / e.sum()) + F.mse_loss(f[i:i + 1], pos.mean(0, keepdim=True))
    return total / B


def test_fpl_loss_matches_the_official_per_sample_loop():
    g = torch.Generator().manual_seed(0)
    f, y = torch.randn(12, 6, generator=g), torch.randint(0, 5, (12,), generator=g)
    P, pc = torch.randn(7, 6, generator=g), torch.tensor([0, 0, 1, 2, 2, 2, 3])     # class 4 has no prototypes
    assert torch.allclose(prototype_loss(f, y, P, pc, 0.5), _official_loss(f, y, P, pc, 0.5), atol=1e-5)
    assert prototype_loss(f, torch.full((12,), 4), P, pc, 0.02) == 0


def test_fpl_protocol_prototypes_from_round_two_one_per_class_with_three_clients(run_toml):
    root = run_toml(tiny_scenario(APPEARANCE, data=dict(label_skew=0.5), methods=[dict(name="fpl")]))
    led = Ledger.open(root)
    envs = led.envelopes
    down = [e for e in envs if e.kind == "prototypes" and e.sender == "server"]
    up = [e for e in envs if e.kind == "prototypes" and e.sender != "server"]
    assert {e.round for e in down} == {2} and len(down) == 3 and {e.round for e in up} == {1, 2}
    run = envs[0].run
    for e in up:
        p = led.payload(e)
        z = np.load(root / "truth" / run / e.sender / "proto.npz")
        present = np.flatnonzero(z["counts"])
        assert np.array_equal(p["classes"].numpy(), present) and p["proto"].shape == (len(present), 64)
        assert z["counts"].sum() == len(z["idx"]) and np.array_equal(np.bincount(z["y"], minlength=10), z["counts"])
        assert len(present) < 10                                             # label skew drops classes
    g = led.payload(down[0])
    r1 = {e.sender: led.payload(e) for e in up if e.round == 1}
    for k in g["classes"].tolist():                                          # <= 3 clients: one cluster = the mean
        rows = [p["proto"][p["classes"] == k] for p in r1.values() if (p["classes"] == k).any()]
        assert (g["classes"] == k).sum() == 1
        assert torch.allclose(g["proto"][g["classes"] == k][0], torch.cat(rows).mean(0), atol=1e-5)
    assert sum(e.kind == "n_samples" for e in envs) == 3
