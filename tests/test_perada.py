"""PerAda and the server's public data: data.public, pretraining, the KD step on public images only, adapters read
as full models by the weight attacks (membership, update inversion)."""
import dataclasses

import numpy as np
import pytest
import torch

from attacks.inversion import UpdateInversion
from attacks.membership import LossAttack
from fdg_audit.api.attack import AdversaryView, federate
from fdg_audit.data import DataConfig, load_data
from fdg_audit.errors import UserError
from fdg_audit.train.federation import RunSpec, pretrain_public, run_federation
from fdg_audit.store.ledger import MemoryLedger
from fdg_audit.metrics import auc
from fdg_audit.models import ModelConfig
from fdg_audit.protocol import load_method
from fdg_audit.privacy import privacy_config
from fdg_audit.audit.scoring import build_aux
from methods.perada import PerAdaServer, shared_keys

CFG = DataConfig(dataset="digits", per_domain=40, domains=["rot0", "rot30", "rot60"], public="rot15")
MODEL = ModelConfig(pretrain_epochs=2)


@pytest.fixture(scope="module")
def data():
    return load_data(CFG)


def run(data, model=MODEL, privacy=None, **kw):
    p = load_method("perada").Params(**{**dict(rounds=1, batch_size=8, local_steps=2, kd_steps=3, kd_batch=16), **kw})
    led = MemoryLedger()
    spec = RunSpec("t/perada/rot0/s0", "perada", p, CFG, model, "rot0", privacy=privacy)
    return led, run_federation(spec, led, data), p


def test_public_domain_is_disjoint_recorded_and_refused(data):
    ids = np.concatenate([s.idx for d in data.domains for s in (d.train, d.val)])
    assert data.names == ["rot0", "rot30", "rot60"] and data.public_name == "rot15" and len(data.public) == 40
    assert not set(data.public.idx) & set(ids)
    bad = [dict(domains=["rot0", "rot15"]), dict(public="rot99"), dict(dataset="mnist", protocol="standard")]
    for b in bad:
        with pytest.raises(UserError, match="data.public"):
            load_data(dataclasses.replace(CFG, **b))
    with pytest.raises(UserError, match="is data.public"):
        data.domain("rot15")
    led, res, _ = run(data)
    pub = [e for e in led.envelopes if e.kind == "public_aux"]
    assert len(pub) == 1 and (pub[0].sender, pub[0].receiver, pub[0].round) == ("public", "server", 0)
    assert sorted(pub[0].scalars) == ["domain", "n", "sha256"] and not pub[0].arrays
    assert 0 <= res["history"][-1]["personal_acc"] <= 1 and "target_acc" in res["history"][-1]
    sel = next(h for h in res["history"] if h["round"] == res["selected_round"])
    assert res["extra"] == {"personal_acc": sel["personal_acc"]}   # reported next to target_acc (RunInfo.extra)


def test_refusals(data):
    nopub = load_data(dataclasses.replace(CFG, public=""))
    with pytest.raises(UserError, match="needs data.public"):
        run(nopub)
    with pytest.raises(UserError, match="pretrain_epochs"):
        run_federation(RunSpec("t/f", "fedavg", load_method("fedavg").Params(rounds=1), CFG, MODEL, "rot0"),
                       MemoryLedger(), nopub)
    with pytest.raises(UserError, match="pretrained backbone"):
        run(data, model=ModelConfig())
    with pytest.raises(UserError, match="kinds"):
        run(data, privacy=privacy_config({"client": {"clip": 1.0, "noise_multiplier": 1.0}}))


def test_backbone_is_the_public_pretraining_and_only_adapters_move(data):
    led, _, p = run(data)
    spec = RunSpec("x", "fedavg", p, CFG, MODEL, "rot0")
    pre = pretrain_public(spec, data)
    assert all(torch.equal(pre[k], pretrain_public(spec, data)[k]) for k in pre)   # seeded by the seed alone
    w0 = led.payload(next(e for e in led.envelopes if e.kind == "weights")).arrays
    assert all(torch.equal(w0[k], pre[k]) for k in pre)   # round 0 carries the pretrained net, adapters added
    up = led.payload(next(e for e in led.envelopes if e.kind == "adapter" and e.receiver == "server")).arrays
    frozen = [k for k in pre if k not in up]
    assert set(up) < set(w0) and any("adapter" in k for k in up) and "head.weight" in up
    assert any(k.startswith("neck.") for k in frozen) and any(k.startswith("trunk.1.0.w") for k in frozen)


