"""Scale: many clients per domain, participation, worker hosts, the Ray engine and the vmap cohort."""
import hashlib

import numpy as np
import pytest
import torch

import fdg_audit.federation as fed
from fdg_audit.cohort import fit_cohort
from fdg_audit.data import DataConfig, load_data
from fdg_audit.errors import UserError
from fdg_audit.ledger import MemoryLedger
from fdg_audit.models import ModelConfig
from fdg_audit.plugins import load_method
from methods.fedavg import FedAvg, Params


@pytest.fixture(scope="module")
def data():
    return load_data(DataConfig(per_domain=90, clients_per_domain=3, client_alpha=0.3))


def run(data, threads=None, **kw):
    """A 2-round FedAvg run; returns (envelope keys, result)."""
    engine = kw.pop("engine", "local")
    spec = fed.RunSpec("t/fedavg/rot0/s0", "fedavg", Params(rounds=2, lr=0.05, batch_size=8, local_steps=1, **kw),
                       DataConfig(per_domain=90, clients_per_domain=3, client_alpha=0.3), ModelConfig(), "rot0",
                       engine=engine, workers=2)
    old = torch.get_num_threads()
    torch.set_num_threads(threads or old)
    try:
        led = MemoryLedger()
        res = fed.run_federation(spec, led, data if engine == "local" else None)
    finally:
        torch.set_num_threads(old)
    return [(e.round, e.phase, e.sender, e.receiver, e.kind, e.sha256) for e in led.envelopes], res


def test_clients_split_domains_disjointly(data):
    d = data.domain("rot15")
    parts = data.clients("rot15")
    assert [p.name for p in parts] == ["rot15/0", "rot15/1", "rot15/2"]
    for s in ("train", "val"):
        ids = np.concatenate([getattr(p, s).idx for p in parts])
        assert sorted(ids) == sorted(getattr(d, s).idx) and len(set(ids)) == len(ids)
    assert data.domain("rot15/2") is parts[2] and data.domain_of("rot15/2") == "rot15"
    for p in parts:  # images travel with their labels
        pos = {int(g): i for i, g in enumerate(d.train.idx)}
        rows = torch.as_tensor([pos[int(g)] for g in p.train.idx])
        assert torch.equal(p.train.x, d.train.x[rows]) and torch.equal(p.train.y, d.train.y[rows])
    # Dirichlet(0.3) skews the class mix across clients far more than an IID split
    iid = load_data(DataConfig(per_domain=90, clients_per_domain=3))
    def spread(ds):
        h = np.stack([np.bincount(p.train.y.numpy(), minlength=10) / len(p.train.y) for p in ds.clients("rot15")])
        return np.abs(h - h.mean(0)).sum()
    assert spread(data) > 2 * spread(iid)
    assert [p.train.idx.tolist() for p in load_data(DataConfig(per_domain=90, clients_per_domain=3,
                                                               client_alpha=0.3)).clients("rot15")] == \
        [p.train.idx.tolist() for p in parts]
    with pytest.raises(UserError, match="too few"):
        load_data(DataConfig(per_domain=20, clients_per_domain=10)).clients("rot0")
    with pytest.raises(UserError, match="clients_per_domain"):
        load_data(DataConfig(clients_per_domain=0))


def test_participation_samples_clients_per_round(data):
    keys, res = run(data, participation=0.4)
    assert res["clients"] == [f"rot{a}/{k}" for a in (15, 30, 45, 60, 75) for k in range(3)]
    asked = {t: [k[3] for k in keys if k[0] == t and k[4] == "weights" and k[2] == "server"] for t in (1, 2)}
    answered = {t: [k[2] for k in keys if k[0] == t and k[4] == "weights" and k[3] == "server"] for t in (1, 2)}
    assert len(asked[1]) == len(asked[2]) == 6 and asked == answered and asked[1] != asked[2]
    assert len([k for k in keys if k[0] == 0 and k[4] == "n_samples"]) == 15   # round 0 asks everyone
    assert [r.get("asked") for r in res["history"][1:]] == [6, 6]
    assert run(data, participation=0.4)[0] == keys     # seeded
    copa = load_method("copa")   # its server expects every client each round: refused up front
    with pytest.raises(UserError, match="participation"):
        fed.run_federation(fed.RunSpec("t/c/rot0/s0", "copa", copa.Params(participation=0.5), DataConfig(),
                                       ModelConfig(), "rot0"), MemoryLedger(), data)


