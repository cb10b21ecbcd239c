"""Scale: many clients per domain, participation, worker hosts, the Ray engine and the vmap cohort."""
import hashlib

import numpy as np
import pytest
import torch

import fdg_audit.train.engines as engines
import fdg_audit.train.federation as fed
from fdg_audit.train.cohort import fit_cohort
from fdg_audit.data import DataConfig, Domain, Split, load_data
from fdg_audit.errors import UserError
from fdg_audit.store.ledger import MemoryLedger
from fdg_audit.models import ModelConfig
from fdg_audit.protocol import load_method
from fdg_audit.seeding import run_seq
from methods.fedavg import FedAvg, Params


@pytest.fixture(scope="module")
def data():
    return load_data(DataConfig(dataset="digits", per_domain=90, clients_per_domain=3, client_alpha=0.3))


def run(data, threads=None, **kw):
    """A 2-round FedAvg run; returns (envelope keys, result)."""
    engine = kw.pop("engine", "local")
    spec = fed.RunSpec("t/fedavg/rot0/s0", "fedavg", Params(rounds=2, lr=0.05, batch_size=8, local_steps=1, **kw),
                       DataConfig(dataset="digits", per_domain=90, clients_per_domain=3, client_alpha=0.3), ModelConfig(), "rot0",
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
    iid = load_data(DataConfig(dataset="digits", per_domain=90, clients_per_domain=3))
    def spread(ds):
        h = np.stack([np.bincount(p.train.y.numpy(), minlength=10) / len(p.train.y) for p in ds.clients("rot15")])
        return np.abs(h - h.mean(0)).sum()
    assert spread(data) > 2 * spread(iid)
    assert [p.train.idx.tolist() for p in load_data(DataConfig(dataset="digits", per_domain=90, clients_per_domain=3,
                                                               client_alpha=0.3)).clients("rot15")] == \
        [p.train.idx.tolist() for p in parts]
    with pytest.raises(UserError, match="too few"):
        load_data(DataConfig(dataset="digits", per_domain=20, clients_per_domain=10)).clients("rot0")
    with pytest.raises(UserError, match="clients_per_domain"):
        load_data(DataConfig(dataset="digits", clients_per_domain=0))


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
        fed.run_federation(fed.RunSpec("t/c/rot0/s0", "copa", copa.Params(participation=0.5), DataConfig(dataset="digits"),
                                       ModelConfig(), "rot0"), MemoryLedger(), data)


def test_workers_load_only_their_domains(monkeypatch):
    seen = []
    real = engines.load_data
    monkeypatch.setattr(engines, "load_data", lambda cfg: seen.append(list(cfg.domains)) or real(cfg))
    cfg = DataConfig(dataset="digits", per_domain=60, clients_per_domain=2)
    spec = dict(method="fedavg", data_cfg=cfg, clients={"rot30/1": 3, "rot45/0": 4}, threads=1, cohort=False,
                params=Params(), device="cpu", model_cfg=ModelConfig(), shape=(1, 28, 28, 10),
                seedseq=run_seq(0, "r"), run_id="r", filters={})
    host = engines.build_host(spec)
    assert seen == [["rot30", "rot45"]] and list(host.clients) == ["rot30/1", "rot45/0"]
    assert np.array_equal(host.clients["rot30/1"].train.idx, load_data(cfg).domain("rot30/1").train.idx)


def _clients(data, p, double=True):
    seq = run_seq(0, "cohort")
    out = []
    for i, d in enumerate(c for n in ("rot15", "rot30") for c in data.clients(n)):
        x = d.train.x.double() if double else d.train.x
        d = Domain(d.name, Split(x, d.train.y, d.train.idx), d.val)
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
    from conftest import tiny_scenario
    root = run_toml(tiny_scenario(
        name="many", threads=None, model=None,
        data=dict(family=None, domains=["rot0", "rot15", "rot30"], targets=["rot0"], clients_per_domain=3,
                  per_domain=None),
        train=dict(rounds=2, lr=0.05, local_steps=2, batch_size=None),
        attacks=[dict(name="mia_loss"), dict(name="mia_loss", label="mia_loss4", max_victims=4),
                 dict(name="label_distribution", max_victims=4)]))
    rows = list(csv.DictReader(open(root / "leakage.csv")))
    clients = {f"rot{a}/{k}" for a in (15, 30) for k in range(3)}
    loss = [r for r in rows if r["attack"] == "mia_loss" and r["metric"] == "auc"]
    assert {r["victim"] for r in loss} == clients | {"pooled"} and all(r["status"] == "ok" for r in loss)
    # max_victims: a seeded sample of the clients, the same one for every attack on the run, pooled as well
    four = {r["victim"] for r in rows if r["attack"] == "mia_loss4" and r["metric"] == "auc"}
    labels = {r["victim"] for r in rows if r["attack"] == "label_distribution" and r["status"] == "ok"}
    assert len(four - {"pooled"}) == 4 and "pooled" in four and four - {"pooled"} == labels <= clients, (four, labels)


def test_max_victims_samples_with_the_run_seed():
    from types import SimpleNamespace
    from fdg_audit.api.attack import sample_victims
    names = [f"d{d}/{k}" for d in range(5) for k in range(20)]
    view = SimpleNamespace(run_id="ds/fedavg/rot0/s0")
    ten = sample_victims(view, names, 10)
    assert len(ten) == 10 and ten != names[:10] and ten == [n for n in names if n in ten]   # not the first, in order
    assert len({n.split("/")[0] for n in ten}) > 1
    assert sample_victims(view, names, 10) == ten                                          # seeded
    assert sample_victims(SimpleNamespace(run_id="ds/fedavg/rot0/s1"), names, 10) != ten  # another seed, another set
    assert set(sample_victims(view, names, 5)) <= set(ten)                     # every attack samples the same victims
    assert set(sample_victims(view, names[::-1], 10)) == set(ten)
    entries = [(n, r) for n in names for r in (1, 2)]                          # tuples keyed by victim, all kept
    assert sample_victims(view, entries, 10, key=lambda e: e[0]) == [e for e in entries if e[0] in ten]
    assert sample_victims(view, names, 0) == names and sample_victims(view, names[:3], 10) == names[:3]


def test_participation_of_other_methods(data):
    fpl = fed.RunSpec("t/fpl/rot0/s0", "fpl", load_method("fpl").Params(rounds=2, lr=0.05, batch_size=8, local_steps=1,
                                                                      participation=0.4),
                      DataConfig(dataset="digits", per_domain=90, clients_per_domain=3, client_alpha=0.3), ModelConfig(), "rot0")
    led = MemoryLedger()
    fed.run_federation(fpl, led, data)
    for t in (1, 2):
        up = {e.sender for e in led.envelopes if e.round == t and e.kind == "prototypes" and e.sender != "server"}
        asked = {e.receiver for e in led.envelopes if e.round == t and e.kind == "weights" and e.sender == "server"}
        assert len(asked) == 6 and up == asked
    for name, why in (("fedga", "generalization gaps"), ("copa", "heads")):
        m = load_method(name)
        with pytest.raises(UserError, match=f"{name} does not support participation < 1 .*{why}"):
            fed.check_participation(m, 0.5)
    for name in ("fedavg", "fedsr", "feddg", "ccst", "fpl", "fedadg", "csac"):
        fed.check_participation(load_method(name), 0.5)


def test_engine_settings_from_the_scenario(run_toml, monkeypatch):
    import fdg_audit.train.runs as runs
    seen = []

    def fake(spec, *a, **k):
        seen.append(spec)
        raise UserError("stop here")
    monkeypatch.setattr(runs, "run_federation", fake)
    from conftest import tiny_scenario
    base = dict(name=None, threads=None, report=None, model=None, methods=None, engine="ray", workers=3,
                worker_threads=2, ray=dict(address="auto", num_gpus=0.25),
                data=dict(family=None, domains=None, per_domain=30), train=dict(rounds=1, batch_size=None))
    text = tiny_scenario(base)
    with pytest.raises(UserError, match="stop here"):
        run_toml(text)
    assert (seen[0].engine, seen[0].workers, seen[0].worker_threads) == ("ray", 3, 2)
    assert seen[0].ray == {"address": "auto", "num_gpus": 0.25}
    fedga = tiny_scenario(base, methods=[dict(name="fedga")])
    for t, bad, msg in ((text, "workers=-1", "workers = -1: use 0"), (text, "worker_threads=0", "worker_threads = 0"),
                        (text, "ray.num_cpus=-2", "ray.num_cpus = -2.0: use a number >= 0"),
                        (text, "ray.cpus=1", "unknown key ray.cpus: allowed keys are address, num_cpus, num_gpus"),
                        (text, "ray.address=3", "ray.address = 3 has the wrong type"),
                        (text, "train.participation=0", "participation = 0.0: use a fraction"),
                        (fedga, "train.participation=0.5", "fedga does not support participation < 1 .*gaps")):
        with pytest.raises(UserError, match=msg) as e:
            run_toml(t, bad)
        assert "\n" not in str(e.value)
    assert len(seen) == 1   # every bad setting refused before any run started


def test_ledger_streams_envelopes_to_disk(tmp_path, data):
    from fdg_audit.store.ledger import Ledger
    led = Ledger(tmp_path)
    spec = fed.RunSpec("t/fedavg/rot0/s0", "fedavg", Params(rounds=2, lr=0.05, batch_size=8, local_steps=1),
                       DataConfig(dataset="digits", per_domain=90, clients_per_domain=3, client_alpha=0.3), ModelConfig(), "rot0")
    fed.run_federation(spec, led, data)
    led.close()
    assert led._envs is None and not led.lines          # nothing per envelope kept in memory
    envs = list(led.stream())
    assert len(envs) == led.count == len((tmp_path / "messages.jsonl").read_bytes().splitlines()) > 40
    assert [e.sha256 for e in led.envelopes] == [e.sha256 for e in envs] == \
        [e.sha256 for e in Ledger.open(tmp_path).envelopes]
    assert led.select(round=1, kind="weights", receiver="server") == [e for e in envs if (e.round, e.kind, e.receiver)
                                                                      == (1, "weights", "server")]
    assert led.payload(envs[-1]).arrays   # payloads read back from payloads/


def test_encode_brings_device_tensors_to_the_host_in_one_copy(monkeypatch):
    import fdg_audit.bus as bus
    arrays = {"w": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.uint8), "d": torch.randn(2).double(),
              "i": torch.tensor(3), "n": np.ones(2)}
    want = bus.encode(arrays, {"s": 1})
    monkeypatch.setattr(bus, "_on_device", lambda v: isinstance(v, torch.Tensor))   # treat CPU as a device
    assert bus.encode(arrays, {"s": 1}) == want
    assert {k: v.dtype for k, v in bus._to_host(arrays).items() if k != "n"} == \
        {"w": np.float32, "b": np.uint8, "d": np.float64, "i": np.int64}