def test_same_ledger_in_process_engine_with_sampled_clients(data, one_thread):
    """The server's KD draws dropout from its own stream, so worker processes give the same ledger."""
    hashes = []
    for engine in ("local", "process"):
        p = load_method("perada").Params(rounds=2, batch_size=8, local_steps=1, kd_steps=2, kd_batch=16,
                                         participation=0.5)
        led = MemoryLedger()
        spec = RunSpec("t/perada/rot0/s0", "perada", p, CFG, MODEL, "rot0", engine=engine, workers=2)
        run_federation(spec, led, data)
        hashes.append([(e.round, e.sender, e.receiver, e.kind, e.sha256) for e in led.envelopes])
    assert hashes[0] == hashes[1] and sum(e[3] == "adapter" and e[2] == "server" for e in hashes[0]) == 2


def test_kd_step_reads_only_public_images(data, monkeypatch):
    seen, orig = [], PerAdaServer.distill

    def spy(self, thetas):
        self.public = dataclasses.replace(self.public, y=torch.full_like(self.public.y, -1))   # labels unusable
        h = self.model.trunk[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
        try:
            orig(self, thetas)
        finally:
            h.remove()
    monkeypatch.setattr(PerAdaServer, "distill", spy)
    run(data, rounds=2)
    rows = {r.numpy().tobytes() for r in data.public.x}
    assert seen and all(r.numpy().tobytes() in rows for x in seen for r in x)


def server_view(led, res, p, data):
    run = dict(run_id="t/perada/rot0/s0", plugin="perada", params=dataclasses.asdict(p), model_cfg=MODEL,
               shape=(data.channels, data.size, data.num_classes), clients=res["clients"])
    return AdversaryView(led, run, "server", "server", "cpu")


def test_weight_attacks_read_adapter_uploads():
    """Overfit (80 images per client, 150 local steps): mia_loss on the merged uploads beats chance (measured pooled
    AUC 0.76 on 40 candidates); update inversion runs on a short round's uploads."""
    data = load_data(dataclasses.replace(CFG, per_domain=100))
    led, res, p = run(data, local_steps=150, lr=0.2, adapter_dropout=0.0, kd_rounds=0)
    view = server_view(led, res, p, data)
    ups = view.messages(kind="weights", sender="rot30")
    assert [m.round for m in ups] == [1] and set(ups[0].payload.arrays) == set(view.new_model().state_dict())
    assert set(shared_keys(view.new_model())) == set(view.messages(kind="adapter", sender="rot30")[0].payload.arrays)
    aux, members = build_aux(data, "rot0", LossAttack.aux, 0)
    outs = [o for o in LossAttack().run(view, aux) if getattr(o, "scores", None) is not None]
    assert {o.victim for o in outs} == {"rot30", "rot60"}
    pooled = auc(np.concatenate([o.scores for o in outs]), np.concatenate([members[o.victim] for o in outs]))
    assert pooled > 0.6, pooled
    led, res, p = run(data, local_steps=2)
    inv = UpdateInversion(UpdateInversion.Params(iterations=5, restarts=1, max_images=4, probes=8))
    recs = [o for o in inv.run(server_view(led, res, p, data), aux) if hasattr(o, "images")]
    assert {r.victim for r in recs} == {"rot30", "rot60"} and recs[0].images.shape[1:] == (1, 28, 28)
    shadow = federate("perada", dataclasses.asdict(p), MODEL, {c: (data.domain(c).train, data.domain(c).val)
                                                               for c in res["clients"]}, data.num_classes)
    assert [m.round for m in shadow.messages(kind="weights", sender="rot30")] == [1]   # reference runs: public = val


def test_runs_under_client_level_dp_on_its_adapters(data):
    """Client-level DP (local mode) clips and noises the adapter uploads, which is all a PerAda client sends of its
    training (the evaluation scalars aside)."""
    led, res, _ = run(data, privacy=privacy_config({"client": {"clip": 1.0, "noise_multiplier": 1.0,
                                                               "kinds": ["adapter"]}}))
    ups = [e for e in led.envelopes if e.kind == "adapter" and e.receiver == "server"]
    assert ups and all(any(isinstance(f, dict) and f.get("mechanism") == "client_dp" for f in e.filters or [])
                       for e in ups)
    assert 0.0 <= res["target_acc"] <= 1.0
