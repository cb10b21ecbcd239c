"""CSAC: divergence-weighted fusion (eq. 4), attention weights (eqs. 7-9), MK-MMD, calibration, and its ledger."""
import pytest
import torch

from fdg_audit.bus import Payload
from fdg_audit.data import DataConfig, load_data
from fdg_audit.errors import UserError
from fdg_audit.api.method import state_arrays
from fdg_audit.seeding import run_seq as seed_sequence
from fdg_audit.store.ledger import Ledger
from fdg_audit.models import ModelConfig
from methods.csac import CSACClient, Params, attention_weights, fuse, fusion_weights, mk_mmd

from conftest import tiny_scenario

TINY = tiny_scenario(data=dict(domains=["rot0", "rot30", "rot60", "rot75"], per_domain=30),
                     train=dict(rounds=2, batch_size=8), methods=[dict(name="csac", acquire_epochs=1)])


def test_fusion_weights_follow_eq4():
    a, b, c = torch.zeros(2, 2), torch.zeros(2, 2), torch.full((2, 2), 3.0)
    # mean = 1 everywhere; distances 2, 2, 4 -> weights 1/4, 1/4, 1/2: the farthest model weighs most
    assert torch.allclose(fusion_weights([a, b, c]), torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64))
    fused = fuse([{"w": a, "n": torch.tensor(2)}, {"w": b, "n": torch.tensor(4)}, {"w": c, "n": torch.tensor(9)}])
    assert torch.allclose(fused["w"], torch.full((2, 2), 1.5)) and fused["w"].dtype == torch.float32
    # an integer buffer gets its own weights (mean 5: distances 3, 1, 4), rounded back
    assert fused["n"].dtype == torch.int64 and fused["n"].item() == round((3 * 2 + 1 * 4 + 4 * 9) / 8)
    # each tensor gets its own weights (per layer), from its own distances
    x = [torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([5.0])]   # mean 2: distances 2, 1, 3
    assert torch.allclose(fusion_weights(x), torch.tensor([2 / 6, 1 / 6, 3 / 6], dtype=torch.float64))
    # two models are always equidistant from their mean: eq. 4 is the plain average
    half = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert torch.allclose(fusion_weights([torch.randn(5), torch.randn(5)]), half)
    # all equal: copied
    same = torch.randn(3)
    assert fusion_weights([same, same.clone()]) is None
    assert torch.equal(fuse([{"w": same}, {"w": same.clone()}])["w"], same)


def test_attention_weights_sum_to_one_over_m_and_prefer_similar_layers():
    g = torch.Generator().manual_seed(0)
    fm = [torch.rand(4, 8, 3, 3, generator=g) for _ in range(3)]
    fl = [fm[0] * 2, -fm[0], torch.zeros(4, 8, 3, 3)]
    alpha = attention_weights(fm, fl)
    assert alpha.shape == (3, 3) and torch.allclose(alpha.sum(1), torch.ones(3))
    assert (alpha[:, 0] > alpha[:, 2]).all() and (alpha[:, 2] > alpha[:, 1]).all()
    # eq. 7 by brute force: avg over the batch of the d x d map A^T B
    a, b = fm[1].flatten(2), fl[0].flatten(2)
    pos = torch.stack([(a[i].T @ b[i]).mean() for i in range(4)]).mean()
    pos_all = torch.stack([torch.stack([(fm[1].flatten(2)[i].T @ f.flatten(2)[i]).mean() for i in range(4)]).mean()
                           for f in fl])
    chan_all = torch.stack([torch.stack([(fm[1].flatten(2)[i] @ f.flatten(2)[i].T).mean() for i in range(4)]).mean()
                            for f in fl])
    assert torch.isclose(pos_all[0], pos)
    assert torch.allclose(alpha[1], (pos_all.softmax(0) + chan_all.softmax(0)) / 2, atol=1e-6)


def test_mk_mmd_separates_distributions():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 10, generator=g), torch.randn(64, 10, generator=g)
    shifted = torch.randn(64, 10, generator=g) + 1.0
    same, diff = mk_mmd(a, b), mk_mmd(a, shifted)
    assert abs(same) < 0.1 < diff
    assert torch.isclose(mk_mmd(a, shifted), mk_mmd(shifted, a))
    assert torch.isclose(mk_mmd(a * 10, shifted * 10), diff, rtol=1e-4)     # bandwidths follow the data scale
    assert mk_mmd(a[:1], b[:1]) == 0


def test_bad_options_are_user_errors():
    for kw in (dict(alignment="x"), dict(init="imagenet"), dict(align_stages=0)):
        with pytest.raises(UserError):
            Params(**kw)


def _client(**kw):
    data = load_data(DataConfig(dataset="digits", family="rotated", domains=["rot0", "rot30"], per_domain=30))
    ctx = dict(params=Params(batch_size=8, acquire_epochs=1, local_steps=1, **kw), device="cpu",
               model_cfg=ModelConfig(), shape=(1, 28, 28, 10), seedseq=seed_sequence(0, "unit"), id="rot30",
               party=1, domain=data.domain("rot30"))
    return CSACClient(ctx)


@pytest.mark.parametrize("alignment", ["paper", "official"])
def test_calibration_trains_the_fused_copy_and_keeps_the_local_model(alignment):
    client = _client(alignment=alignment)
    init = client.new_model()
    sent = client.on_acquire(Payload(state_arrays(init))).arrays
    local = {k: v.clone() for k, v in state_arrays(client.local).items()}
    assert all(torch.equal(sent[k], local[k]) for k in local)        # G_h uploaded == the frozen L^h
    assert not all(torch.equal(sent[k], v) for k, v in state_arrays(init).items())
    x, y = client.train.x[:8], client.train.y[:8]
    fused = client.new_model()
    fused.load_state_dict(sent)
    client.on_calibrate(Payload(state_arrays(fused)))                 # builds this round's projections
    loss = client.calibration_loss(fused, x, y)
    loss.backward()
    ce = torch.nn.functional.cross_entropy(fused(x), y)
    assert loss.item() != pytest.approx(ce.item(), abs=1e-6)          # the alignment term is active
    assert all(p.grad is not None for p in fused.parameters())
    if alignment == "paper":
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in client.proj.parameters())
    assert all(torch.equal(v, local[k]) for k, v in state_arrays(client.local).items())   # L^h never changes
    assert not any(p.requires_grad for p in client.local.parameters())


def test_csac_ledger_holds_only_weights(run_toml):
    led = Ledger.open(run_toml(TINY))
    assert {e.kind for e in led.envelopes} == {"weights"}
    clients = ["rot30", "rot60", "rot75"]
    for t in (0, 1, 2):   # round 0: shared init down + G_h up; then fused M down + calibrated M up
        down = led.select(round=t, sender="server")
        up = led.select(round=t, receiver="server")
        assert sorted(e.receiver for e in down) == clients and sorted(e.sender for e in up) == clients
        assert len({e.sha256 for e in down}) == 1
    names = {a["name"] for e in led.envelopes for a in e.arrays}
    assert all(n.startswith(("trunk.", "neck.", "head.")) for n in names)


def test_own_init_sends_nothing_down_in_round_0(run_toml):
    led = Ledger.open(run_toml(TINY, 'methods.csac.init="own"'))
    assert led.select(round=0, sender="server") == []
    assert len(led.select(round=0, receiver="server")) == 3