def test_generator_leakage_with_several_clients_per_domain(run_toml, one_thread):
    import csv   # one thread: the attack's control fits generators; pinned threads keep it reproducible
    from conftest import tiny_scenario
    root = run_toml(tiny_scenario(
        name="adg_many", threads=None, model=None, methods=[dict(name="fedadg")],
        data=dict(family=None, domains=["rot0", "rot15", "rot30", "rot45"], per_domain=80, clients_per_domain=2),
        train=dict(rounds=2, lr=0.05, batch_size=None),
        attacks=[dict(name="generator_leakage", decoder_steps=300, max_victims=4)]))
    rows = list(csv.DictReader(open(root / "leakage.csv")))
    dom = [r for r in rows if r["metric"] == "domain_balanced_acc"]
    victims = {r["victim"] for r in dom}
    # a domain guess per client, scored against the client's domain (chance: 1 of the 3 source domains)
    assert len(victims) == 4 and victims <= {f"rot{a}/{k}" for a in (15, 30, 45) for k in range(2)}, victims
    assert all(float(r["baseline"]) == pytest.approx(1 / 3) and 0 <= float(r["value"]) <= 1 for r in dom)
    assert {r["victim"] for r in rows if r["metric"] == "psnr"} == victims
    assert all(r["status"] == "ok" for r in rows)
