"""Update inversion's engine (attacks/inversion.py, which the attacks import it through): the public local-training
protocol an attacker replays (``Protocol``, ``schedule``), the simulated client update (``simulate``), label
recovery from the classifier's update (``recover_labels``) and the Inverting Gradients loop (``invert``,
``invert_many``) with its plateau schedule (``STAGES``). fedavg_leakage shares it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from .images import Plateau, plateau_rule, total_variation
from .labels import round_to_total

if TYPE_CHECKING:
    from .inversion import Params


@dataclass
class Protocol:
    """The public local-training protocol (``view.params``)."""
    lr: float = 0.01
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 32
    local_steps: int = 0
    local_epochs: int = 1
    clip: float = 0.0                 # client-level DP: each party's update clipped to this L2 norm (0 = none)

    @classmethod
    def of(cls, params: dict) -> "Protocol":
        return cls(**{k: params[k] for k in cls.__dataclass_fields__ if k in params})


# --------------------------------------------------------------------------------- simulation

def noise_on(m) -> bool:
    """Whether an upload's envelope records a noising mechanism (client_dp or dp_sgd with noise): its norm is then
    mostly noise and says nothing about n_k."""
    return any(isinstance(e, dict) and e.get("mechanism") in ("client_dp", "dp_sgd") and e.get("noise_multiplier", 0) > 0
               for e in m.env.filters or [])


def clip_of(msgs) -> float:
    """The client-level DP clip C recorded in the envelope of the first of ``msgs`` that has one (0: none)."""
    return next((float(e["clip"]) for m in msgs for e in m.env.filters or []
                 if isinstance(e, dict) and e.get("mechanism") == "client_dp" and e.get("clip")), 0.0)


def client_size(view, v: str, pr: Protocol, ts: list, aux, infer: bool = True) -> tuple[int | None, str]:
    """The server's n_k of client ``v`` and how it got it: the client's ``n_samples`` message (""); without one and
    with ``infer``, one batch when its uploads are noised ("n_assumed": a noised norm says nothing about n_k), else
    estimated from the update norm against training on public images ("n_estimated", as the dataset_size attack
    does); None and why otherwise."""
    sent = view.messages(kind="n_samples", sender=v)
    if sent:
        return int(sent[0].payload["n"]), ""
    if not infer:
        return None, ""
    if any(noise_on(m) for m in view.messages(kind="weights", sender=v)):
        return pr.batch_size, "n_assumed"
    if not ts:
        return None, "no round observed"
    from .stats import estimate_size
    est, how = estimate_size(view, v, ts[0], aux.public if aux else None)
    return (max(1, int(round(est))), "n_estimated") if est is not None else (None, how)


def exchanges(view, v: str, ts: list):
    """(round, download, upload) weight arrays of client ``v`` for each round of ``ts`` where both were observed."""
    for t in ts:
        down = view.messages(kind="weights", sender="server", receiver=v, round=t)
        up = view.messages(kind="weights", sender=v, round=t)
        if down and up:
            yield t, down[0].payload.arrays, up[0].payload.arrays


def schedule(n: int | None, pr: Protocol, max_images: int = 0, offset: int = 0) -> tuple[list[torch.Tensor], int]:
    """Per local step, the indices into a dummy set (starting at ``offset``) that the step trains on, and the
    dummy set's size: one pass over the data the round touched, batches as ``Client.batches`` cuts them."""
    b = pr.batch_size if n is None else min(pr.batch_size, n)
    per_epoch = [b] * (n // b) + ([n % b] if n % b else []) if n is not None else None
    total = pr.local_steps if pr.local_steps > 0 else pr.local_epochs * len(per_epoch)
    sizes = [b] * total if per_epoch is None else [per_epoch[s % len(per_epoch)] for s in range(total)]
    starts = [0] * total
    for s in range(1, total):
        starts[s] = 0 if per_epoch is not None and s % len(per_epoch) == 0 else starts[s - 1] + sizes[s - 1]
    used = sum(sizes) if n is None else min(n, sum(sizes))
    m = min(used, max_images) if max_images > 0 else used
    return [offset + torch.arange(a, a + z) % m for a, z in zip(starts, sizes)], m


def signature(n: int | None, pr: Protocol, max_images: int = 0) -> tuple:
    """How a dummy set of client size ``n`` trains, up to repeats: its size and, per step, the share of the batch
    each distinct dummy image takes. Sizes with one signature simulate the same update on a per-sample model
    (``per_sample``), e.g. 4 and 16 images with 4 dummies and one step."""
    steps, m = schedule(n, pr, max_images)
    return m, tuple(tuple((torch.unique(i, return_counts=True)[1] / len(i)).tolist()) for i in steps)


class _BNStats:
    """Forward pre-hooks on BatchNorm layers recording batch mean / unbiased var of their inputs (the
    quantities torch folds into running statistics); works under vmap since nothing is updated in place."""

    def __init__(self, net: torch.nn.Module):
        self.names = [k for k, m in net.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        self.momentum = {k: m.momentum for k, m in net.named_modules() if k in self.names}
        self.log = None
        for k, m in net.named_modules():
            if k in self.names:
                m.register_forward_pre_hook(lambda mod, inp, k=k: self._hook(k, inp[0]))

    def _hook(self, k, x):
        if self.log is not None:
            dims = [0] + list(range(2, x.dim()))
            self.log.append((k, x.mean(dims), x.var(dims, unbiased=True)))


def _opt_step(p: dict, g: dict, st: dict, t: int, pr: Protocol) -> dict:
    """One step of torch.optim.SGD (dampening 0, no Nesterov) or torch.optim.Adam (defaults), functionally."""
    out = {}
    for k in p:
        d = g[k] + pr.weight_decay * p[k] if pr.weight_decay else g[k]
        if pr.optimizer == "adam":
            m = st[k, "m"] = 0.9 * st[k, "m"] + 0.1 * d if t else 0.1 * d
            v = st[k, "v"] = 0.999 * st[k, "v"] + 0.001 * d * d if t else 0.001 * d * d
            denom = (v + 1e-30).sqrt() / (1 - 0.999 ** (t + 1)) ** 0.5 + 1e-8   # +1e-30: finite grad at v = 0
            out[k] = p[k] - pr.lr / (1 - 0.9 ** (t + 1)) * m / denom
        else:
            if pr.momentum:
                d = st[k] = pr.momentum * st[k] + d if t else d
            out[k] = p[k] - pr.lr * d
    return out


def per_sample(net) -> bool:
    """True when a batch's loss is the mean of per-image losses (no BatchNorm, no dropout): a simulated step may
    then train on its distinct images, each weighted by how often the batch holds it (the same gradient, a
    fraction of the cost when a capped dummy set fills a larger batch)."""
    return not any(isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.dropout._DropoutNd))
                   for m in net.modules())


