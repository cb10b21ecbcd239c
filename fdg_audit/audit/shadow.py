"""Shadow runs for attacks: a protocol re-run on data the attacker chose (``federate``), through the same engine as
every recorded run. Plugins import it as ``fdg_audit.api.attack.federate``."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from ..attack import AdversaryView
from ..data.base import DataConfig, Domain, DomainSet, Split
from ..protocol import load_method
from ..store.ledger import MemoryLedger
from ..train.federation import RunSpec, run_federation


def federate(method: str, params, model_cfg, clients: dict[str, tuple[Split, Split]], num_classes: int,
             seed: int = 0, device="cpu", run_id: str = "shadow", public: Split | None = None,
             until_round: int | None = None) -> AdversaryView:
    """Run a protocol on data the attacker chose and return the server's view of that run.

    ``clients[name] = (train, val)``: one client per entry (named like the observed clients when the run is to
    mirror them); ``params`` is the method's Params or its dict (``view.params``). The run goes through the
    same engine as every recorded run (``run_federation``), with a ``MemoryLedger``; the harness evaluates it
    on the pooled validation splits. For reference/shadow models (membership inference, property inference).
    ``until_round = t``: stop after round t (0: only ``begin``'s one-time exchanges), unevaluated: the messages of
    rounds 0..t are in the view, e.g. to see what the method's clients send for chosen data (attacks/generic.py).
    ``public``: the shadow server's public data (``data.public``) where the method needs it (``public_data``) or the
    model pretrains on it (``model.pretrain_epochs``); default the pooled validation images, which no client trains
    on (an approximation: the observed run's public domain is not in the view)."""
    m = load_method(method)
    params = m.Params(**params) if isinstance(params, dict) else params
    x0 = next(iter(clients.values()))[0].x
    ev = Split(torch.cat([v.x for _, v in clients.values()]), torch.cat([v.y for _, v in clients.values()]),
               np.concatenate([v.idx for _, v in clients.values()]))
    data = DomainSet("attacker", [Domain(c, tr, va) for c, (tr, va) in clients.items()] + [Domain("_eval", ev, ev)],
                     num_classes, x0.shape[1], x0.shape[-1])
    if m.public_data or getattr(model_cfg, "pretrain_epochs", 0):
        data.public, data.public_name = ev if public is None else public, "_public"
    spec = RunSpec(run_id, method, params, DataConfig(), model_cfg, "_eval", seed, str(device))
    ledger = MemoryLedger()
    if until_round is None:
        names = run_federation(spec, ledger, data)["clients"]
    else:
        try:
            run_federation(spec, ledger, data, on_round=functools.partial(_stop_after, int(until_round)))
        except _Stop:
            pass
        names = [c for c in clients]
    run = dict(run_id=run_id, plugin=method, params=dataclasses.asdict(params), model_cfg=model_cfg,
               shape=(x0.shape[1], x0.shape[-1], num_classes), clients=names)
    return AdversaryView(ledger, run, "server", "server", torch.device(device))


class _Stop(Exception):
    pass


def _stop_after(t: int, row: dict) -> None:
    if row["round"] >= t:
        raise _Stop
