"""Sample-level DP-SGD inside ``Client.fit`` with Opacus (docs/attacks.md §4.3).

Per client, for the whole run: one ``opacus.PrivacyEngine`` (so one accountant whose history is never reset; a
new engine per round is the classic silent bug, Opacus PR #254 / issue #688). Per call of ``fit``:
``make_private(..., wrap_model=False)`` attaches Opacus' per-sample-gradient hooks to the client's own model (no
``_module.`` wrapper, so state dicts keep their plain keys, issue #435), DP-SGD runs, and the hooks are removed
(``cleanup``) before the model is sent: the ledger only ever sees a plain state dict (issues #608, #636).

Sampling: Poisson, exactly Opacus' ``UniformWithReplacementSampler`` (each example joins a step's batch with
q = 1/ceil(n/B)), driven by the client's seeded generator; ``local_epochs`` E means E * ceil(n/B) steps,
``local_steps`` that many steps. Empty batches are steps too (zero clipped gradient + noise, accounted).
Noise: Opacus' DPOptimizer with a generator seeded from the client's generator, so runs are reproducible and
both engines give the same ledger.

What DP-SGD can cover: a loss that is a mean of per-example terms of one forward pass. The default cross-entropy
is; a method's own ``loss_fn`` must be marked with ``fdg_audit.privacy.per_sample`` (otherwise: UserError naming
the method), and training on a derived split (e.g. an augmented set with several rows per image) is refused,
since the accounting unit would no longer be one training example. BatchNorm is refused (use GroupNorm).
A loss whose per-example gradients Opacus' hooks cannot see (an episodic step through ``functional_call``)
carries them itself: ``per_sample(loss, grad_sample)``, where ``grad_sample(model, x, y)`` returns one (B, *shape)
tensor per trainable parameter; DP-SGD then clips, noises and accounts them through the same DPOptimizer.

Audit (``[privacy.audit] gradient_canaries = m``, read by an audit attack plugin): m Dirac gradient canaries
at public coordinates, each a member with probability 1/2 (the client's private coin, truth ``gradient_canaries``);
a member joins each step's batch with the examples' rate q as one more clipped per-example gradient, so each canary
is one unit of the add/remove relation the accountant covers.

Methods whose objective has no faithful per-example form say why in their plugin class's ``dp_sgd_refused`` and are
refused at plan time (``refuse``, from ``check_run``) with one line that names client-level DP as the alternative.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .. import records, seeding
from ..errors import UserError
from .accounting import epsilon
from ..params import make_optimizer
from .canaries import CANARY_STREAM


@dataclass(frozen=True)
class PerSample:
    """A local loss ``loss(model, x, y)`` declared a mean of per-example terms (each example's term depends only on
    that example), so that DP-SGD may privatize it; ``grad_sample(model, x, y)``, when given, returns one
    (B, *shape) per-example gradient per trainable parameter, for a loss Opacus' hooks cannot see."""
    loss: Any
    grad_sample: Any = None

    def __call__(self, model, x, y):
        return self.loss(model, x, y)


def refuse(method) -> None:
    """Raise the one-line error for a method whose local objective is not a mean of per-example terms: its plugin
    class says why in ``dp_sgd_refused`` (read at plan time, before any training)."""
    why = method.dp_sgd_refused
    if why:
        raise UserError(f"privacy.dp_sgd: method {method.name!r} has no per-example objective ({why}), so "
                        "example-level DP-SGD is undefined: use client-level DP instead ([privacy.client] clip and "
                        "noise_multiplier or target_epsilon)")


def _method(client) -> str:
    return type(client).__module__.rpartition(".")[2] or type(client).__name__


class DPState:
    """What a client keeps for the whole run: the engine (with its accountant) and the index dataset."""

    def __init__(self, accountant: str, n: int):
        from opacus import PrivacyEngine
        with warnings.catch_warnings():   # "Secure RNG turned off": we seed on purpose (reproducible ledgers)
            warnings.simplefilter("ignore")
            self.engine = PrivacyEngine(accountant=accountant)
        self.index = TensorDataset(torch.arange(n))   # the same object every round: one dataset for the engine
        self.steps = 0
        self.canaries = None        # (coordinates, member) of the gradient canaries (audit), else None


def gradient_canary_coordinates(m: int, n_params: int, seed: int) -> np.ndarray:
    """m distinct flat parameter coordinates of the Dirac gradient canaries (public: from the audit seed)."""
    return seeding.rng(seed, n_params, 0xD1AC).choice(n_params, m, replace=False)


def add_gradient_canaries(trainable, st, q: float, clip: float, gen: torch.Generator) -> None:
    """White-box DP-SGD audit (Steinke et al. 2023, Dirac canaries): each member canary joins this step's Poisson
    batch with the examples' rate q as one more per-example gradient, C at its coordinate and 0 elsewhere."""
    coords, member = st.canaries
    take = np.flatnonzero(member & (torch.rand(len(member), generator=gen).numpy() < q))
    sizes = [p.numel() for p in trainable]
    start = np.cumsum([0] + sizes[:-1])
    for i, p in enumerate(trainable):
        rows = torch.zeros((len(take), p.numel()), device=p.device, dtype=p.dtype)
        hit = (coords[take] >= start[i]) & (coords[take] < start[i] + sizes[i])
        rows[np.flatnonzero(hit), coords[take][hit] - start[i]] = clip
        p.grad_sample = torch.cat([p.grad_sample, rows.view(len(take), *p.shape)])


