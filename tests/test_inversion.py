"""Update inversion (attacks/inversion.py): exact unrolling, label recovery, and the FedSGD positive control
through the real pipeline (scenario -> ledger -> run_attacks)."""
import csv
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attacks.inversion import (Params, Protocol, UpdateInversion, _BNStats, clip_of, cosine_loss, grad_sum,
                               recover_labels, schedule, simulate)
from attacks.labels import round_to_total
from conftest import tiny_scenario
from fdg_audit.api.attack import AdversaryView, Aux, Reconstruction
from fdg_audit.audit.harness import load_runs
from fdg_audit.bus import Payload
from fdg_audit.data import DataConfig, load_data
from fdg_audit.api.method import TrainParams, make_optimizer, state_arrays
from fdg_audit.store.ledger import Ledger
from fdg_audit.models import ModelConfig, build_model
from methods.fedavg import FedAvgClient, Params as FedAvgParams


def test_schedule_cuts_batches_like_the_client():
    pr = Protocol(batch_size=6, local_epochs=2)
    steps, m = schedule(20, pr)
    assert m == 20 and [len(s) for s in steps] == [6, 6, 6, 2] * 2
    assert torch.equal(torch.cat(steps[:4]), torch.arange(20)) and torch.equal(steps[4], torch.arange(6))
    steps, m = schedule(20, Protocol(batch_size=6, local_steps=2))          # less than one epoch
    assert m == 12 and torch.equal(torch.cat(steps), torch.arange(12))
    steps, m = schedule(20, pr, max_images=8, offset=3)                    # capped: slices wrap around
    assert m == 8 and torch.equal(steps[1], 3 + torch.tensor([6, 7, 0, 1, 2, 3]))
    steps, m = schedule(None, Protocol(batch_size=1, local_steps=1))       # FedSGD, n unknown
    assert m == 1 and [s.tolist() for s in steps] == [[0]]


class Recording(FedAvgClient):
    """A FedAvg client that remembers the batches it trained on (the test's ground truth for the order)."""

    def batches(self, *a, **k):
        for x, y in super().batches(*a, **k):
            self.seen.append((x, y))
            yield x, y


def _client(norm="group", **train):
    dom = load_data(DataConfig(dataset="digits", domains=["rot15"], per_domain=25)).domains[0]          # 20 training images
    params = FedAvgParams(**train)
    ctx = dict(id="rot15", params=params, device="cpu", model_cfg=ModelConfig("cnn_small", norm),
               shape=(1, 28, 28, 10), seedseq=np.random.SeedSequence(0), party=1, domain=dom)
    c = Recording(ctx)
    c.seen = []
    return c


@pytest.mark.parametrize("norm,train", [("group", dict(batch_size=6, local_epochs=1, momentum=0.9, lr=0.05)),
                                        ("group", dict(batch_size=8, local_epochs=1, optimizer="adam", lr=1e-3)),
                                        ("batch", dict(batch_size=6, local_steps=3, lr=0.05))])
