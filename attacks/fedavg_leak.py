"""Multi-epoch FedAvg leakage (Dimitrov, Balunović, Konstantinov, Vechev, "Data leakage in federated averaging",
TMLR 2022; docs/attacks.md §2.2, row G3): rebuild a client's n_k images from one FedAvg upload of E local epochs.

Threat model: an honest-but-curious server. Per round t it reads the client's download θ^t and upload θ_k^{t+1}
exactly as ``update_inversion`` does (attacks/inversion.py), knows the public protocol (optimizer, lr, momentum,
weight decay, batch size B, local epochs or steps) and the client's n_k (its ``n_samples`` message; otherwise
estimated from the update norm with public images, variant "n_estimated", or one batch under a noised upload,
variant "n_assumed"), but not the labels nor the batch order of any epoch.

What differs from ``update_inversion`` (breaching's multi-step user: one dummy set, cut into the same batches in
every epoch, which the client's reshuffled epochs never are):
  * one dummy copy of the client's data per epoch (x̂_e, e < E, n_k images each, capped at ``max_images``); local
    training is simulated differentiably (``simulate`` of attacks/inversion.py: functional_call + grad per step,
    restarts vectorised with vmap) with epoch e's steps cutting their batches out of x̂_e. The copies carry the
    same label multiset in an independent random order per epoch;
  * batch order matching: every ``match_every`` iterations, ``moves`` candidate moves (two images of one copy, in
    different batches of that epoch, trade places with their labels) are scored by the update-matching term in one
    vmapped call, and the best one is kept when it beats the current order (Adam's moments move along);
  * the epoch-order prior: the copies hold the same images in unknown orders. After the moves each copy is matched
    to the consensus (the mean of the aligned copies; Hungarian algorithm on MSE within each slot's label), and
    ``consistency`` · the aligned copies' mean squared distance to their mean joins the objective;
  * the answer is the mean of the aligned copies: n_k images, each with its slot's label.
Objective: 1 − cos(simulated update, observed update) + ``tv`` · TV + ``consistency`` · consistency; Adam with the
authors' lr 0.4 on the raw gradient (``signed`` = true: update_inversion's signed steps), ×0.1 at each of the
first 3 plateaus of the best objective, stopping at the 4th or at ``iterations`` (update_inversion's plateau rule,
attacks/images.py ``Plateau``); pixels projected onto [0, 1]; the best iterate per restart kept, the lowest
objective returned.
Labels: counts over the round's E·n_k visits read off the last layer (``recover_labels``, bias-based), with the mean
softmax of the attacker's public images (uniform noise without them) at θ^t and θ^{t+1} (the paper interpolates
the two models), scaled to n_k.

Measured before the plateau rule (step x0.1 at 3/8, 5/8, 7/8 of the iterations; tests/test_fedavg_leak.py; 8 real
MNIST digits, 2 epochs of batch 4, SGD lr 0.05, momentum 0.9, cnn_small with GroupNorm, 300 iterations x 1
restart, tv 0.3 for all; mean matched PSNR, seed 0, two torch threads): this attack 14.9 dB, update_inversion
11.8, single-step IG 10.5; the mean image scores 12.1. So on 8
digits only this attack beats the mean image, by 2.8 dB. Two more seeds (other digits and client seed, one
thread): 10.1 / 7.8 / 8.9 dB and 14.5 / 9.1 / 8.8 dB against public mean images of 11.4 and 11.8: it beats both IG
variants on all three seeds and the mean image on two of them.

Deviations from the paper/its code: cosine distance over all parameters (their FEMNIST runs: L2 with exponential
layer weights and a ramped factor); a matched consistency term (theirs compares a permutation-invariant statistic of
the copies, their mean after a random convolution, and matches copies only at the end) and the batch-move search
(theirs keeps the random label order); box projection instead of a clipping penalty; CPU-sized budget (300
iterations, 1 restart). Local losses other than plain cross-entropy and DP-SGD clients are attacked as if they
ran plain SGD (as ``update_inversion``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from fdg_audit.api import UserError, seeding
from fdg_audit.api import metrics as M
from fdg_audit.api.attack import Attack, AttackParams, Control, Reconstruction, Skipped, sample_victims

from .images import PLATEAU_TOL, PLATEAU_WINDOW, Plateau, total_variation
from .inversion import (STAGES, Protocol, client_size, cosine_loss, exchanges, grad_sum, plateau_words, recover_labels,
                        schedule, simulate)
from .labels import round_to_total


@dataclass
class Params(AttackParams):
    rounds: list = field(default_factory=lambda: [1])   # rounds attacked; [] = every round
    iterations: int = 300             # iteration cap (CPU-sized; the budget measured in tests/test_fedavg_leak.py)
    plateau_window: int = PLATEAU_WINDOW   # the plateau rule (attacks/images.py Plateau), as update_inversion's:
    plateau_tol: float = PLATEAU_TOL       # step x0.1 at each of the first 3 plateaus, stop at the 4th
    max_cpu_seconds: float = 0.0      # CPU-seconds cap per victim (0 = none)
    restarts: int = 1                 # optimised together (vmap); the lowest objective is kept
    lr: float = 0.4                   # Adam (the authors' lr), x0.1 at each plateau (plateau_window below)
    signed: bool = False              # Adam on the signed gradient instead (breaching's IG, update_inversion)
    tv: float = 0.3                   # total-variation weight
    consistency: float = 3.0          # weight of the epoch-order prior (aligned copies' distance to their mean)
    match_every: int = 20             # iterations between batch-move searches and re-matchings of the copies
    swap: bool = True                 # search batch moves (an image and its label to another batch of its epoch)
    moves: int = 32                   # candidate moves per search (a random sample when there are more)
    max_images: int = 64              # cap on n_k per copy (0 = no cap)
    probes: int = 64                  # probe images (public ones, else uniform noise) for the label-count estimator
    seed: int = 0


def epoch_steps(n: int, pr: Protocol, max_images: int = 0) -> tuple[list[torch.Tensor], int, int]:
    """Per local step its indices into the E stacked copies (epoch e's steps index copy e), the images per copy
    m and the number of epochs E the round touched."""
    steps, m = schedule(n, pr, max_images)
    per_epoch = -(-n // min(pr.batch_size, n))
    return [s + (t // per_epoch) * m for t, s in enumerate(steps)], m, -(-len(steps) // per_epoch)


def _match(copies: torch.Tensor, ref: torch.Tensor, y: torch.Tensor, y_ref: torch.Tensor) -> torch.Tensor:
    """perm (m,) so that copies[perm[j]] is slot j of ``ref``: Hungarian on MSE, labels must agree."""
    cost = torch.cdist(ref.flatten(1), copies.flatten(1)).pow(2) / ref[0].numel()
    return M.match_batch(copies, ref, cost + 1e6 * (y_ref[:, None] != y[None, :]))


def swaps(steps: list[torch.Tensor], m: int) -> torch.Tensor:
    """(P, 2) position pairs of one copy that lie in different batches of the same epoch."""
    pairs = {(int(a), int(b)) for s in steps for t in steps if int(s[0]) // m == int(t[0]) // m and s is not t
             for a in s for b in t if a < b and a not in t and b not in s}
    return torch.tensor(sorted(pairs), dtype=torch.long).view(-1, 2)


def leak(net, params: dict, obs: dict, y: torch.Tensor, steps: list[torch.Tensor], pr: Protocol, shape: tuple,
         p: Params, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float, Plateau]:
    """Reconstruct from the update ``obs``; ``y`` (E, m) holds each copy's labels (y[e] a permutation of y[0]).
    Returns the aligned mean of the copies of the best restart (m, C, H, W) in [0, 1], its slot labels (m,), its
    objective and the Plateau (iterations and CPU seconds run)."""
    e, m = y.shape
    r, dev = p.restarts, y.device
    obs = {k: obs[k].detach() for k in params}
    # slot j of copy c starts as the same random image in every copy; y[c] = y[0][perm[c]] ties labels to slots
    perm = torch.stack([_match(torch.zeros(m, 1), torch.zeros(m, 1), y[c], y[0]) for c in range(e)])
    u = torch.rand((r, m, *shape), generator=gen).to(dev)
    z = u[:, perm.argsort(1)].reshape(r, e * m, *shape).clone().requires_grad_(True)
    ys = y.flatten().expand(r, -1).clone()             # labels per restart and position (swaps change them)
    rows = torch.arange(r, device=dev)[:, None, None]
    cols = torch.arange(e, device=dev)[None, :, None] * m
    perms = cols + perm.expand(r, e, m)                # positions of slot j in every copy
    f = vmap(lambda x, yy: cosine_loss(simulate(net, params, x, yy, [steps], pr), obs))
    pairs = swaps(steps, m) if p.swap else torch.zeros((0, 2), dtype=torch.long)
    opt = torch.optim.Adam([z], lr=p.lr)
    plat = Plateau(1, p.plateau_window, p.plateau_tol, STAGES, p.max_cpu_seconds)
    best = torch.full((r,), float("inf"), device=dev)
    best_x, best_y = u.clone(), ys[:, :m].clone()
    for it in range(max(1, p.iterations)):
        if it and it % p.match_every == 0:
            with torch.no_grad():
                if len(pairs):   # move one image (with its label) to another batch where that fits the update best
                    cand = pairs[torch.randperm(len(pairs), generator=gen)[:p.moves]]
                    order, j = torch.arange(e * m, device=dev).repeat(len(cand), 1), torch.arange(len(cand))
                    order[j, cand[:, 0]], order[j, cand[:, 1]] = cand[:, 1], cand[:, 0]
                    order = torch.cat([torch.arange(e * m, device=dev)[None], order])       # candidate 0: no swap
                    fit = f(z[:, order].flatten(0, 1), ys[:, order].flatten(0, 1)).view(r, -1)
                    pick = order[fit.argmin(1)]                                             # (r, e*m)
                    z.data = z.data[rows[:, 0], pick]
                    for st in opt.state[z].values():
                        if torch.is_tensor(st) and st.shape == z.shape:
                            st.copy_(st[rows[:, 0], pick])
                    ys = ys[rows[:, 0], pick]
                    perms = pick.argsort(1)[rows, perms]
                cop = z.view(r, e, m, *shape)
                ref, yref = z[rows, perms].mean(1), ys[rows[:, 0], perms[:, 0]]
                perms = cols + torch.stack([torch.stack([_match(cop[i, c], ref[i], ys[i, c * m:(c + 1) * m], yref[i])
                                                         for c in range(e)]) for i in range(r)])
        aligned = z[rows, perms]                          # (r, e, m, C, H, W): slot j of every copy
        mean = aligned.mean(1)
        cons = (aligned - mean[:, None]).pow(2).flatten(2).mean(2).mean(1)
        loss = f(z, ys) + p.tv * total_variation(z.flatten(0, 1)).view(r, -1).mean(1) + p.consistency * cons
        with torch.no_grad():
            better = loss < best
            best = torch.where(better, loss.detach(), best)
            best_x[better] = mean[better].detach()
            best_y[better] = ys[rows[:, 0], perms[:, 0]][better]
        (gz,) = torch.autograd.grad(loss.sum(), z)
        z.grad = gz.sign() if p.signed else gz
        opt.step()
        with torch.no_grad():
            z.clamp_(0, 1)
        if plat.due():
            moved, done = plat.check(best.min()[None])
            for group in opt.param_groups:
                group["lr"] *= 0.1 if bool(moved[0]) else 1.0
            if bool(done[0]):
                break
    plat.finish()
    k = int(best.argmin())
    return best_x[k], best_y[k], float(best[k]), plat


class FedAvgLeakage(Attack):
    name = "fedavg_leakage"
    consumes = ("weights",)
    adversary = "server"
    aux = ("public",)             # only to estimate n_k when the client sent no n_samples
    outputs = {"": "the public protocol (optimizer, lr, batch size, local epochs) and the n_k the client sent; "
                   "labels read off the last layer; local training simulated as plain cross-entropy SGD/Adam with "
                   "one dummy copy of the data per epoch tied by an epoch-order (matching) prior",
               "n_estimated": "as the main output, with n_k estimated from the update norm against the attacker's "
                              "own training on public images",
               "n_assumed": "as the main output, with n_k assumed to be one batch (a noised upload's norm says "
                            "nothing about n_k)"}
    priors, knows = {"*": "none"}, ("architecture", "local_hyperparams")
    budget = {"*": (("iterations",), "restarts")}   # a cap: the plateau rule may stop it earlier
    Params = Params

    def cost(self) -> dict:
        """The cost guard's estimate: per dummy image, local step (one dummy copy per epoch), iteration, restart and
        round, update_inversion's cost x 1.5 (bench/attack_cost.py, side by side); not fitted on a main job."""
        p = self.p
        its = p.iterations * p.restarts * max(1, len(p.rounds))
        return {"victim": 1.5, "image_step": 1.5 * 5.2 / 1e3 * its, "max_images": p.max_images}

    def __init__(self, params=None, device: str = "cpu"):
        super().__init__(params, device)
        if min(self.p.restarts, self.p.iterations, self.p.match_every, self.p.plateau_window) < 1:
            raise UserError("fedavg_leakage: restarts, iterations, match_every and plateau_window must be >= 1")

    def labels(self, net, params: dict, obs: dict, n: int, e: int, m: int, pr: Protocol, probe: torch.Tensor,
               gen: torch.Generator) -> torch.Tensor:
        """Per-copy labels (E, m): the label counts of the round's visits (bias-based estimator, the mean softmax
        of the ``probe`` images at θ^t and θ^{t+1}), scaled to one copy, in a random order per epoch."""
        head = [k for k, mod in net.named_modules() if isinstance(mod, torch.nn.Linear)][-1]
        steps = schedule(n, pr)[0]
        gw, gb = (grad_sum(obs[f"{head}.{w}"], params[f"{head}.{w}"], pr, [len(steps)]) for w in ("weight", "bias"))
        with torch.no_grad():
            pbar = torch.stack([functional_call(net, q, (probe,)).softmax(1).mean(0)
                                for q in (params, {k: params[k] + obs[k] for k in params})]).mean(0)
        counts = recover_labels(gw, gb, pbar, sum(len(i) for i in steps), len(steps))
        y0 = np.repeat(np.arange(len(counts)), round_to_total(counts, m))
        return torch.as_tensor(np.stack([y0[torch.randperm(m, generator=gen).numpy()] for _ in range(e)]),
                               device=self.device)

    def attack_update(self, net, theta: dict, after: dict, n: int, pr: Protocol, shape: tuple,
                      gen: torch.Generator, public: torch.Tensor | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """Images (m, C, H, W) and their labels from one client's download ``theta`` and upload ``after``;
        ``public``: the attacker's public images, the label estimator's probes (else uniform noise)."""
        names = [k for k, v in net.named_parameters() if v.requires_grad]
        net.train()
        torch.func.replace_all_batch_norm_modules_(net)
        params = {k: theta[k].to(self.device).float() for k in names}
        obs = {k: after[k].to(self.device).float() - params[k] for k in names}
        steps, m, e = epoch_steps(n, pr, self.p.max_images)
        probe = public[:self.p.probes] if public is not None and len(public) else \
            torch.rand((self.p.probes, *shape), generator=gen)
        y = self.labels(net, params, obs, n, e, m, pr, probe.to(self.device).float(), gen)
        x, labels, _, plat = leak(net, params, obs, y, steps, pr, shape, self.p, gen)
        self.cost = int(plat.its[0]), float(plat.cpu[0])   # iterations run, CPU seconds of the optimisation
        return x, labels.cpu().numpy()

    def run(self, view, aux):
        pr = Protocol.of(view.params)
        c, s, _ = view.shape
        outs, public = [], aux.public.x if aux is not None and aux.public is not None else None
        for v in sample_victims(view, view.clients, self.p.max_victims):
            seen = sorted({m.round for m in view.messages(kind="weights", sender=v)})
            ts = [t for t in seen if not self.p.rounds or t in self.p.rounds]
            n, how = client_size(view, v, pr, ts, aux)
            if n is None:
                outs.append(Skipped(v, "weights", 0, f"no n_samples message and no size estimate ({how})"))
                continue
            for t, theta, after in exchanges(view, v, ts):
                t0 = time.process_time()
                x, labels = self.attack_update(view.model(theta), theta, after, n, pr, (c, s, s),
                                               seeding.torch_gen(self.p.seed, v, t), public)
                outs.append(Reconstruction(v, "weights", t, x, labels=labels, variant=how, iterations=self.cost[0],
                                           cpu_seconds=time.process_time() - t0, plateau=plateau_words(self.p)))
        return outs

    def control(self):
        """Positive: 8 embedded digits, 2 local epochs of batch 4 (SGD lr 0.05, momentum 0.9) on cnn_small
        (GroupNorm), labels estimated with the other digits as public probes, at the attack's own budget: the best
        matched digit >= 15 dB. Negative: a pure-noise "update" of the same per-tensor norms gives no image within
        15 dB of any digit of the pool (the priors alone do not reconstruct). Both pass at seed 0
        (tests/test_conformance.py)."""
        from fdg_audit.api import DataConfig, ModelConfig, build_model, load_data
        from fdg_audit.api.method import TrainParams, make_optimizer

        d = load_data(DataConfig(dataset="digits", domains=["rot0"], per_domain=60)).domains[0].train
        torch.manual_seed(self.p.seed)
        net = build_model(ModelConfig("cnn_small"), 1, 10, 28).to(self.device)
        theta = {k: v.detach().clone() for k, v in net.state_dict().items()}
        tp = TrainParams(lr=0.05, batch_size=4, local_epochs=2)
        x0, y0 = d.x[:8].to(self.device), d.y[:8].to(self.device)
        opt = make_optimizer(tp, net.parameters())
        for _ in range(tp.local_epochs):
            for j in torch.randperm(8, generator=self._gen("order")).view(2, 4):
                opt.zero_grad()
                F.cross_entropy(net(x0[j]), y0[j]).backward()
                opt.step()
        after = {k: v.detach().clone() for k, v in net.state_dict().items()}
        atk, pr = FedAvgLeakage(self.p, str(self.device)), Protocol.of(vars(tp))   # at the configured budget
        fresh = lambda: (net.load_state_dict(theta), net)[1]  # noqa: E731
        x, _ = atk.attack_update(fresh(), theta, after, 8, pr, (1, 28, 28), self._gen("control"), d.x[8:])
        ps = float(M.matched_psnr(x.cpu(), x0.cpu()).max())
        noise = {k: theta[k] + torch.randn(v.shape, generator=self._gen("noise", k)).to(self.device)
                 * (v - theta[k]).norm() / v.numel() ** 0.5 if v.is_floating_point() else v for k, v in after.items()}
        xn, _ = atk.attack_update(fresh(), theta, noise, 8, pr, (1, 28, 28), self._gen("control-noise"), d.x[8:])
        pool = d.x.to(self.device)
        pn = float(M.psnr(xn[:, None].expand(-1, len(pool), -1, -1, -1).flatten(0, 1),
                          pool.repeat(len(xn), 1, 1, 1)).max())
        return [Control("fedavg_2ep_bs4_8img_cnn_small_best_psnr", "psnr", ps, 15.0),
                Control("noise_update_best_psnr", "psnr", pn, 15.0, positive=False)]

    def _gen(self, *keys) -> torch.Generator:
        return seeding.torch_gen(self.p.seed, *keys)
