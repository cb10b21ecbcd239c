"""FADA: federated adversarial domain adaptation (Peng, Huang, Zhu, Saenko; ICLR 2020), docs/methods.md §10.

Domain adaptation, not generalization: the held-out domain takes part with its unlabeled images (``adaptation``:
the federation adds a target client whose labels are -1 before it is built), so FADA's held-out accuracy is
"domain adaptation (target seen, unlabeled)" and the report labels it so. No official code could be read
(VisionLearningGroup/FADA is not in the index): this follows the paper's equations as the seed survey blog gives
them (its §2.1; the blog is not in the repository), [unverified] where from memory of the paper, and the choices below.

Modules. The shared model (``build``: what ``weights`` carries and the harness evaluates) is G -> D_di -> C with
G = the Net's trunk + neck (the feature generator, D-dim), D_di = Linear(D, D) + ReLU (the disentangler's
domain-invariant branch) and C = the Net's head on f_di. Private to each source, never sent: the domain-specific
branch D_ds (Linear + ReLU), the class identifier CI (Linear(D, classes)), the MINE network T([f_di, f_ds]) (MLP
2D -> mine_hidden -> 1) and the reconstructor R (Linear(2D, D)). At the server: one domain identifier DI_k per
source (``discriminator``: MLP D -> disc_hidden -> 1 logit) that only ever sees representations.
The representation is G(x), what the paper's DI sees: ``FADA.encode(model, x) -> (N, D)`` (eval mode), public,
as are ``FADA.classify(model, f)`` (C(D_di(f)): the head does not take f itself) and ``FADA.discriminator``.

Round t >= 1 (round 0 is empty):
1. ``disc`` (once DIs exist, t >= 2): the server sends DI_k's state (kind ``discriminator``) to each active source k
   and every active source's DI to the target (arrays ``<source>/<name>``).
2. ``train``: the server broadcasts the target model P (kind ``weights``) to the active sources and the target.
   A source loads it and takes one step per mini-batch (``local_epochs`` or ``local_steps``) on, with h = G(x),
   f = D(h), f' = D(sg h) (the disentangling terms train the disentangler, not G, as eq. 4 says):
       CE(C(f_di), y) + CE(CI(sg f_ds'), y)                      eq. 3
     + ent_weight * sum_c p_c log p_c,  p = CI(f_ds') frozen CI    eq. 4: f_ds fools the class identifier
     + mi_weight * I_T(f_di', f_ds'), T frozen                     eq. 5-6: MINE (Donsker-Varadhan, shuffled pairs)
     + rec_weight * ||R([f_di', f_ds']) - sg h||^2                  reconstruction [unverified]
     + adv_weight * -log DI_k(h)                                   eq. 2, G_k's part (``source_adv``)
   then one step of T on the bound (maximised). The target loads P and trains G only over its unlabeled images on
   adv_weight * mean_k -log DI_k(G(x_t)) (eq. 2, G_t's part); without DIs (round 1) it does not train. Every party
   uploads its model (kind ``weights``).
3. ``features``: every party sends G(x) of ``feature_batches`` shuffled mini-batches of its training images,
   computed with the model it just uploaded (kind ``features``, ``{"features": (N, D)}``, one message; the truth
   record ``features_r<t>`` holds the rows' image ids). The server trains each DI_k ``disc_steps`` full-batch Adam
   steps on eq. 2, DI's part: -log DI_k(G_k(x_s)) - log(1 - DI_k(G_t(x_t))).
4. ``attention`` (``attention = "gap"``): the server relays the sources' uploads to the target (kind
   ``source_weights``, arrays ``<source>/<name>``); the target encodes its training images with each source model,
   runs k-means (k = classes, ``kmeans_iters`` Lloyd steps from the same seeded rows) and replies each source's
   within-cluster dispersion over the total scatter of the L2-normalised features (kind ``metric``, one scalar per
   source). Gain_k = I_k(previous report) - I_k(now), 0 the first time; alpha = softmax(gain / attention_temp) over
   the round's sources. ``"uniform"``: alpha = 1/K and no relay.
5. Dynamic attention: P <- P + (P_t - P) + sum_k alpha_k (P_k - P): the target's own adversarial update plus the
   attention-weighted source updates [unverified reading of "the target's update is the weighted sum of the
   sources'"]. Integer buffers (num_batches_tracked) are the target's.

What crosses the bus beyond FedAvg: representations of sources and target (up), the discriminators (down), and
every source's model relayed to the target (a client reads other clients' models). The blog's claim, "DI only
accesses the output representations, so it does not violate the federated privacy setting", is what the
``features`` attacks measure. Client-level DP covers the ``weights`` uploads (the target's too); features,
discriminators and dispersions are outside it unless ``[privacy.artifacts]`` privatizes them (features: per row).
The attention weights come from unprivatized target statistics, so central mode is refused (``aggregate_share``
inf). ``participation < 1`` samples the sources; the target takes part every round (the protocol needs it).

Differences from the paper and choices (CPU, digits scale):
- One feature message per party per round (the representations cross the bus): DI is trained once per round on
  them and the extractors train against the previous round's DI (paper: alternation per mini-batch).
- Eq. 3 trains D with CI's cross-entropy while eq. 4 trains D to fool CI; here CI's cross-entropy trains CI only
  (on sg f_ds) and eq. 4 trains D_ds: the min-max both equations describe, without opposing gradients on D_ds.
- Eq. 4 as the blog writes it, -1/n sum log CI(f_ds), is read as the negative entropy (its stated aim).
- MINE without the moving-average gradient correction of Belghazi et al.
- ``source_adv = "paper"``: eq. 2 as written (G_k keeps its features "source"); ``"flip"``: -log(1 - DI_k(h))
  (sources move towards the target too); ``"off"``: sources are left out of the game.
- The paper's disentangler is one module with two outputs; here two branches, and only D_di (which C needs) is
  aggregated [unverified: what the paper aggregates]. The reconstructor's input/target are [unverified].
- "Gap statistics": Tibshirani's gap compares log W_k with a null reference; the paper's gain uses the dispersion
  itself [unverified]; here it is normalised by the total scatter so a feature scale change is no gain.
- Loss weights, DI/MINE sizes, Adam for DI and SGD (shared settings, re-created every round) elsewhere are ours;
  the paper's digit setting trains its own CNNs longer. Measured on rotated digits (one seed each, issue 23):
  ``adv_weight = 1`` drove tiny-digits runs to chance by round 3 (the target trains G alone for an epoch against a
  DI frozen since the last round, and its whole update enters P), 0.1 trains; ``attention_temp = 0.05`` put most
  of each round's update on one source (MNIST rot30, 8 rounds: 0.405 against 0.51 with uniform weights), 1 keeps
  the paper's plain softmax, near uniform on the normalised dispersions; a randomly initialised D_di slowed
  training (0.08 against 0.29 after round 1), so D_di starts as the identity (G's output is already >= 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fdg_audit.api import Net, UserError, records
from fdg_audit.api.method import (Client, MethodPlugin, Party, Reply, Server, TrainParams, default_build, load_arrays,
                                 make_optimizer, register_kind, state_arrays)

for _kind in ("features", "discriminator", "source_weights"):
    register_kind(_kind)


@dataclass
class Params(TrainParams):
    adv_weight: float = 0.1        # weight of eq. 2's generator terms (sources and target); 1 collapses (docstring)
    source_adv: str = "paper"      # paper: -log DI(G_k(x_s)) | flip: -log(1 - DI(G_k(x_s))) | off
    ent_weight: float = 0.1        # eq. 4
    mi_weight: float = 0.1         # eq. 5-6 (MINE)
    rec_weight: float = 0.1        # reconstruction
    mine_hidden: int = 0           # 0 = feature dim
    disc_hidden: int = 0           # 0 = feature dim
    disc_steps: int = 20           # full-batch DI steps per round at the server
    disc_lr: float = 1e-3          # DI's Adam lr
    feature_batches: int = 2       # mini-batches of representations each party sends per round
    attention: str = "gap"         # gap (dynamic attention) | uniform
    attention_temp: float = 1.0    # softmax temperature of the dispersion gains (1: the paper's plain softmax)
    kmeans_iters: int = 20

    def __post_init__(self):
        if self.source_adv not in ("paper", "flip", "off"):
            raise UserError(f"fada source_adv = {self.source_adv!r}: use \"paper\", \"flip\" or \"off\"")
        if self.attention not in ("gap", "uniform"):
            raise UserError(f"fada attention = {self.attention!r}: use \"gap\" or \"uniform\"")
        if min(self.adv_weight, self.ent_weight, self.mi_weight, self.rec_weight, self.disc_lr) < 0 or \
                self.attention_temp <= 0 or self.feature_batches < 1 or self.disc_steps < 0 or self.kmeans_iters < 1:
            raise UserError("fada: weights and disc_lr must be >= 0, attention_temp > 0, feature_batches and "
                            "kmeans_iters >= 1, disc_steps >= 0")


class FadaNet(Net):
    """G (trunk + neck) -> D_di -> C: ``extract`` is G(x), ``features`` f_di (what the head sees)."""

    def __init__(self, net: Net):
        super().__init__(list(net.trunk), net.neck, net.head, net.feature_dim)
        self.di = nn.Sequential(nn.Linear(net.feature_dim, net.feature_dim), nn.ReLU())
        nn.init.eye_(self.di[0].weight)      # starts as the identity on G's (ReLU) output: see the docstring
        nn.init.zeros_(self.di[0].bias)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return Net.features(self, x)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.di(self.extract(x))


def build(party: Party) -> FadaNet:
    return FadaNet(default_build(party)).to(party.device)


def encode(model: FadaNet, x: torch.Tensor) -> torch.Tensor:
    """The representation the domain identifier sees, G(x) (N, D), in eval mode (the model's mode is restored)."""
    was = model.training
    model.eval()
    try:
        return model.extract(x).flatten(1)
    finally:
        model.train(was)


def classify(model: FadaNet, f: torch.Tensor) -> torch.Tensor:
    """Class logits of representations f = G(x): the head sees D_di's output, C(D_di(f))."""
    return model.head(model.di(f))


def discriminator(dim: int, hidden: int) -> nn.Module:
    """DI: representation -> one logit (DI(h) = sigmoid(logit) = P(source))."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1))


def discriminator_from(arrays: dict, device) -> nn.Module:
    w = arrays["0.weight"]
    return load_arrays(discriminator(w.shape[1], w.shape[0]).to(device), arrays).requires_grad_(False)


def by_prefix(arrays: dict) -> dict[str, dict]:
    """{"<party>/<name>": v} -> {party: {name: v}} (party ids may hold "/", names do not)."""
    out = {}
    for k, v in arrays.items():
        who, _, name = k.rpartition("/")
        out.setdefault(who, {})[name] = v
    return out


def mine_bound(T: nn.Module, a: torch.Tensor, b: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Donsker-Varadhan lower bound of I(a; b): E_joint T - log E_marginal e^T (b shuffled by perm)."""
    marg = T(torch.cat([a, b[perm]], 1))[:, 0]
    return T(torch.cat([a, b], 1)).mean() - (torch.logsumexp(marg, 0) - math.log(len(marg)))


def dispersion(f: torch.Tensor, init: torch.Tensor, iters: int) -> float:
    """k-means (centres from rows ``init``) on L2-normalised f: within-cluster over total scatter."""
    f = F.normalize(f, dim=1)
    mu, k = f[init], len(init)
    for _ in range(iters + 1):
        a = torch.cdist(f, mu).argmin(1)
        one = F.one_hot(a, k).to(f.dtype)
        n = one.sum(0)[:, None]
        mu = torch.where(n > 0, one.T @ f / n.clamp_min(1), mu)
    within = ((f - mu[torch.cdist(f, mu).argmin(1)]) ** 2).sum()
    return float(within / ((f - f.mean(0)) ** 2).sum().clamp_min(1e-12))


class FADAClient(Client):
    new_model = build

    def setup(self):
        self.model, self.DI = self.new_model(), {}
        if self.id != self.target:
            d, k, p = self.model.feature_dim, self.shape[3], self.params
            self.private = nn.ModuleDict(dict(
                ds=nn.Sequential(nn.Linear(d, d), nn.ReLU()), ci=nn.Linear(d, k), rec=nn.Linear(2 * d, d),
                mine=nn.Sequential(nn.Linear(2 * d, p.mine_hidden or d), nn.ReLU(), nn.Linear(p.mine_hidden or d, 1))
            )).to(self.device)

    def on_disc(self, msg):
        if self.id == self.target:
            self.DI = {c: discriminator_from(a, self.device) for c, a in by_prefix(msg.arrays).items()}
        else:
            self.DI = {self.id: discriminator_from(msg.arrays, self.device)}

    def on_train(self, msg):
        load_arrays(self.model, msg.arrays)
        self.adapt() if self.id == self.target else self.local_update()
        return Reply("weights", state_arrays(self.model))

    def local_update(self):
        p, m, q = self.params, self.model, self.private
        opt = make_optimizer(p, [*m.parameters(), *q.ds.parameters(), *q.ci.parameters(), *q.rec.parameters()])
        opt_t = make_optimizer(p, q.mine.parameters())
        DI = self.DI.get(self.id) if p.source_adv != "off" else None
        m.train()
        for x, y in self.batches():
            h = m.extract(x)
            hs = h.detach()
            fi, fs = m.di(hs), q.ds(hs)
            pr = F.linear(fs, q.ci.weight.detach(), q.ci.bias.detach()).softmax(1)
            perm = torch.randperm(len(y), generator=self.gen).to(self.device)
            loss = (F.cross_entropy(m.head(m.di(h)), y) + F.cross_entropy(q.ci(fs.detach()), y)
                    + p.ent_weight * (pr * pr.clamp_min(1e-12).log()).sum(1).mean()
                    + p.mi_weight * mine_bound(q.mine, fi, fs, perm)
                    + p.rec_weight * F.mse_loss(q.rec(torch.cat([fi, fs], 1)), hs))
            if DI is not None:
                z = DI(h)[:, 0]
                loss = loss + p.adv_weight * F.softplus(-z if p.source_adv == "paper" else z).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            opt_t.zero_grad(set_to_none=True)
            (-mine_bound(q.mine, fi.detach(), fs.detach(), perm)).backward()
            opt_t.step()

    def adapt(self):
        """The target: G only, against every discriminator it received (eq. 2, G_t's part)."""
        if not self.DI:
            return
        m = self.model
        opt = make_optimizer(self.params, [*m.trunk.parameters(), *m.neck.parameters()])
        m.train()
        for x, _ in self.batches():
            h = m.extract(x)
            fool = torch.stack([F.softplus(-D(h)[:, 0]).mean() for D in self.DI.values()])
            loss = self.params.adv_weight * fool.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    def on_features(self, msg):
        rows = torch.cat(list(self.batch_indices(steps=self.params.feature_batches)))
        with torch.no_grad():
            f = encode(self.model, self.train.x[rows.to(self.train.x.device)])
        self.record_truth(records.FEATURES.format(round=self.round), idx=self.train.idx[rows.numpy()])
        return Reply("features", {"features": f})

    @torch.no_grad()
    def on_attention(self, msg):
        x, k = self.train.x, self.shape[3]
        init = torch.randperm(len(x), generator=self.gen)[:k].to(x.device)
        out, net = {}, self.new_model()
        for c, arrays in by_prefix(msg.arrays).items():
            f = torch.cat([encode(load_arrays(net, arrays), x[i:i + 512]) for i in range(0, len(x), 512)])
            out[c] = dispersion(f, init, self.params.kmeans_iters)
        return Reply("metric", scalars=out)


class FADAServer(Server):
    new_model = build

    def setup(self):
        self.disc, self.last = {}, {}     # source -> (DI, its Adam); source -> its last reported dispersion

    def step(self, t):
        src, tgt = list(self.active), self.target
        if tgt is None:
            raise UserError("fada needs the federation's target client (MethodPlugin.adaptation)")
        ready = [c for c in src if c in self.disc]
        if ready:
            d = {c: state_arrays(self.disc[c][0]) for c in ready}
            to_target = {f"{c}/{k}": v for c in ready for k, v in d[c].items()}
            self.exchange("disc", "discriminator", {**{c: (d[c], None) for c in ready}, tgt: (to_target, None)})
        ups = self.broadcast("train", "weights", state_arrays(self.model), to=src + [tgt])
        feats = self.ask("features", to=src + [tgt])
        self.train_discriminators({c: feats[c]["features"].to(self.device) for c in src},
                                  feats[tgt]["features"].to(self.device))
        alpha = self.attention(ups, src)
        P = state_arrays(self.model)
        new = {}
        for k, v in P.items():
            if not v.is_floating_point():
                new[k] = ups[tgt].arrays[k]
                continue
            u = {c: ups[c].arrays[k].to(v.device, torch.float64) for c in src + [tgt]}
            v64 = v.double()
            new[k] = (u[tgt] + sum(a * (u[c] - v64) for c, a in zip(src, alpha))).to(v.dtype)
        load_arrays(self.model, new)

    def train_discriminators(self, fs: dict, ft: torch.Tensor):
        p = self.params
        for c, f in fs.items():
            if c not in self.disc:   # after the exchanges: seeded from the server's own stream (same on every engine)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(int(torch.randint(2 ** 62, (1,), generator=self.gen)))
                    D = discriminator(f.shape[1], p.disc_hidden or f.shape[1]).to(self.device)
                self.disc[c] = (D, torch.optim.Adam(D.parameters(), lr=p.disc_lr))
            D, opt = self.disc[c]
            for _ in range(p.disc_steps):
                loss = F.softplus(-D(f)).mean() + F.softplus(D(ft)).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

    def attention(self, ups: dict, src: list) -> list[float]:
        p = self.params
        if p.attention == "uniform":
            return [1 / len(src)] * len(src)
        rep = self.exchange("attention", "source_weights",
                            {self.target: ({f"{c}/{k}": v for c in src for k, v in ups[c].arrays.items()}, None)})
        disp = {c: float(rep[self.target][c]) for c in src}
        gain = torch.tensor([self.last.get(c, disp[c]) - disp[c] for c in src], dtype=torch.float64)
        self.last.update(disp)
        return torch.softmax(gain / p.attention_temp, 0).tolist()


class FADA(MethodPlugin):
    name = "fada"
    title = "FADA"
    Params = Params
    Server = FADAServer
    Client = FADAClient
    adaptation = True
    partial_participation = True    # sources are sampled; the target takes part every round
    kinds = ("weights", "features", "discriminator", "source_weights", "metric")
    dp_sgd_refused = ("its MINE term pairs the examples of a batch and its discriminators and disentangler train "
                      "outside Client.fit's per-example gradients")
    # the public protocol pieces (Kerckhoffs) attacks reach through ``view.protocol``
    build = staticmethod(build)
    encode = staticmethod(encode)
    classify = staticmethod(classify)
    discriminator = staticmethod(discriminator)