def check_loss(client, model, loss_fn, split) -> None:
    name = _method(client)
    if split is not None and split is not client.train:
        raise UserError(f"privacy.dp_sgd: method {name!r} trains on a derived split, not one row per training "
                        "example, so per-example DP-SGD accounting does not hold: drop dp_sgd for this method")
    if loss_fn is not None and not isinstance(loss_fn, PerSample):
        fn = getattr(loss_fn, "__qualname__", repr(loss_fn))   # a name for the message (a lambda, a partial)
        raise UserError(f"privacy.dp_sgd: method {name!r} trains with its own loss ({fn}), not marked as a mean of "
                        "per-example terms, which DP-SGD cannot privatize: drop dp_sgd for this method (or, if each "
                        "example's loss depends only on that example, mark it with fdg_audit.privacy.per_sample)")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise UserError(f"privacy.dp_sgd: method {name!r} trains a model with BatchNorm, which DP-SGD cannot "
                        "privatize (it mixes the examples of a batch): set model.norm = \"group\"")


def dp_fit(client, model: nn.Module, loss_fn=None, opt=None, epochs: int | None = None, steps: int | None = None,
           split=None) -> nn.Module:
    """``Client.fit`` under DP-SGD; appends the accounting event to ``client.events``."""
    cfg, p = client.privacy, client.params
    check_loss(client, model, loss_fn, split)
    train = client.train
    n = len(train.y)
    if client.dp_state is None:
        client.dp_state = DPState(cfg.accountant, n)
    st = client.dp_state
    if cfg.audit.gradient_canaries and st.canaries is None and (not cfg.audit.clients or client.id in cfg.audit.clients):
        _draw_canaries(client, model, st)
    per_example = loss_fn.grad_sample if isinstance(loss_fn, PerSample) else None
    loss_fn = loss_fn or (lambda m, x, y: F.cross_entropy(m(x), y))
    opt = opt or _optimizer(p, model)
    dev = next(model.parameters()).device
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=client.gen))
    noise_gen = torch.Generator(device=dev).manual_seed(seed)
    loader = DataLoader(st.index, batch_size=min(p.batch_size, n))
    try:
        hooks, dp_opt, dp_loader = st.engine.make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=cfg.noise_multiplier,
            max_grad_norm=cfg.max_grad_norm, poisson_sampling=True, noise_generator=noise_gen, wrap_model=False,
            grad_sample_mode="hooks" if per_example is None else "no_op")   # no_op: the loss brings its own
    except ValueError as e:  # e.g. optimizer parameters that are not the model's
        raise UserError(f"privacy.dp_sgd: method {_method(client)!r} cannot be made private by Opacus: {e}") from None
    sampler = dp_loader.batch_sampler
    sampler.generator = client.gen
    per_epoch = len(sampler)
    steps = steps if steps is not None else (p.local_steps if epochs is None else 0)
    total = steps if steps else (epochs if epochs is not None else p.local_epochs) * per_epoch
    trainable = [q for q in model.parameters() if q.requires_grad]
    model.train()
    done = 0
    with warnings.catch_warnings():   # torch warns that full backward hooks fire on the first layer (expected)
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        try:
            while done < total:
                for idx in sampler:
                    if done == total:
                        break
                    dp_opt.zero_grad(set_to_none=True)
                    _grad_samples(model, trainable, train, idx, per_example, loss_fn)
                    if st.canaries is not None:
                        add_gradient_canaries(trainable, st, sampler.sample_rate, cfg.max_grad_norm, client.gen)
                    dp_opt.step()
                    done += 1
        finally:
            hooks.cleanup()
            for q in model.parameters():
                q.grad = None
    st.steps += done
    acc = st.engine.accountant
    client.events.append(dict(
        mechanism="dp_sgd", accountant=cfg.accountant, noise_multiplier=cfg.noise_multiplier,
        clip=cfg.max_grad_norm, sample_rate=sampler.sample_rate, steps=st.steps, round_steps=done,
        delta=cfg.delta, epsilon=epsilon(acc, cfg.delta), history=[list(h) for h in acc.history],
        gradient_canaries=0 if st.canaries is None else len(st.canaries[1])))
    return model


def _draw_canaries(client, model: nn.Module, st) -> None:
    """The client's DP-SGD Dirac canaries, drawn once: their gradient coordinates and which are inserted (recorded
    as truth)."""
    m = client.privacy.audit.gradient_canaries
    coins = client.stream(CANARY_STREAM, 1)
    st.canaries = (gradient_canary_coordinates(m, sum(q.numel() for q in model.parameters() if q.requires_grad),
                                               client.privacy.audit.seed), coins.random(m) < 0.5)
    client.record_truth(records.GRADIENT_CANARIES, member=st.canaries[1])


def _grad_samples(model: nn.Module, trainable: list, train, idx, per_example, loss_fn) -> None:
    """The per-example gradients of batch ``idx`` (rows of ``train``): the loss's own (``PerSample``), else through
    Opacus' hooks; an empty Poisson batch has none and is still a noised, accounted step."""
    if idx and per_example is not None:
        j = torch.as_tensor(idx, dtype=torch.long, device=train.x.device)
        for q, g in zip(trainable, per_example(model, train.x[j], train.y[j])):
            q.grad_sample = g
    elif idx:
        j = torch.as_tensor(idx, dtype=torch.long, device=train.x.device)
        loss_fn(model, train.x[j], train.y[j]).backward()
    else:
        for q in trainable:
            q.grad_sample = torch.zeros((0, *q.shape), device=q.device, dtype=q.dtype)


def _optimizer(p, model):
    return make_optimizer(p, model.parameters())