def test_unrolled_simulation_reproduces_the_client_update(norm, train):
    """Given the true images in the true order, the simulated update equals the real client's upload (so the
    gradient-matching objective is 0 at the truth), BN running statistics included."""
    c = _client(norm, **train)
    theta = {k: v.clone() for k, v in state_arrays(c.model).items()}
    after = c.on_train(Payload(theta)).arrays
    x = torch.cat([b[0] for b in c.seen])
    y = torch.cat([b[1] for b in c.seen])
    pr = Protocol.of(vars(c.params))
    steps, m = schedule(len(c.train.y), pr)
    assert m == len(y)
    net = build_model(ModelConfig("cnn_small", norm), 1, 10, 28)
    net.load_state_dict(theta)
    net.train()
    bn = _BNStats(net) if norm == "batch" else None
    params = {k: theta[k] for k, _ in net.named_parameters()}
    torch.func.replace_all_batch_norm_modules_(net)
    obs = {k: after[k] - theta[k] for k in params}
    if bn is None:
        sim = simulate(net, params, x, y, [steps], pr)
    else:
        bn.start = {(k, s): theta[f"{k}.running_{s}"] for k in bn.names for s in ("mean", "var")}
        sim, run = simulate(net, params, x, y, [steps], pr, bn)
        for (k, s), v in run.items():
            torch.testing.assert_close(v, after[f"{k}.running_{s}"], rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(sim[k], obs[k], rtol=1e-4, atol=1e-7)
    assert float(cosine_loss(sim, obs)) < 1e-5
    wrong = simulate(net, params, x.flip(0), y.flip(0), [steps], pr)       # same images, other batches
    wrong = wrong[0] if isinstance(wrong, tuple) else wrong
    assert float(cosine_loss(wrong, obs)) > 10 * max(float(cosine_loss(sim, obs)), 1e-7)


def _sgd_update(net, x, y, tp, steps=1):
    theta = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = make_optimizer(tp, net.parameters())
    for i in range(steps):
        opt.zero_grad()
        sl = slice(i * len(y) // steps, (i + 1) * len(y) // steps)
        F.cross_entropy(net(x[sl]), y[sl]).backward()
        opt.step()
    return theta, {k: v.detach() - theta[k] for k, v in net.named_parameters()}


def test_label_recovery_on_a_hand_made_batch():
    torch.manual_seed(0)
    d = load_data(DataConfig(dataset="digits", domains=["rot0"], per_domain=100)).domains[0].train
    tp = TrainParams(lr=0.05, momentum=0.9, weight_decay=5e-4)
    pr = Protocol.of(vars(tp))
    # iDLG, one image: the single row of grad W_last with a negative sum is the label (any class).
    for i in range(10):
        net = build_model(ModelConfig("cnn_small"), 1, 10, 28)
        theta, delta = _sgd_update(net, d.x[i:i + 1], d.y[i:i + 1], tp)
        gw = grad_sum(delta["head.weight"], theta["head.weight"], pr, [1])
        gb = grad_sum(delta["head.bias"], theta["head.bias"], pr, [1])
        counts = recover_labels(gw, gb, torch.full((10,), 0.1), 1, 1)
        assert counts.argmax() == int(d.y[i]) and counts.sum() == 1
    # Bias-based counts for a batch with repeated and missing classes: exact given the batch's mean softmax.
    pick = torch.cat([torch.nonzero(d.y == c)[:k, 0] for c, k in [(0, 2), (1, 1), (3, 3), (7, 1), (9, 1)]])
    x, y = d.x[pick], d.y[pick]
    net = build_model(ModelConfig("cnn_small"), 1, 10, 28)
    with torch.no_grad():
        pbar = net(x).softmax(1).mean(0)
    theta, delta = _sgd_update(net, x, y, tp)
    gb = grad_sum(delta["head.bias"], theta["head.bias"], pr, [1])
    gw = grad_sum(delta["head.weight"], theta["head.weight"], pr, [1])
    counts = recover_labels(gw, gb, pbar, len(y), 1)
    assert counts.tolist() == np.bincount(y.numpy(), minlength=10).tolist()
    # The attacker's own estimate of the mean softmax (random probes) still gets the multiset right at init.
    net.load_state_dict({**net.state_dict(), **theta})
    probe = net(torch.rand(64, 1, 28, 28, generator=torch.Generator().manual_seed(1))).softmax(1).mean(0).detach()
    assert recover_labels(gw, gb, probe, len(y), 1).tolist() == counts.tolist()
    assert round_to_total(np.array([0.2, 2.6, -1.0, 1.2]), 4).tolist() == [0, 3, 0, 1]



def test_clipped_parties_reproduce_the_mean_of_clipped_updates():
    """Under client-level DP the aggregate is the mean of clipped updates: with the protocol's clip, the simulated
    mean of two parties at their true images equals it (objective 0), and without the clip it does not."""
    d = load_data(DataConfig(dataset="digits", domains=["rot15"], per_domain=25)).domains[0].train
    x, y = d.x[:12], d.y[:12]
    torch.manual_seed(0)
    net = build_model(ModelConfig("cnn_small"), 1, 10, 28)
    theta = {k: v.detach().clone() for k, v in net.state_dict().items()}
    tp = TrainParams(lr=0.05, batch_size=3)
    deltas = []
    for part in (slice(0, 6), slice(6, 12)):
        net.load_state_dict(theta)
        deltas.append(_sgd_update(net, x[part], y[part], tp, steps=2)[1])
    norms = [float(torch.sqrt(sum(v.pow(2).sum() for v in dd.values()))) for dd in deltas]
    c = 0.5 * min(norms)                                                     # binds on both, by different factors
    obs = {k: sum(dd[k] * min(1.0, c / n) for dd, n in zip(deltas, norms)) / 2 for k in deltas[0]}
    net.load_state_dict(theta)
    params = {k: theta[k] for k, _ in net.named_parameters()}
    pr = Protocol.of(dict(vars(tp), clip=c))
    parties = [schedule(6, pr, offset=o)[0] for o in (0, 6)]
    clipped = float(cosine_loss(simulate(net, params, x, y, parties, pr), obs))
    plain = float(cosine_loss(simulate(net, params, x, y, parties, Protocol.of(vars(tp))), obs))
    assert clipped < 1e-6 and plain > 100 * max(clipped, 1e-9)


POSITIVE = dict(name="inv_pos", threads=None, data=dict(domains=["rot0", "rot15", "rot30"], per_domain=60),
                train=dict(rounds=2, local_steps=1, batch_size=1, lr=0.05),
                attacks=[dict(name="update_inversion", max_victims=1)])   # a layer of tiny_scenario


def test_fedsgd_batch1_positive_control_through_the_pipeline(run_toml):
    """The mandatory positive control (docs/attacks.md §6): FedSGD, batch 1, cnn_small on embedded digits, label
    recovered by iDLG, scored by the shared scorer against the victim's training set: >= 20 dB."""
    root = run_toml(tiny_scenario(POSITIVE))
    rows = list(csv.DictReader(open(root / "leakage.csv")))
    got = {r["metric"]: r for r in rows if r["victim"] == "rot15" and r["round"] == "1"}
    print({k: (round(float(r["value"]), 2), round(float(r["baseline"]), 2)) for k, r in got.items()})
    assert float(got["psnr"]["value"]) >= 20.0
    assert float(got["psnr"]["value"]) > float(got["psnr"]["baseline"])
    assert float(got["label_acc"]["value"]) == 1.0
    assert all(r["status"] == "ok" for r in rows)
    controls = json.loads((root / "controls.json").read_text())
    assert {c["name"] for c in controls} >= {"fedsgd_bs1_cnn_small_psnr", "noise_update_best_psnr"}
    assert all(c["passed"] for c in controls)
    assert (root / "recon" / "update_inversion").is_dir()

    # Curious client rot15: θ^2 − θ^1 minus its own share is the other client's update (two clients).
    run = next(iter(load_runs(root)[0].values()))
    view = AdversaryView(Ledger.open(root), run.protocol(), "client", "rot15", torch.device("cpu"))
    atk = UpdateInversion(Params(adversary_view="client", iterations=50, restarts=1))
    assert atk.adversary == "client"
    outs = atk.run(view, Aux(num_classes=10))
    assert [(o.victim, o.round, tuple(o.images.shape)) for o in outs] == [("rot30", 1, (1, 1, 28, 28))]
    assert isinstance(outs[0], Reconstruction) and outs[0].labels is not None
    assert 0 < outs[0].iterations <= 50 and outs[0].cpu_seconds > 0     # its cost, and the rule that stopped it
    assert "plateau" in outs[0].plateau and "cap 50 its" in outs[0].plateau


def test_fedsgd_batch1_positive_control_cnn_mnist(run_toml):
    """The same control on the wider cnn_mnist (GroupNorm)."""
    root = run_toml(tiny_scenario(POSITIVE), "model.arch=\"cnn_mnist\"", "train.rounds=1", name="mnist")
    got = {r["metric"]: r for r in csv.DictReader(open(root / "leakage.csv")) if r["victim"] == "rot15"}
    print({k: (round(float(r["value"]), 2), round(float(r["baseline"]), 2)) for k, r in got.items()})
    assert float(got["psnr"]["value"]) >= 20.0 and float(got["label_acc"]["value"]) == 1.0


def test_noised_uploads_without_n_samples_assume_one_batch_per_epoch(run_toml):
    """Under client-level DP the update's norm is mostly noise: the server does not estimate n_k from it (an
    estimate far above the truth would unroll thousands of steps), it assumes n_k = B (variant n_assumed)."""
    text = tiny_scenario(POSITIVE, methods=[dict(name="fedavg", weighting="uniform")],
                         train=dict(local_steps=None, local_epochs=1, batch_size=8),
                         attacks=[dict(name="update_inversion", max_victims=1, iterations=20, restarts=1)],
                         privacy=dict(client=dict(clip=0.5, noise_multiplier=1.0)))
    root = run_toml(text, "train.rounds=1", name="dp")
    got = [r for r in csv.DictReader(open(root / "leakage.csv")) if r["metric"] == "psnr"]
    assert len(got) == 1 and got[0]["output"] == "n_assumed" and got[0]["status"] == "ok"


def test_curious_client_unrolls_at_most_max_parties_with_the_recorded_clip(run_toml):
    """A curious client among 4 clients under client-level DP (clip 0.5, sigma 0): the others' mean is matched by
    max_parties virtual clients (2 dummy images, not 3), each clipped to the C its own upload's envelope records;
    the reconstructions are scored against the union of the 3 others."""
    text = tiny_scenario(POSITIVE, methods=[dict(name="fedavg", weighting="uniform")], attacks=None,
                         privacy=dict(client=dict(clip=0.5, noise_multiplier=0.0, mode="central")))
    root = run_toml(text, "data.clients_per_domain=2", name="curious")
    run = next(iter(load_runs(root)[0].values()))
    view = AdversaryView(Ledger.open(root), run.protocol(), "client", "rot15/0", torch.device("cpu"))
    assert clip_of(view.messages(kind="weights", sender="rot15/0", round=1)) == 0.5
    assert clip_of(view.messages(kind="weights", sender="server", round=1)) == 0.0
    atk = UpdateInversion(Params(adversary_view="client", iterations=5, restarts=1, max_parties=2))
    outs = atk.run(view, Aux(num_classes=10))
    assert [(o.victim, o.round, tuple(o.images.shape)) for o in outs] == \
        [("rot15/1+rot30/0+rot30/1", 1, (2, 1, 28, 28))]
    every = UpdateInversion(Params(adversary_view="client", iterations=5, restarts=1, max_parties=0))
    assert tuple(every.run(view, Aux(num_classes=10))[0].images.shape) == (3, 1, 28, 28)


def _victims(k: int, n: int):
    """k victims of n embedded digits each, one local epoch of FedAvg from the same start: the attacker's model,
    the start parameters, each victim's observed update and labels, the shared schedule and protocol."""
    d = load_data(DataConfig(dataset="digits", domains=["rot15"], per_domain=20)).domains[0].train
    torch.manual_seed(0)
    net = build_model(ModelConfig("cnn_small"), 1, 10, 28)
    theta = {k: v.detach().clone() for k, v in net.named_parameters()}
    tp = TrainParams(lr=0.05, batch_size=32, local_epochs=1)
    obs, ys = [], []
    for v in range(k):
        net.load_state_dict(theta, strict=False)
        x0, y0 = d.x[n * v:n * (v + 1)], d.y[n * v:n * (v + 1)]
        opt = make_optimizer(tp, net.parameters())
        F.cross_entropy(net(x0), y0).backward()
        opt.step()
        obs.append({k: p.detach() - theta[k] for k, p in net.named_parameters()})
        ys.append(y0)
    net.load_state_dict(theta, strict=False)
    pr = Protocol.of(vars(tp))
    return net, theta, obs, ys, schedule(n, pr)[0], pr


def test_batched_victims_equal_the_per_victim_loop_each_stopping_at_its_own_plateau():
    """Three victims inverted as one vmapped batch give, with the same seeds, each victim's own reconstruction,
    objective and iteration count; a short window makes them stop at different iterations, so finished victims
    leave the batch while the others go on."""
    from attacks.inversion import invert_many
    net, theta, obs, ys, steps, pr = _victims(3, 2)
    p = Params(iterations=80, restarts=2, plateau_window=5, plateau_tol=0.05)
    gen = lambda v: torch.Generator().manual_seed(v)  # noqa: E731
    loop = [invert_many(net, [theta], [obs[v]], [ys[v]], [steps], pr, (1, 28, 28), p, [gen(v)]) for v in range(3)]
    x, loss, plat = invert_many(net, [theta] * 3, obs, ys, [steps], pr, (1, 28, 28), p, [gen(v) for v in range(3)])
    assert x.shape == (3, 2, 1, 28, 28)
    for v, (xv, lv, pv) in enumerate(loop):
        assert torch.allclose(x[v], xv[0], atol=1e-5) and abs(float(loss[v] - lv[0])) < 1e-6
        assert int(plat.its[v]) == int(pv.its[0]) and int(plat.stage[v]) == int(pv.stage[0])
    assert len(set(plat.its.tolist())) > 1 and int(plat.its.min()) < p.iterations
    assert (plat.cpu > 0).all()


def test_plateau_rule_moves_stalled_units_and_spares_improving_ones():
    """Unit 0 improves 10% per iteration, unit 1 not at all: with a window of 2 and 1% tolerance, unit 1 plateaus at
    the second check (the first only sets its mark), reaches its last stage at the third and is done; unit 0 runs
    to the caller's cap."""
    from attacks.images import Plateau
    pl = Plateau(2, window=2, tol=0.01, stages=2)
    best = torch.tensor([1.0, 1.0])
    for _ in range(10):
        best = best * torch.tensor([0.9, 1.0])
        if pl.due():
            pl.check(best[pl.active])
    pl.finish()
    assert pl.its.tolist() == [10, 6] and pl.stage.tolist() == [0, 2] and pl.active.numel() == 0


def test_a_capped_dummy_set_trains_each_distinct_image_once_weighted_as_the_full_batches_would():
    """max_images caps the dummy set, so a batch holds dummies several times: on a per-sample model the weighted step
    on the distinct dummies gives the update of the full batches (the same images copied into every slot), and
    sizes whose dummies train the same way share one signature (one vmapped batch)."""
    from attacks.inversion import per_sample, signature
    torch.manual_seed(0)
    net = build_model(ModelConfig("cnn_small", "group"), 1, 10, 28).train()
    assert per_sample(net) and not per_sample(build_model(ModelConfig("cnn_small", "batch"), 1, 10, 28))
    params = {k: v.detach() for k, v in net.named_parameters()}
    pr = Protocol(lr=0.05, batch_size=32)
    steps, m = schedule(70, pr, max_images=4)                    # 32, 32, 6 slots over 4 dummies
    assert m == 4 and [len(s) for s in steps] == [32, 32, 6]
    x, y = torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))
    flat = torch.cat(steps)                                      # every slot its own copy: no image twice
    full = [torch.arange(a, a + len(s)) for a, s in zip(np.cumsum([0] + [len(s) for s in steps[:-1]]), steps)]
    want = simulate(net, params, x[flat], y[flat], [full], pr)
    got = simulate(net, params, x, y, [steps], pr)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-7)
    assert signature(4, pr, 4) == signature(16, pr, 4) != signature(1, pr, 4)
