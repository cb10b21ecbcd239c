"""Update inversion (docs/attacks.md §2, rows G1/G2/G4): rebuild a client's images from the weights it uploads.

Threat models (``adversary_view``):
  * "server" (honest-but-curious server, the default): per round t it sees the broadcast global state θ^t and
    every client's upload θ_k^{t+1}; the observed update is Δ_k = θ_k^{t+1} − θ^t on the trainable parameters.
  * "client" (curious client, the weaker row; cf. Wilson et al. 2024): it sees only consecutive global models
    and its own upload. With K clients and (assumed) equal weights, θ^{t+1} − θ^t − Δ_me/K is the mean of the
    other K − 1 updates; the attack models them as P = min(K − 1, ``max_parties``) virtual clients with their own
    dummy sets, matches the mean of their simulated updates to that mean (exact when P = K − 1; with more clients
    the P dummy sets stand for all K − 1 sets, an approximation that keeps an iteration at P unrolls instead of
    K − 1), and scores the reconstructions against the union of the other clients' training
    sets (victim "a+b+..."). Under client-level DP each client clips its update to C before the mean; the clip is
    public (the envelope of the client's own upload records the round's C), so every virtual update is clipped the
    same way before averaging (a single party's clip does not change the cosine objective, so the server view
    needs none; the label-count estimator ignores the clip's scale).
The protocol is public (Kerckhoffs): lr, optimizer (sgd/adam), momentum, weight decay, batch size B,
local_steps / local_epochs come from ``view.params``; the victim's data size n_k from its ``n_samples`` message
(a curious client assumes the others hold as many images as it does; a server that received no n_samples, as
with CSAC, searches n_k: the powers of two up to the update-norm estimate of ``dataset_size`` (its public data),
each probed for one plateau window, the smallest within 5% of the best objective kept: output variant
"n_searched"; where the envelope records noise (client-level DP, DP-SGD) the norm is mostly noise and
would ask for an unbounded unroll, so the server assumes one batch per epoch, n_k = B: variant "n_assumed"). FedSGD is ``local_steps = 1``.

Attack (Inverting Gradients, Geiping et al. 2020, with the FedAvg unrolling of breaching's multi-step user):
  * dummy images x̂ in [0, 1] (``box`` = "clamp": projected after every step, as breaching; or "sigmoid"),
    uniform random start, ``restarts`` of them optimised together (torch.func.vmap), the best objective kept;
  * the client's local training is simulated exactly and differentiably: torch.func.functional_call + grad for
    every local step with the known optimizer (torch's SGD with momentum / weight decay, or Adam), momentum
    buffers starting at zero (clients build a fresh optimizer each round), so at the true images, labels and
    batch order the simulated update equals the observed one (objective 0; tests/test_inversion.py);
  * the batch order is unknown: the dummy set holds the images of one pass over the data the round touched
    (min(steps·B, n_k), capped at ``max_images``), step s uses its slice as the client's epoch loop would
    (last batch of an epoch shorter), later epochs reuse the same slices (breaching's multi-step user; Dimitrov
    et al. tie one variable per epoch instead — not done here); with a ``max_images`` cap slices wrap around;
  * objective 1 − cos(simulated update, observed update) over all trainable parameters + ``tv`` · TV(x̂)
    (mean absolute neighbour differences); Adam on the signed gradient, step ``lr``, × 0.1 at each of a victim's
    first 3 plateaus, stopping at its 4th or at the cap (``iterations``, ``max_cpu_seconds``). A plateau is the
    shared rule of every reconstruction (attacks/images.py ``Plateau``): the victim's best objective improved by
    less than ``plateau_tol`` (relative) over ``plateau_window`` iterations, checked every window;
  * the victims of a run that unroll the same schedule (the same n_k) are one vmapped batch (``invert_many``):
    their objectives are independent, each has its own step size and stops at its own plateau (it then leaves the
    batch), so the result is each victim's own optimisation (tests/test_inversion.py); each output records its
    iterations, its CPU seconds (its label recovery plus its share of the batch's process time; the shared
    learned prior's training not included) and the rule;
  * BatchNorm: the simulation uses batch statistics (train mode). With ``bn_prior`` > 0 and running statistics
    in the upload (G4), the simulated running mean/var (same momentum recursion as torch) must also match the
    uploaded ones: + bn_prior · Σ_l relative squared error (DeepInversion's prior, here exact at the truth).
Prior (``prior``): "none" (the default: pixel space, TV only) or "learned": the dummy images are decode(z) of the
VAE the attacker trains on its public images (attacks/prior.py, the same object as the amplitude attack's), and the
latents z ~ N(0, I) are optimised instead of pixels (same objective, optimiser and budget); output variant "learned".
Labels are never given: ``recover_labels`` reads them off the last layer. One image in one step: iDLG (the
only row of ∇W_last with a negative sum). Otherwise the bias-based count estimator: per step the bias gradient
is p̄ − n_c/b, so summed over T steps n_c ≈ b·(T·p̄_c − Σ_s g_s,c), where Σ_s g_s is −Δb/lr (momentum-weighted
step count and weight decay removed) and p̄ is the model's mean softmax on random probe images at θ^t and
θ^{t+1} (in the spirit of Dimitrov et al., who interpolate between the two models). Counts are rounded by largest
remainder and dealt to the dummy images in a seeded random order. The labels are scored as ``label_acc`` of the
matched images and, when the round covers the whole training set, as an Estimate("label_counts").
A labels-given oracle (true labels in the true batch order, breaching's FedAvg case) is not a plugin variant,
since truth never reaches ``run``: call ``invert`` with the labels yourself to measure it next to this attack.

Scoring (the shared scorer): the client does not record its batches, so reconstructions are matched to the
victim's whole training set with the Hungarian algorithm on MSE (IIP-like), the mean image matched the same way
is the baseline. SSIM is plain Gaussian-window SSIM (not breaching's CW-SSIM).

Deviations from the paper/breaching: TV weight 0.1 and a cap of 400 iterations by default (CPU-sized; tuned on the
embedded digits, whose black background favours a strong TV prior; the plateau rule's 4 plateaus took 300-450
iterations on 1 real digit and 450-700 on 4, one local epoch on cnn_small, so a cap of 400 often ends the
optimisation before its last plateau: raise ``iterations`` to run to the plateau); breaching's IG uses 24 000 iterations,
TV 0.2 (ImageNet) / 1e-3 (its CIFAR FedAvg notebook) and 1 restart; full strength on a GPU: iterations = 24000,
restarts = 4, max_images = 0 (whole round). Only rounds in ``rounds`` are attacked (default the first).
The classifier is the model's last nn.Linear. Methods whose local objective is not plain cross-entropy (FedSR,
COPA, ...) and DP-SGD clients (Poisson batches, clipping, noise) are attacked as if they ran plain SGD (a model
mismatch an attacker who knows the method would remove; adding the method's loss is future work).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.api import UserError, seeding
from fdg_audit.api.attack import Attack, AttackParams, Control, Estimate, Reconstruction, Skipped, sample_victims

from .images import PLATEAU_TOL, PLATEAU_WINDOW
from .labels import round_to_total
from .prior import learned_prior, settings_of
from .unroll import (STAGES, Protocol, _BNStats, _opt_step, batch_loss, client_size, clip_of, cosine_loss,  # noqa: F401
                     exchanges, grad_sum, invert, invert_many, mean_softmax, noise_on, per_sample, plateau_words,
                     recover_labels, schedule, signature, simulate)


@dataclass
class Params(AttackParams):
    adversary_view: str = "server"    # server (each client's upload) | client (consecutive global models)
    rounds: list = field(default_factory=lambda: [1])   # rounds attacked; [] = every round
    iterations: int = 400             # iteration cap per victim (CPU default; full strength 24000, breaching IG)
    plateau_window: int = PLATEAU_WINDOW   # the plateau rule (attacks/images.py Plateau): relative improvement of
    plateau_tol: float = PLATEAU_TOL       # the best objective < tol over a window of its, checked every window;
    #                                        0 = no plateau (constant step to the cap)
    max_cpu_seconds: float = 0.0      # CPU-seconds cap per victim (its share of a batch; 0 = none)
    restarts: int = 2                 # optimised together; the best objective is kept
    lr: float = 0.1                   # Adam step on the signed gradient, decayed x0.1 at 3/8, 5/8, 7/8
    tv: float = 0.1                   # total-variation weight
    box: str = "clamp"                # clamp (project onto [0, 1]) | sigmoid (x = sigmoid(z))
    max_images: int = 64              # cap on the dummy set per client-round (0 = no cap)
    bn_prior: float = 0.0             # weight of the BN running-statistics term (models with BatchNorm)
    probes: int = 64                  # random images for the mean softmax of the label-count estimator
    prior: str = "none"               # none (pixel space) | learned (latents of a VAE trained on aux.public)
    prior_latent: int = 16            # the learned prior (attacks/prior.py PriorSettings): latent dimension,
    prior_steps: int = 1200           # training steps,
    prior_rotate: float = 90.0        # rotation augmentation (+- degrees)
    max_parties: int = 8              # curious client: virtual clients unrolled for the K - 1 others (0 = all)
    seed: int = 0


# --------------------------------------------------------------------------------- plugin

class UpdateInversion(Attack):
    name = "update_inversion"
    consumes = ("weights",)
    adversary = "server"
    aux = ("public",)             # only to estimate n_k (update-norm calibration) when no n_samples was sent
    outputs = {"": "the public protocol (optimizer, lr, batch size, local steps) and the n_k the client sent (a "
                   "curious client: equal weights, the others hold as many images as it does, at most max_parties of "
                   "them unrolled, each clipped to the recorded DP clip); labels read off the last layer; local "
                   "training simulated as plain cross-entropy SGD/Adam",
               "n_searched": "as the main output, with n_k chosen by the attack's own objective among the powers "
                             "of two up to the update-norm estimate (against the attacker's training on public "
                             "images)",
               "n_assumed": "as the main output, with n_k assumed to be one batch (the upload is noised, so its norm "
                            "says nothing about n_k; or the method sends no n_k, for a curious client)",
               "learned": "learned prior: images decoded from the latent space of a VAE trained on the attacker's "
                          "public images of the held-out domain (another domain than the victims', "
                          "rotation-augmented); same objective and budget as pixel space"}
    priors = {"*": "none", "learned": "learned", "n_searched/learned": "learned", "n_assumed/learned": "learned"}
    knows = ("architecture", "local_hyperparams")
    budget = {"*": (("iterations",), "restarts")}   # a cap: the plateau rule may stop it earlier
    Params = Params

    def __init__(self, params=None, device: str = "cpu"):
        super().__init__(params, device)
        if self.p.adversary_view not in ("server", "client"):
            raise UserError(f"update_inversion: adversary_view = {self.p.adversary_view!r}; use \"server\" or "
                            "\"client\"")
        if self.p.box not in ("clamp", "sigmoid"):
            raise UserError(f"update_inversion: box = {self.p.box!r}; use \"clamp\" or \"sigmoid\"")
        if self.p.restarts < 1 or self.p.iterations < 1 or self.p.max_parties < 0 or self.p.plateau_window < 1:
            raise UserError("update_inversion: restarts, iterations and plateau_window must be >= 1, max_parties >= 0 "
                            "(0 = all)")
        if self.p.prior not in ("none", "learned"):
            raise UserError(f"update_inversion: prior = {self.p.prior!r}; use \"none\" or \"learned\"")
        self.adversary = self.p.adversary_view

    def cost(self) -> dict:
        """The cost guard's estimate (fdg_audit.audit.coverage.estimate): 5.2 ms per dummy image, local step of the
        victim's update, iteration, restart and round (an iteration unrolls the local steps), 1.5 s per victim, and the
        learned prior's training per run (its steps); fitted on the main job's update inversion of small clients
        (FedAvg and FedDG send n_samples; CSAC's size search costs more, the plateau rule stops some victims early)."""
        p = self.p
        its = p.iterations * p.restarts * max(1, len(p.rounds))
        group = {"victims": 1, "parties": p.max_parties} if p.adversary_view == "client" else {}   # the others' mean
        return {"run": 25.0 * p.prior_steps / 1e3 if p.prior == "learned" else 0.0, "victim": 1.5,
                "image_step": 5.2 / 1e3 * its, "max_images": p.max_images, **group}

    def _gen(self, *keys) -> torch.Generator:
        return seeding.torch_gen(self.p.seed, *keys)

    def _prepare(self, view, theta: dict):
        """The attacker's model at θ^t, its trainable parameters (dict) and BN hooks (with ``bn_prior``)."""
        net = view.model(theta).train()
        bn = _BNStats(net) if self.p.bn_prior > 0 else None
        names = [k for k, v in net.named_parameters() if v.requires_grad]
        torch.func.replace_all_batch_norm_modules_(net)   # batch statistics only, no in-place buffer updates
        params = {k: theta[k].to(self.device).float() for k in names}
        if bn is not None:
            bn.start = {(k, s): theta[f"{k}.running_{s}"].to(self.device).float()
                        for k in bn.names for s in ("mean", "var") if f"{k}.running_{s}" in theta}
            if len(bn.start) < 2 * len(bn.names) or not bn.names:
                bn = None
        return net, params, bn

    def attack_update(self, view, theta: dict, after: dict, obs: dict, parties, gen: torch.Generator,
                      obs_bn: dict | None = None, prior=None, pr: Protocol | None = None):
        """Labels then images for one observed (mean) update; returns images, labels, counts per visit. ``prior``:
        a learned prior whose latents are optimised instead of pixels (attacks/prior.py); ``pr``: the protocol
        (default the public one of ``view.params``)."""
        x, labels, counts = self.attack_updates(view, [(theta, after, obs, parties, gen, obs_bn)], prior, pr)[0][:3]
        return x, labels, counts

    def attack_updates(self, view, jobs: list, prior=None, pr: Protocol | None = None, p: Params | None = None
                       ) -> list[tuple]:
        """``attack_update`` for several victims that unroll the same ``parties`` schedule, as one batched
        optimisation (``invert_many``); ``jobs``: (theta, after, obs, parties, gen, obs_bn) each; ``p``: the
        attack's settings (default its own). Returns per job (images, labels, counts, iterations run, CPU seconds:
        its own label recovery plus its share of the batch, best objective)."""
        pr, p = pr or Protocol.of(view.params), p or self.p
        c, s, _ = view.shape
        shape, prep = (c, s, s), []
        for theta, after, obs, parties, gen, obs_bn in jobs:
            t0 = time.process_time()
            net, params, bn = self._prepare(view, theta)
            steps = [len(st) for st in parties]
            visits = sum(len(i) for st in parties for i in st)
            m = int(max(int(i.max()) for st in parties for i in st) + 1)
            obs = {k: obs[k].to(self.device).float() for k in params}
            head = [k for k, mod in net.named_modules() if isinstance(mod, torch.nn.Linear)][-1]   # the classifier
            hw, hb, j = f"{head}.weight", f"{head}.bias", len(parties)
            gw = grad_sum(j * obs[hw], params[hw], pr, steps)
            gb = grad_sum(j * obs[hb], params[hb], pr, steps)
            states = [params, {k: params[k] + after[k].to(self.device).float() - theta[k].to(self.device).float()
                               for k in params}]
            pbar = mean_softmax(net, states, shape, self.p.probes, gen, self.device)
            counts = recover_labels(gw, gb, pbar, visits, sum(steps))
            labels = np.repeat(np.arange(len(counts)), round_to_total(counts, m))
            labels = labels[torch.randperm(m, generator=gen).numpy()]
            obs_bn = {k: v.to(self.device).float() for k, v in obs_bn.items()} if bn is not None and obs_bn else None
            prep.append((net, params, bn, obs, labels, counts, obs_bn, time.process_time() - t0))
        net, _, bn = prep[0][:3]
        x, loss, plat = invert_many(net, [q[1] for q in prep], [q[3] for q in prep],
                                    [torch.as_tensor(q[4], device=self.device) for q in prep], jobs[0][3], pr, shape,
                                    p, [j[4] for j in jobs], bn, [q[6] for q in prep], prior=prior)
        loss = loss.tolist()
        return [(x[i], q[4], q[5], int(plat.its[i]), q[7] + float(plat.cpu[i]), loss[i]) for i, q in enumerate(prep)]

    def _search_sizes(self, view, found: list, prior, pr: Protocol) -> None:
        """The server's n_k where no n_samples was sent: the powers of two up to the update-norm estimate's next
        one (at least 32) are tried in turn on each victim for one plateau window (``plateau_window`` iterations at
        the starting step, every victim in one batch; a size that trains exactly as a smaller one, because the
        dummy set is capped, is not tried again; the search stops at the first size that fits every victim worse
        than a smaller size by over 5%); the smallest size whose objective is within 5% of the best is kept
        (``found[i][2]``), and the probes' CPU seconds are added to the victim's (``found[i][5]``).
        Selection by the attack's own objective, never by truth: a method whose local objective is not plain
        cross-entropy (CSAC's alignment terms) moves its norm estimate far from n_k (80-464 for clients of 1-16
        images), and unrolling the estimate costs one step per 32 images."""
        if not found:
            return
        top = max(32, max(f[2] for f in found))
        sizes = [2 ** k for k in range(int(np.ceil(np.log2(top))) + 1)]
        probe = dataclasses.replace(self.p, iterations=self.p.plateau_window, plateau_tol=0.0)
        losses, seen = [], set()
        for n in sizes:
            key = signature(n, pr, self.p.max_images)
            if key in seen:   # a capped dummy set: this size trains exactly as a smaller one did
                losses.append(losses[-1])
                continue
            seen.add(key)
            steps = schedule(n, pr, self.p.max_images)[0]
            res = self.attack_updates(view, [f[4][:3] + ([steps],) + f[4][4:] for f in found], prior, pr, probe)
            losses.append([r[5] for r in res])
            for f, r in zip(found, res):
                f[5] += r[4]
            if len(losses) > 1 and (np.asarray(losses[-1]) > 1.05 * np.min(losses, 0)).all():
                break   # every victim fits this size worse than a smaller one: larger ones unroll more, fit worse
        sizes, losses = sizes[:len(losses)], np.asarray(losses)   # (sizes tried, victims)
        for i, f in enumerate(found):
            f[2] = sizes[int(np.argmax(losses[:, i] <= 1.05 * losses[:, i].min()))]

    def run(self, view, aux):
        pr = Protocol.of(view.params)
        rounds = [self.p.rounds] if isinstance(self.p.rounds, int) else list(self.p.rounds)
        prior = learned_prior(aux.public.x.to(self.device), settings_of(self.p), self.p.seed, view) \
            if self.p.prior == "learned" else None
        tag = lambda how: "/".join(filter(None, (how, "learned" if prior is not None else "")))  # noqa: E731
        if self.p.adversary_view == "server":
            found, outs = [], []
            for v in sample_victims(view, view.clients, self.p.max_victims):
                ts = self._rounds(view, rounds)
                # fixed local steps are unrolled without n_k; epochs need it (sent, assumed or searched)
                n, how = client_size(view, v, pr, ts, aux, infer=pr.local_steps <= 0)
                how = "n_searched" if how == "n_estimated" else how   # the estimate bounds the search
                if n is None and pr.local_steps <= 0:
                    outs.append(Skipped(v, "weights", 0, "no n_samples message and no size estimate "
                                        f"({how}): epoch-based local training cannot be unrolled"))
                    continue
                for t, theta, after in exchanges(view, v, ts):
                    obs = {k: after[k].float() - theta[k].float() for k in after if after[k].is_floating_point()}
                    obs_bn = {(k.rsplit(".", 1)[0], k.rsplit("_", 1)[1]): after[k] for k in after
                              if k.endswith(("running_mean", "running_var"))}
                    outs.append(len(found))   # a slot, filled below
                    found.append([v, t, n, how, (theta, after, obs, None, self._gen(v, t), obs_bn), 0.0])
            self._search_sizes(view, [f for f in found if f[3] == "n_searched"], prior, pr)
            groups, weighted = {}, per_sample(view.new_model())   # victims whose dummy sets train the same way
            for i, f in enumerate(found):                              # are inverted as one batch
                key = signature(f[2], pr, self.p.max_images) if weighted else f[2]
                groups.setdefault((key, f[:2] if self.p.bn_prior > 0 else None), []).append(i)
            res, visits = {}, {}
            for idx in groups.values():
                steps = schedule(found[idx[0]][2], pr, self.p.max_images)[0]
                res.update(zip(idx, self.attack_updates(view, [found[i][4][:3] + ([steps],) + found[i][4][4:]
                                                               for i in idx], prior, pr)))
                visits.update(dict.fromkeys(idx, sum(len(i) for i in steps)))   # the counts' total
            filled = []
            for o in outs:
                if not isinstance(o, int):
                    filled.append(o)
                    continue
                (v, t, n, how, _, searched), (x, labels, counts, its, cpu, _) = found[o], res[o]
                filled.append(Reconstruction(v, "weights", t, x, labels=labels, variant=tag(how),
                                             cpu_seconds=cpu + searched, iterations=its,
                                             plateau=plateau_words(self.p)))
                covered = sum(len(i) for i in schedule(n, pr, self.p.max_images)[0]) >= (n or 0)
                if n is not None and covered and how != "n_searched":   # the round covered the whole set
                    filled.append(Estimate(v, "weights", t, "label_counts", counts * n / visits[o]))
            return filled
        return self._run_client(view, pr, rounds, prior, tag)

    def _run_client(self, view, pr: Protocol, rounds: list, prior, tag) -> list:
        """Adversary view "client": the other clients' aggregate update, from consecutive global models."""
        outs, me, k = [], view.me, len(view.clients)
        others = [c for c in view.clients if c != me]
        n = view.messages(kind="n_samples", sender=me)
        n, how = (int(n[0].payload["n"]), "") if n else (None if pr.local_steps > 0 else pr.batch_size, "n_assumed")
        for t in self._rounds(view, rounds):
            down = view.messages(kind="weights", sender="server", receiver=me, round=t)
            nxt = view.messages(kind="weights", sender="server", receiver=me, round=t + 1)
            up = view.messages(kind="weights", sender=me, round=t)
            if not down or not nxt or not up:
                continue
            theta, new, mine = down[0].payload.arrays, nxt[0].payload.arrays, up[0].payload.arrays
            obs = {key: (new[key].float() - theta[key].float() - (mine[key].float() - theta[key].float()) / k)
                   * k / (k - 1) for key in new if new[key].is_floating_point()}
            pt = dataclasses.replace(pr, clip=clip_of(up))
            parties, off = [], 0
            for _ in others[:self.p.max_parties or len(others)]:
                steps, m = schedule(n, pr, self.p.max_images, off)
                parties.append(steps)
                off += m
            after = {key: theta[key].float() + obs[key] for key in obs}
            x, labels, _, its, cpu, _ = self.attack_updates(
                view, [(theta, after, obs, parties, self._gen(me, t), None)], prior, pt)[0]
            outs.append(Reconstruction("+".join(others), "weights", t, x, labels=labels, variant=tag(how),
                                       cpu_seconds=cpu, iterations=its, plateau=plateau_words(self.p)))
        return outs

    @staticmethod
    def _rounds(view, rounds: list) -> list[int]:
        seen = sorted({m.round for m in view.messages(kind="weights", sender="server")} - {0})
        return [t for t in seen if not rounds or t in rounds]

    def control(self):
        """Positive: one embedded digit, FedSGD batch 1 on cnn_small (GroupNorm) → PSNR ≥ 20 dB and the iDLG
        label right. Negative: a pure-noise "update" (no image behind it) must not produce an image within
        20 dB of any of the candidate digits (the prior alone does not reconstruct)."""
        from fdg_audit.api import DataConfig, ModelConfig, build_model, load_data
        from fdg_audit.api import metrics as M
        from fdg_audit.api.method import TrainParams, make_optimizer

        dev = self.device
        d = load_data(DataConfig(dataset="digits", domains=["rot0"], per_domain=60)).domains[0].train
        torch.manual_seed(self.p.seed)
        net = build_model(ModelConfig("cnn_small"), 1, 10, 28).to(dev)
        theta = {k: v.detach().clone() for k, v in net.state_dict().items()}
        tp = TrainParams(lr=0.05, batch_size=1, local_steps=1)
        x0, y0 = d.x[:1].to(dev), d.y[:1].to(dev)
        opt = make_optimizer(tp, net.parameters())
        F.cross_entropy(net(x0), y0).backward()
        opt.step()
        obs = {k: v.detach() - theta[k] for k, v in net.state_dict().items()}
        pr = Protocol.of(vars(tp))
        steps, _ = schedule(None, pr)
        net0 = build_model(ModelConfig("cnn_small"), 1, 10, 28).to(dev)
        net0.load_state_dict(theta)
        params = {k: v.detach() for k, v in net0.named_parameters()}
        gw = grad_sum(obs["head.weight"], params["head.weight"], pr, [1])
        gb = grad_sum(obs["head.bias"], params["head.bias"], pr, [1])
        label = int(recover_labels(gw, gb, torch.full((10,), 0.1, device=dev), 1, 1).argmax())
        y = torch.tensor([label], device=dev)
        # at least the default budget: the controls check the algorithm, not a CPU-sized scenario budget
        cp = dataclasses.replace(self.p, iterations=max(self.p.iterations, Params.iterations),
                                 restarts=max(self.p.restarts, Params.restarts))
        x, _ = invert(net0, params, obs, y, [steps], pr, (1, 28, 28), cp, self._gen("control"))
        ps = float(M.psnr(x.clamp(0, 1).cpu(), x0.cpu()).squeeze())
        noise = {k: torch.randn(v.shape, generator=self._gen("noise", k)).to(dev) * v.norm() / v.numel() ** 0.5
                 for k, v in obs.items()}
        xn, _ = invert(net0, params, noise, y, [steps], pr, (1, 28, 28), cp, self._gen("control-noise"))
        pool = d.x.to(dev)
        pn = float(M.psnr(xn.expand_as(pool).clamp(0, 1).cpu(), pool.cpu()).max())
        return [Control("fedsgd_bs1_cnn_small_psnr", "psnr", ps, 20.0),
                Control("fedsgd_bs1_idlg_label", "label_acc", float(label == int(y0)), 1.0),
                Control("noise_update_best_psnr", "psnr", pn, 20.0, positive=False)]