def batch_loss(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """Mean cross-entropy of a batch; with ``w`` (per distinct image, summing to 1) the weighted sum."""
    if w is None:
        return F.cross_entropy(logits, y)
    return (F.cross_entropy(logits, y, reduction="none") * w).sum()


def simulate(net, params: dict, x: torch.Tensor, y: torch.Tensor, parties: list[list[torch.Tensor]],
             pr: Protocol, bn: _BNStats | None = None):
    """Differentiable local training from ``params`` of every party (its steps index x, y); returns the mean
    update over parties {name: θ_T − θ_0} and, when ``bn`` is given, the mean simulated running statistics
    {(layer, "mean"|"var"): value} given the starting ones in ``bn.start``."""
    deltas, stats = [], []
    dedup = bn is None and per_sample(net)
    for steps in parties:
        p, st, run = dict(params), {}, dict(bn.start) if bn is not None else None
        for t, idx in enumerate(steps):
            u, c = torch.unique(idx, return_counts=True) if dedup else (idx, None)
            if len(u) == len(idx):   # no image twice in the batch: the plain mean, in the batch's order
                xs, ys, w = x[idx], y[idx], None
            else:   # a capped dummy set wraps around: each distinct image once, weighted by its count
                xs, ys, w = x[u], y[u], c.to(x.dtype) / len(idx)
            if bn is not None:
                bn.log = []
            g = grad(lambda q: batch_loss(functional_call(net, q, (xs,)), ys, w))(p)
            if bn is not None:
                for k, mu, var in bn.log:
                    mo = bn.momentum[k]
                    run[k, "mean"] = (1 - mo) * run[k, "mean"] + mo * mu
                    run[k, "var"] = (1 - mo) * run[k, "var"] + mo * var
                bn.log = None
            p = _opt_step(p, g, st, t, pr)
        d = {k: p[k] - params[k] for k in params}
        if pr.clip > 0:   # client-level DP's clip, on each party's whole update (as privacy/client_dp.py)
            f = (pr.clip / (torch.sqrt(sum(v.pow(2).sum() for v in d.values())) + 1e-12)).clamp(max=1.0)
            d = {k: v * f for k, v in d.items()}
        deltas.append(d)
        stats.append(run)
    mean = {k: sum(d[k] for d in deltas) / len(deltas) for k in params}
    if bn is None:
        return mean
    return mean, {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}


def cosine_loss(sim: dict, obs: dict) -> torch.Tensor:
    dot = sum((sim[k] * obs[k]).sum() for k in obs)
    ns = sum(sim[k].pow(2).sum() for k in obs)
    no = sum(obs[k].pow(2).sum() for k in obs)
    return 1 - dot / (ns.sqrt() * no.sqrt()).clamp_min(1e-30)


# --------------------------------------------------------------------------------- labels

def grad_sum(delta: torch.Tensor, theta: torch.Tensor, pr: Protocol, steps: list[int]) -> torch.Tensor:
    """Σ_s ∇_s (the summed mini-batch gradients) estimated from one parameter's update Δ after ``steps``
    local steps of each party: SGD moves by −lr·Σ_s c_s (g_s + wd·θ_s) with c_s = Σ_{r<T-s} μ^r, taken as
    its mean c̄ (θ_s ≈ θ^t); Adam's first step only keeps the sign, so Adam returns −Δ (a direction)."""
    if pr.optimizer == "adam":
        return -delta
    cs = [sum(pr.momentum ** r for r in range(T - s)) for T in steps for s in range(T)]
    return -delta / (pr.lr * float(np.mean(cs))) - len(cs) * pr.weight_decay * theta


def recover_labels(gw: torch.Tensor, gb: torch.Tensor, p_mean: torch.Tensor, visits: int, n_steps: int
                   ) -> np.ndarray:
    """Label counts (per class, summing to ``visits``) from the summed last-layer gradients ``gw`` (K, D) and
    ``gb`` (K,). One visit: iDLG, argmin_c Σ_j gw[c, j] (needs non-negative features, e.g. a ReLU before the
    head). Otherwise the bias-based estimator n_c = b̄·(T·p̄_c − gb_c) with b̄ = visits / T."""
    k = gb.shape[0]
    if visits == 1:
        return np.bincount([int(gw.sum(1).argmin())], minlength=k)
    est = visits / n_steps * (n_steps * p_mean - gb)
    return round_to_total(est.detach().cpu().numpy(), visits)


@torch.no_grad()
def mean_softmax(net, states: list[dict], shape: tuple, n: int, gen: torch.Generator, device) -> torch.Tensor:
    """The mean softmax output on ``n`` uniform random images, averaged over the given parameter states."""
    x = torch.rand((n, *shape), generator=gen).to(device)
    return torch.stack([functional_call(net, s, (x,)).softmax(1).mean(0) for s in states]).mean(0)


# --------------------------------------------------------------------------------- optimisation

STAGES = 4   # step sizes lr, lr/10, lr/100, lr/1000: each plateau moves a victim to the next, the 4th ends it


def plateau_words(p) -> str:
    """``Reconstruction.plateau`` of update inversion (and fedavg_leakage, which shares its schedule)."""
    return plateau_rule(p.plateau_window, p.plateau_tol, f"{p.iterations} its",
                        f"step x0.1 at each of the first {STAGES - 1} plateaus, stop at the {STAGES}th",
                        p.max_cpu_seconds)


def invert(net, params: dict, obs: dict, y: torch.Tensor, parties: list[list[torch.Tensor]], pr: Protocol,
           shape: tuple, p: Params, gen: torch.Generator, bn: _BNStats | None = None,
           obs_bn: dict | None = None, prior=None) -> tuple[torch.Tensor, float]:
    """Inverting Gradients for one victim: ``invert_many`` of one; returns the best images (M, C, H, W) in [0, 1]
    and their objective."""
    x, loss, _ = invert_many(net, [params], [obs], [y], parties, pr, shape, p, [gen], bn, [obs_bn], prior)
    return x[0], float(loss[0])


def invert_many(net, params: list[dict], obs: list[dict], ys: list[torch.Tensor], parties: list[list[torch.Tensor]],
                pr: Protocol, shape: tuple, p: Params, gens: list[torch.Generator], bn: _BNStats | None = None,
                obs_bn: list | None = None, prior=None) -> tuple[torch.Tensor, torch.Tensor, Plateau]:
    """Inverting Gradients for V victims at once, each with ``p.restarts`` dummy sets: victim v's start state
    ``params[v]``, observed update ``obs[v]``, labels ``ys[v]`` (M,), random start from ``gens[v]``; every victim
    unrolls the same ``parties`` schedule. All V x restarts objectives are one vmapped batch (the victims' objectives
    are independent, so the result is each victim's own optimisation); Adam on the signed gradient with a step size
    per victim, which drops x0.1 at each of the victim's plateaus (``Plateau``, ``STAGES``); a victim that is done
    leaves the batch. Returns the best images (V, M, C, H, W), their objectives (V,) (gradient-matching term,
    regularisers included) and the Plateau (iterations and CPU seconds per victim). With a ``prior``
    (attacks/prior.py) the dummy images are ``prior.decode(z)`` and the latents z are optimised."""
    V, R, m, dev = len(ys), p.restarts, len(ys[0]), ys[0].device
    rep = lambda t: t.repeat_interleave(R, 0)  # noqa: E731   per victim -> per (victim, restart) row
    batch, shared, use_bn = _batch(params, obs, ys, bn, obs_bn, rep)
    z, img = _dummies(prior, gens, R, m, shape, p.box, dev)

    def objective(x, y, o, q, ob):
        if use_bn:
            sim, run = simulate(net, q, x, y, parties, pr, bn)
            bn_term = sum((run[k] - v).pow(2).sum() / v.pow(2).sum().clamp_min(1e-12) for k, v in ob.items())
            return cosine_loss(sim, o) + p.tv * total_variation(x).mean() + p.bn_prior * bn_term
        return cosine_loss(simulate(net, q, x, y, parties, pr), o) + p.tv * total_variation(x).mean()

    # models with dropout (e.g. adapters): masks per restart
    f = vmap(objective, in_dims=(0, 0, 0, None if shared else 0, 0), randomness="different")
    state = dict(z=z.detach().requires_grad_(True), m1=torch.zeros_like(z), m2=torch.zeros_like(z),
                 lr=torch.full((V * R,), float(p.lr), device=dev),
                 best=torch.full((V * R,), float("inf"), device=dev), best_x=img(z).detach().clone(), **batch)
    out_x, out_loss = torch.zeros((V, m, *shape), device=dev), torch.full((V,), float("inf"), device=dev)
    plat = Plateau(V, p.plateau_window, p.plateau_tol, STAGES, p.max_cpu_seconds)

    def store(sel: torch.Tensor, units: torch.Tensor):   # the best restart of the selected active victims
        bl = state["best"].view(-1, R)
        k = bl.argmin(1)
        out_x[units[sel]] = state["best_x"].view(-1, R, m, *shape)[torch.arange(len(bl), device=dev), k][sel]
        out_loss[units[sel]] = bl.min(1).values[sel]

    for it in range(max(1, p.iterations)):
        z = state["z"]
        x = img(z)
        loss = f(x, state["y"], state["obs"], state["params"], state["bn"])
        (gz,) = torch.autograd.grad(loss.sum(), z)
        with torch.no_grad():
            better = loss < state["best"]
            state["best"] = torch.where(better, loss, state["best"])
            state["best_x"][better] = x[better]
            _signed_adam(state, z, gz, it + 1, p.box == "clamp" and prior is None)
        if plat.due():
            units = plat.active.to(dev)
            moved, done = plat.check(state["best"].view(-1, R).min(1).values)
            state["lr"] = state["lr"] * rep(torch.where(moved, 0.1, 1.0).to(dev))
            if bool(done.any()):
                store(done.to(dev), units)
                _keep(state, rep(~done.to(dev)), shared)
            if not len(plat.active):
                break
    if len(plat.active):
        store(torch.ones(len(plat.active), dtype=torch.bool, device=dev), plat.active.to(dev))
    plat.finish()
    return out_x, out_loss, plat


def _batch(params: list[dict], obs: list[dict], ys: list, bn, obs_bn, rep) -> tuple[dict, bool, bool]:
    """``invert_many``'s per-row tensors (labels, observed updates, BN statistics, start states: one start state
    for all when the victims share it), whether they share it and whether the BN prior is on."""
    names = list(params[0])
    shared = all(torch.equal(q[k], params[0][k]) for q in params[1:] for k in names)
    use_bn = bn is not None and obs_bn is not None and all(obs_bn)
    if use_bn and not shared:
        raise ValueError("invert_many: the BN prior needs one start state for every victim (group by download)")
    batch = dict(y=rep(torch.stack(ys)), obs={k: rep(torch.stack([o[k].detach().float() for o in obs])) for k in names},
                 bn={k: rep(torch.stack([ob[k] for ob in obs_bn])) for k in obs_bn[0]} if use_bn else {},
                 params=params[0] if shared else {k: rep(torch.stack([q[k] for q in params])) for k in names})
    return batch, shared, use_bn


def _dummies(prior, gens: list, R: int, m: int, shape: tuple, box: str, dev):
    """The optimised variables of ``invert_many`` (R restarts of m dummy images per victim, each victim's drawn from
    its own generator) and the map from them to images: latents of the ``prior``, else pixels (``box``)."""
    if prior is not None:
        z = torch.cat([prior.init_latents(R * m, g).view(R, m, -1) for g in gens])
        img = lambda z: prior.decode(z.flatten(0, 1)).view(len(z), m, *shape)  # noqa: E731
    else:
        u = torch.cat([torch.rand((R, m, *shape), generator=g) for g in gens]).to(dev)
        z = torch.logit(u.clamp(0.01, 0.99)) if box == "sigmoid" else u
        img = (lambda z: torch.sigmoid(z)) if box == "sigmoid" else (lambda z: z)
    return z, img


def _signed_adam(state: dict, z: torch.Tensor, gz: torch.Tensor, t: int, clamp: bool) -> None:
    """One Adam step (torch's defaults) on the signed gradient ``gz``, in place, with a step size per row
    (``state["lr"]``); ``clamp``: project onto [0, 1]."""
    g, m1, m2 = gz.sign(), state["m1"], state["m2"]
    m1.mul_(0.9).add_(g, alpha=0.1)
    m2.mul_(0.999).addcmul_(g, g, value=0.001)
    step = state["lr"].view(-1, *[1] * (z.dim() - 1)) / (1 - 0.9 ** t)
    z -= step * m1 / ((m2 / (1 - 0.999 ** t)).sqrt() + 1e-8)
    if clamp:
        z.clamp_(0, 1)


def _keep(state: dict, rows: torch.Tensor, shared: bool) -> None:
    """Drop finished victims from every per-row tensor of ``invert_many``'s batch (a shared start state stays)."""
    for key, v in state.items():
        if isinstance(v, dict):
            state[key] = {k: t[rows] for k, t in v.items()} if key != "params" or not shared else v
        else:
            state[key] = v[rows]
    state["z"] = state["z"].detach().requires_grad_(True)
