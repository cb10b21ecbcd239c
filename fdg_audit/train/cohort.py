"""Vectorised cohorts: K clients' local training as one stacked model (``cohort = "vmap"``).

Each client keeps its own parameters, data, batch order and optimizer state; only the arithmetic is batched.
The K parameter sets are stacked on a leading axis and one step is ``torch.func.vmap`` of
``torch.func.grad`` of the per-client loss (``functional_call`` on the shared architecture). Per step every
client takes the batch its own ``Client.batch_indices`` would give in the sequential loop (same generator, same
order); batches are padded to the batch size and masked (a short last batch averages over its real rows), and a
client with fewer steps than the longest is frozen (parameters and optimizer state unchanged) in the extra
steps. The optimizer is torch's SGD (momentum, dampening 0, weight decay added to the gradient) or Adam, written
out on stacked tensors, with per-client state; a fresh state per call, as ``Client.fit`` makes a new optimizer.

Requirements (``Client.vmap_ok``): plain cross-entropy on ``client.model``, no buffers (GroupNorm or no norm;
BatchNorm running statistics are not supported), no DP-SGD. Uploads stay one envelope per client.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap


def _schedule(clients) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(steps, K, b) row indices into the clients' concatenated training sets, row mask, (steps, K) step mask."""
    offsets, plans = 0, []
    for c in clients:
        plans.append([j + offsets for j in c.batch_indices()])
        offsets += len(c.train.y)
    steps = max(len(p) for p in plans)
    b = max(len(j) for p in plans for j in p)
    idx = torch.zeros(steps, len(clients), b, dtype=torch.long)
    rows = torch.zeros(steps, len(clients), b, dtype=torch.bool)
    for k, p in enumerate(plans):
        for s, j in enumerate(p):
            idx[s, k, :len(j)] = j
            rows[s, k, :len(j)] = True
    return idx, rows, rows.any(-1)


def fit_cohort(clients) -> None:
    """Train every client's ``model`` in place, as ``Client.fit(client.model)`` would one after another."""
    p = clients[0].params
    base = clients[0].model
    names = [n for n, _ in base.named_parameters()]
    dev = next(base.parameters()).device
    params = {n: torch.stack([dict(c.model.named_parameters())[n].detach() for c in clients]) for n in names}
    x_all = torch.cat([c.train.x for c in clients]).to(dev)
    y_all = torch.cat([c.train.y for c in clients]).to(dev)
    idx, rows, active = (t.to(dev) for t in _schedule(clients))
    base.train()

    def loss(prm, x, y, m):
        ce = F.cross_entropy(functional_call(base, prm, (x,)), y, reduction="none")
        return (ce * m).sum() / m.sum().clamp(min=1)

    step_grad = vmap(grad(loss))
    state = {n: torch.zeros_like(v) for n, v in params.items()}      # momentum buffer / Adam first moment
    state2 = {n: torch.zeros_like(v) for n, v in params.items()}     # Adam second moment
    count = torch.zeros(len(clients), device=dev, dtype=params[names[0]].dtype)
    for s in range(idx.shape[0]):
        j, m, on = idx[s], rows[s], active[s]
        g = step_grad(params, x_all[j], y_all[j], m.to(x_all.dtype))
        count = count + on.to(count.dtype)
        for n in names:
            shape = (-1,) + (1,) * (params[n].dim() - 1)
            w, cnt = on.view(shape), count.view(shape)
            gn = g[n] + p.weight_decay * params[n] if p.weight_decay else g[n]
            if p.optimizer == "adam":
                b1, b2, eps = 0.9, 0.999, 1e-8
                m1 = torch.where(w, b1 * state[n] + (1 - b1) * gn, state[n])
                m2 = torch.where(w, b2 * state2[n] + (1 - b2) * gn * gn, state2[n])
                c = cnt.clamp(min=1)
                bc1, bc2 = 1 - b1 ** c, 1 - b2 ** c
                upd = (p.lr / bc1) * m1 / (m2.sqrt() / bc2.sqrt() + eps)
                state[n], state2[n] = m1, m2
            else:
                if p.momentum:
                    buf = torch.where(cnt == 1, gn, p.momentum * state[n] + gn)
                    state[n] = torch.where(w, buf, state[n])
                    gn = buf
                upd = p.lr * gn
            params[n] = torch.where(w, params[n] - upd, params[n])
    with torch.no_grad():
        for k, c in enumerate(clients):
            for n, t in c.model.named_parameters():
                t.copy_(params[n][k])