def test_workers_load_only_their_domains(monkeypatch):
    seen = []
    real = fed.load_data
    monkeypatch.setattr(fed, "load_data", lambda cfg: seen.append(list(cfg.domains)) or real(cfg))
    cfg = DataConfig(per_domain=60, clients_per_domain=2)
    spec = dict(method="fedavg", data_cfg=cfg, clients={"rot30/1": 3, "rot45/0": 4}, threads=1, cohort=False,
                params=Params(), device="cpu", model_cfg=ModelConfig(), shape=(1, 28, 28, 10),
                seedseq=fed.seed_sequence(0, "r"), run_id="r", filters={})
    host = fed.build_host(spec)
    assert seen == [["rot30", "rot45"]] and list(host.clients) == ["rot30/1", "rot45/0"]
    assert np.array_equal(host.clients["rot30/1"].train.idx, load_data(cfg).domain("rot30/1").train.idx)


def _clients(data, p, double=True):
    seq = fed.seed_sequence(0, "cohort")
    out = []
    for i, d in enumerate(c for n in ("rot15", "rot30") for c in data.clients(n)):
        x = d.train.x.double() if double else d.train.x
        d = fed.Domain(d.name, fed.Split(x, d.train.y, d.train.idx), d.val)
        cl = FedAvg.Client(dict(id=d.name, params=p, device="cpu", model_cfg=ModelConfig(), shape=(1, 28, 28, 10),
                                seedseq=seq, party=i + 1, domain=d))
        out.append(cl.model.double() and cl)
    return out


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_vmap_cohort_equals_sequential_loop_float64(data, opt):
    # uneven clients (Dirichlet split) with short last batches; 2 epochs; momentum and weight decay on
    p = Params(batch_size=8, lr=0.05, optimizer=opt, local_epochs=2, weight_decay=1e-3)
    loop, cohort = _clients(data, p), _clients(data, p)
    assert len({len(c.train.y) for c in loop}) > 2 and any(len(c.train.y) % 8 for c in loop)
    start = [c.model.head.weight.clone() for c in loop]
    for c in loop:
        c.reseed()
        c.fit(c.model)
    for c in cohort:
        c.reseed()
    fit_cohort(cohort)
    err = max((a - b).abs().max().item() for x, y in zip(loop, cohort)
              for a, b in zip(x.model.parameters(), y.model.parameters()))
    moved = min((c.model.head.weight - s).abs().max().item() for c, s in zip(loop, start))
    assert err < 1e-9 and moved > 1e-3, (err, moved)


def test_vmap_cohort_in_a_federation(data):
    loop_keys, loop = run(data, cohort="loop")
    vmap_keys, vm = run(data, cohort="vmap")
    # one upload envelope per client either way; float32 sums differ in the last bits only
    assert [k[:5] for k in loop_keys] == [k[:5] for k in vmap_keys]
    assert abs(loop["target_acc"] - vm["target_acc"]) <= 0.05
    with pytest.raises(UserError, match="cohort"):
        run(data, cohort="gpu")


def test_ray_engine_ledger_equals_in_process(data, monkeypatch):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'fdg_audit[ray]' to test the Ray engine")
    import ray
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")   # local, loopback only, no dashboard
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        local, a = run(data, threads=1, participation=0.6)
        remote, b = run(data, engine="ray", participation=0.6)
    finally:
        ray.shutdown()
    assert len(local) > 20 and local == remote and a["history"] == b["history"]
    digest = hashlib.sha256(repr(local).encode()).hexdigest()
    assert digest == hashlib.sha256(repr(remote).encode()).hexdigest()


def test_attacks_score_many_client_victims(run_toml):
    import csv
    root = run_toml("""
        name = "many"
        report = false
        [data]
        dataset = "digits"
        domains = ["rot0", "rot15", "rot30"]
        targets = ["rot0"]
        clients_per_domain = 3
        [train]
        rounds = 2
        lr = 0.05
        local_steps = 2
        [[methods]]
        name = "fedavg"
        [[attacks]]
        name = "mia_loss"
        [[attacks]]
        name = "label_distribution"
    """)
    rows = list(csv.DictReader(open(root / "leakage.csv")))
    clients = {f"rot{a}/{k}" for a in (15, 30) for k in range(3)}
    loss = [r for r in rows if r["attack"] == "mia_loss" and r["metric"] == "auc"]
    assert {r["victim"] for r in loss} == clients | {"pooled"} and all(r["status"] == "ok" for r in loss)
    labels = {r["victim"] for r in rows if r["attack"] == "label_distribution" and r["status"] == "ok"}
    assert clients <= labels, labels


def test_encode_brings_device_tensors_to_the_host_in_one_copy(monkeypatch):
    import fdg_audit.bus as bus
    arrays = {"w": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.uint8), "d": torch.randn(2).double(),
              "i": torch.tensor(3), "n": np.ones(2)}
    want = bus.encode(arrays, {"s": 1})
    monkeypatch.setattr(bus, "_on_device", lambda v: isinstance(v, torch.Tensor))   # treat CPU as a device
    assert bus.encode(arrays, {"s": 1}) == want
    assert {k: v.dtype for k, v in bus._to_host(arrays).items() if k != "n"} == \
        {"w": np.float32, "b": np.uint8, "d": np.float64, "i": np.int64}
