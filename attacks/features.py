"""Attacks on transmitted representations (kind ``features``, issue 23 part 3): inversion, membership, attributes.

What is sent (FADA, methods/fada.py): each round a client uploads rows ``{"features": (N, D)}`` = the protocol's public
``encode(model, x)`` (``view.protocol.encode``: Kerckhoffs) of a few mini-batches of its training images, and its model
(kind ``weights``); the truth ``features_r<round>`` holds the rows' image ids (``truth`` parameter; ``"train"``:
reconstructions are matched to the whole training set, attributes are skipped). Default adversary: the server. A
client of the held-out domain (an adaptation method's target) is skipped: its images are the attacker's public data.

**Assumption: the model of the same round.** Images are encoded by the victim's models of the round the rows were
sent: ``model = "path"`` (default) ``points`` models on the straight line from the broadcast it received to its upload
(rows computed at any time of local training lie near that path; FADA computes them with the upload, one end),
``"upload"`` or ``"broadcast"`` (one end; a missing end is replaced by the other).

* ``FeatureInversion``: a decoder (linear to a quarter-resolution map, two upsample + conv stages, sigmoid) trained
  ``epochs`` epochs (Adam, MSE) from encodings of the public images (each epoch each image under a random model of
  the path) to the images, applied to the rows. Baseline (scorer): the mean public image.
* ``FeatureMembership``: per round, each candidate's distance to the nearest row under any path model, as a robust
  z-score over the candidates ((median - d) / MAD); score = the best round's. Only images whose rows were sent can be
  found: the AUC over all members is bounded by the share sent. Baseline (scorer): AUC 0.5.
* ``FeatureAttribute``: the class of each row by a logistic regression on encodings of the public images
  (``public``), or by the victim's own classifier head (``own_head``, only where the rows are the head's input: its
  predictions on public images must match the model's); the source domain by a logistic regression on encodings of
  the public samples of each source domain (``domain_samples``). Baseline (scorer): 1/K.

Controls (``control_world``): digits with a run's defaults (``ModelConfig()``: D = 64; ``TrainParams()``: batch 32,
SGD lr 0.01, momentum 0.9), 3 local epochs on 240 rot0 images; the rows (one batch) are computed half-way through the
last epoch, off both ends of the path. Measured (seed 0, default budget): inversion with a decoder trained on 60
other images of the victim's distribution +4.6 dB PSNR over their mean image (21.0 dB; positive >= 3), on shuffled
pairs -0.5 dB (negative <= 0.5); membership AUC 0.98 for the rows' images against 60 non-members (positive >= 0.9),
|AUC - 0.5| = 0.01 with random labels (negative <= 0.2); class balanced accuracy 0.92 (positive >= 0.6), 0.19 with
shuffled labels (negative <= 0.35; chance 0.1). With public images of another domain (rot45, the real setting):
+1.8 dB (14.5 dB) and 0.40. On the test's 2-round stand-in run the rot30-trained decoder is below the mean image
(12.2 against 13.9 dB): a sharp digit of the wrong shape costs more PSNR than a blur. No published attack exists for
this channel (docs/attacks.md §7): the controls and baselines are the anchors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fdg_audit.api import UserError, records
from fdg_audit.api import metrics as M
from fdg_audit.api.attack import (Attack, AttackParams, Control, Predictions, Reconstruction, Scores, Skipped,
                                  sample_victims)

KIND = "features"
SAME_ROUND = ("the victim's models of the round the rows were sent (the path from the broadcast it received to its "
              "upload, or one end: parameter model) and the protocol's public encode(model, x)")


# ------------------------------------------------------------------------------------------ access

def feature_uploads(view, rnd: int = -1) -> list[tuple[str, int, torch.Tensor]]:
    """(victim, round, rows (N, D)) of the clients' feature uploads this adversary saw, rows of one round joined in
    sending order; ``rnd``: -1 = each victim's last round, 0 = every round, t = round t."""
    by: dict = {}
    for m in sorted(view.messages(kind=KIND), key=lambda m: m.seq):
        if m.sender not in ("server", view.me):
            by.setdefault(m.sender, {}).setdefault(m.round, []).append(m.payload.arrays["features"].float())
    out = []
    for v in sorted(by):
        rounds = sorted(by[v])
        rounds = rounds[-1:] if rnd == -1 else rounds if rnd == 0 else [r for r in rounds if r == rnd]
        out += [(v, r, torch.cat(by[v][r]).flatten(1)) for r in rounds]
    return out


def interpolate(a: dict, b: dict, t: float) -> dict:
    """(1 - t) a + t b on floating-point entries; other entries (step counters) from b."""
    return {k: a[k] + t * (b[k] - a[k]) if b[k].is_floating_point() else b[k] for k in b}


def round_models(view, victim: str, rnd: int, which: str, points: int) -> list:
    """The victim's models of round ``rnd``: its upload, the broadcast to it, or ``points`` models evenly spaced on the
    straight line from the broadcast to the upload ("path"); a missing end is replaced by the other ([] if both)."""
    down, up = (next((m.payload.arrays for m in view.messages(kind="weights", round=rnd, **k)), None)
                for k in (dict(sender="server", receiver=victim), dict(sender=victim)))
    down, up = down or up, up or down
    if up is None:
        return []
    ts = {"upload": [1.0], "broadcast": [0.0]}.get(which, np.linspace(0, 1, points) if down is not up else [1.0])
    return [view.model(interpolate(down, up, float(t))).requires_grad_(False) for t in ts]


@torch.no_grad()
def encode(fn, models: list, x: torch.Tensor, device, chunk: int = 256) -> torch.Tensor:
    """fn(model, x) for every model, over x in chunks: (len(models), N, D) float on the CPU."""
    return torch.stack([torch.cat([fn(m, x[i:i + chunk].to(device)).flatten(1).float().cpu()
                                   for i in range(0, len(x), chunk)]) for m in models])


def truth_of(name: str, rnd: int, n: int) -> tuple[str, np.ndarray | None]:
    """The truth record and rows of a round's features: (``features_r<rnd>``, 0..n-1), or ("train", None)."""
    return (records.TRAIN, None) if name == records.TRAIN else (name.format(round=rnd), np.arange(n))


# ------------------------------------------------------------------------------------------ decoder, classifier

def decoder(dim: int, channels: int, size: int, width: int) -> nn.Module:
    s = -(-size // 4)
    return nn.Sequential(nn.Linear(dim, width * s * s), nn.ReLU(), nn.Unflatten(1, (width, s, s)),
                         nn.Upsample(scale_factor=2), nn.Conv2d(width, width // 2, 3, padding=1), nn.ReLU(),
                         nn.Upsample(size=(size, size)), nn.Conv2d(width // 2, channels, 3, padding=1), nn.Sigmoid())


def fit_decoder(z: torch.Tensor, x: torch.Tensor, epochs: int, lr: float, batch: int, width: int, seed: int):
    """Train a decoder from encodings z (P, N, D) of images x (N, C, H, W) under P models (each epoch pairs every
    image with its encoding by a random one of them) to the images, by Adam on the MSE; inputs centred and scaled by
    one public scale. Returns it as a function of observed rows (M, D)."""
    mu, sd = z.mean((0, 1)), z.std().clamp_min(1e-8)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = decoder(z.shape[-1], x.shape[1], x.shape[-1], width).to(x.device)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    zs = ((z - mu) / sd).to(x.device)
    for _ in range(epochs):
        pick = zs[torch.randint(len(zs), (len(x),), generator=gen), torch.arange(len(x))]
        for j in torch.randperm(len(x), generator=gen).split(batch):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(net(pick[j]), x[j]).backward()
            opt.step()
    net.eval()
    return lambda f: net(((f.cpu() - mu) / sd).to(x.device)).detach().cpu()


def fit_classifier(z: torch.Tensor, y: torch.Tensor, c: float = 1.0):
    """Standardised multinomial logistic regression on encodings z (P, N, D) of labels y (N,) (every model's
    encoding is a training row); returns predict(rows (M, D)) -> labels (numpy)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    y = y.cpu().repeat(len(z)).numpy()
    if len(np.unique(y)) == 1:
        return lambda q: np.full(len(q), y[0])
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000)).fit(z.flatten(0, 1).numpy(), y)
    return lambda q: clf.predict(q.cpu().numpy())


@torch.no_grad()
def own_head(model, z: torch.Tensor, x: torch.Tensor, device, agree: float = 0.99):
    """The model's ``head`` as a function of rows (M, D) -> classes, if the rows are its input: checked on public
    images x, whose encodings z (N, D) through the head must give the model's own prediction (>= ``agree`` of
    them); else None."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Module) or getattr(head, "in_features", None) != z.shape[1]:
        return None
    same = (head(z.to(device)).argmax(1).cpu() == encode(lambda m, v: m(v), [model], x, device)[0].argmax(1))
    return (lambda f: head(f.to(device)).argmax(1).cpu().numpy()) if same.float().mean() >= agree else None


def nearest_distance(e: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Distance of each candidate's encodings e (P, M, D) to the nearest observed row f (N, D), the smallest over
    the P models: (M,)."""
    return torch.cdist(e, f[None].expand(len(e), *f.shape)).amin((0, 2))


def membership_scores(d: torch.Tensor) -> torch.Tensor:
    """Per-round distances d (R, M) to scores (M,): robust z-scores over the candidates ((median - d) / MAD, so
    rounds of different feature scales compare), the best round's."""
    med = d.median(1, keepdim=True).values
    return ((med - d) / (d - med).abs().median(1, keepdim=True).values.clamp_min(1e-12)).amax(0)


# ------------------------------------------------------------------------------------------ control world

def control_world(seed: int = 0, epochs: int = 3, points: int = 5) -> dict:
    """Digits with the defaults of a run: ``ModelConfig()`` (feature dim D), ``TrainParams()`` (batch size, lr,
    momentum, weight decay), trained ``epochs`` local epochs on 240 rot0 images. The observed rows are one batch of
    them, encoded half-way through the last epoch (features computed during local training); the attacker holds
    that epoch's start and end models ("broadcast", "upload") and the ``points`` models of the path between them.
    Public images: rot45 (another domain, as a run's held-out domain); ``near``: 60 other rot0 images (the victim's
    distribution; they are also the non-members)."""
    from fdg_audit.api import DataConfig, ModelConfig, build_model, load_data
    from fdg_audit.api.method import TrainParams
    tp = TrainParams()
    data = load_data(DataConfig(dataset="digits", domains=["rot0", "rot45"]))
    vic, pub = data.domain("rot0"), data.domain("rot45")
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_model(ModelConfig(), 1, data.num_classes, vic.train.x.shape[-1])
    opt = torch.optim.SGD(model.parameters(), lr=tp.lr, momentum=tp.momentum, weight_decay=tp.weight_decay)
    fn = lambda m, x: m.features(x)  # noqa: E731
    rows = torch.randperm(len(vic.train.y), generator=gen)[:tp.batch_size]
    for ep in range(epochs):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        batches = torch.randperm(len(vic.train.y), generator=gen).split(tp.batch_size)
        for i, j in enumerate(batches):
            if ep == epochs - 1 and i == len(batches) // 2:
                f = encode(fn, [model.eval()], vic.train.x[rows], "cpu")[0]
            model.train()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(vic.train.x[j]), vic.train.y[j]).backward()
            opt.step()
    end = model.state_dict()
    models = []
    for t in np.linspace(0, 1, points):
        m = build_model(ModelConfig(), 1, data.num_classes, vic.train.x.shape[-1])
        m.load_state_dict(interpolate(start, end, float(t)))
        models.append(m.eval().requires_grad_(False))
    return dict(fn=fn, models=models, f=f, x=vic.train.x[rows], y=vic.train.y[rows], near=vic.val.x,
                near_y=vic.val.y, public=torch.cat([pub.train.x, pub.val.x]),
                public_y=torch.cat([pub.train.y, pub.val.y]), k=data.num_classes, gen=gen)


# ------------------------------------------------------------------------------------------ attacks

@dataclass
class FeatureParams(AttackParams):
    model: str = "path"               # path | upload | broadcast: the same-round models that encode (docstring)
    points: int = 5                   # "path": models on the line from the broadcast to the upload
    round: int = -1                   # -1 = each victim's last round, 0 = every round, t = round t
    truth: str = records.FEATURES     # the method's truth record of the rows ("train": match the training set)
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.model not in ("path", "upload", "broadcast") or self.points < 1:
            raise UserError(f"model = {self.model!r}, points = {self.points}: use \"path\" (points >= 1), "
                            "\"upload\" or \"broadcast\"")


class _FeatureAttack(Attack):
    consumes = (KIND,)
    adversary = "server"

    def targets(self, view, aux):
        """(victim, round, rows, models, encode fn) per observed upload, or Skipped where it cannot be attacked. A
        client of the held-out domain (an adaptation method's target) is skipped: its images are the public ones."""
        fn = getattr(view.protocol, "encode", None)
        ups = feature_uploads(view, self.p.round)
        held = {v for v, _, _ in ups if v.split("/")[0] not in aux.domains}
        yield from (Skipped(v, KIND, r, "a client of the held-out domain: its images are the public data")
                    for v, r, _ in ups if v in held)
        for victim, rnd, f in sample_victims(view, [u for u in ups if u[0] not in held], self.p.max_victims,
                                             key=lambda u: u[0]):
            models = round_models(view, victim, rnd, self.p.model, self.p.points) if fn else []
            if models:
                yield victim, rnd, f, models, fn
            else:
                yield Skipped(victim, KIND, rnd, "no weights of the victim observed in that round" if fn else
                              f"{view.method} publishes no encode(model, x)")


@dataclass
class InversionParams(FeatureParams):
    epochs: int = 200                 # decoder training epochs over the public images (the attack's budget)
    lr: float = 1e-3
    batch: int = 64
    width: int = 64                   # channels of the decoder's first map


class FeatureInversion(_FeatureAttack):
    name = "feature_inversion"
    aux = ("public",)
    outputs = {"": f"a decoder trained on public images encoded by {SAME_ROUND}, applied to the observed rows"}
    Params = InversionParams
    priors, budget = {"*": "learned"}, {"*": (("epochs",), "")}

    def invert(self, fn, models: list, public: torch.Tensor, f: torch.Tensor, seed: int = 0, p=None):
        """Decoder from ``public`` (encoded by ``models``) applied to rows f; settings ``p`` (default: the attack's)."""
        p = p or self.p
        return fit_decoder(encode(fn, models, public, self.device), public.to(self.device), p.epochs, p.lr, p.batch,
                           p.width, p.seed + seed)(f)

    def run(self, view, aux):
        outs = []
        for i, t in enumerate(self.targets(view, aux)):
            if isinstance(t, Skipped):
                outs.append(t)
                continue
            victim, rnd, f, models, fn = t
            truth, rows = truth_of(self.p.truth, rnd, len(f))
            outs.append(Reconstruction(victim, KIND, rnd, self.invert(fn, models, aux.public.x, f, i), truth=truth,
                                       rows=rows))
        return outs

    def control(self):
        """Positive: the decoder trained on images of the victim's distribution (the algorithm works where the
        features carry the image); negative: the same decoder trained on those images paired with other images'
        encodings. Both at the default budget: the controls check the algorithm, not the budget."""
        w, d = control_world(self.p.seed), InversionParams(seed=self.p.seed)
        base = M.psnr(w["near"].mean(0, keepdim=True).expand_as(w["x"]), w["x"])   # the scorer's baseline: the
        gain = lambda r: float((M.psnr(r, w["x"]) - base).mean())                 # mean of the decoder's images
        shuffle = lambda m, x: m.features(x)[torch.randperm(len(x), generator=w["gen"])]  # noqa: E731
        return [Control("digits, default model and batch: decoder from the victim's distribution, PSNR gain over the "
                        "mean of its training images (dB)", "psnr_gain",
                        gain(self.invert(w["fn"], w["models"], w["near"], w["f"], p=d)), 3.0),
                Control("the same decoder trained on shuffled pairs: PSNR gain (dB)", "psnr_gain",
                        gain(self.invert(shuffle, w["models"], w["near"], w["f"], p=d)), 0.5, positive=False)]


@dataclass
class MembershipParams(FeatureParams):
    round: int = 0                    # every observed round by default: more rows


class FeatureMembership(_FeatureAttack):
    name = "feature_membership"
    aux = ("candidates",)
    outputs = {"": f"the distance of the candidate's encoding by {SAME_ROUND} to the nearest observed row; only "
                   "members whose rows were sent can be found"}
    Params = MembershipParams

    def run(self, view, aux):
        outs, dist, last = [], {}, {}
        for t in self.targets(view, aux):
            if isinstance(t, Skipped):
                outs.append(t)
            elif t[0] in aux.candidates:
                victim, rnd, f, models, fn = t
                dist.setdefault(victim, []).append(
                    nearest_distance(encode(fn, models, aux.candidates[victim].x, self.device), f.cpu()))
                last[victim] = max(last.get(victim, rnd), rnd)
        return outs + [Scores(v, KIND, last[v], membership_scores(torch.stack(d)).numpy()) for v, d in dist.items()]

    def control(self):
        w = control_world(self.p.seed)
        s = membership_scores(nearest_distance(encode(w["fn"], w["models"], torch.cat([w["x"], w["near"]]),
                                                      self.device), w["f"])[None]).numpy()
        lab = np.r_[np.ones(len(w["x"])), np.zeros(len(w["near"]))]
        fake = torch.randperm(len(w["near"]), generator=w["gen"]).numpy() < len(w["near"]) // 2
        return [Control("digits, default model and batch: the rows' images vs non-members", "auc", M.auc(s, lab), 0.9),
                Control("non-members labelled member at random: |AUC - 0.5|", "auc_gap",
                        abs(M.auc(s[len(w["x"]):], fake) - 0.5), 0.2, positive=False)]


@dataclass
class AttributeParams(FeatureParams):
    variants: list = field(default_factory=lambda: ["public", "own_head", "domain_samples"])
    c: float = 1.0                    # inverse L2 strength of the logistic regressions


class FeatureAttribute(_FeatureAttack):
    name = "feature_attribute"
    aux = ("public", "domain_samples")
    outputs = {"public": f"class from a classifier trained on public images of the held-out domain encoded by "
                         f"{SAME_ROUND}",
               "own_head": "class from the victim's own classifier head (of its upload) applied to the rows (assumes "
                           "the rows are the head's input)",
               "domain_samples": f"source domain from a classifier trained on public samples of each source domain "
                                 f"encoded by {SAME_ROUND}"}
    Params = AttributeParams

    def __init__(self, params=None, device: str = "cpu"):
        super().__init__(params, device)
        bad = [v for v in self.p.variants if v not in self.outputs]
        if bad:
            raise UserError(f"{self.name}: unknown variant {bad[0]!r}: use {', '.join(self.outputs)}")

    def run(self, view, aux):
        if self.p.truth == records.TRAIN:
            return [Skipped(v, KIND, r, "per-row truth needed (truth = \"train\")")
                    for v, r, _ in feature_uploads(view, self.p.round)]
        outs = []
        doms = [aux.domain_samples[d] for d in aux.domains]
        for t in self.targets(view, aux):
            if isinstance(t, Skipped):
                outs.append(t)
                continue
            victim, rnd, f, models, fn = t
            truth, rows = truth_of(self.p.truth, rnd, len(f))
            enc = lambda x: encode(fn, models, x, self.device)  # noqa: E731
            head = own_head(models[-1], enc(aux.public.x)[-1], aux.public.x, self.device) \
                if "own_head" in self.p.variants else None
            for v in self.p.variants:
                if v == "public":
                    pred = fit_classifier(enc(aux.public.x), aux.public.y, self.p.c)(f)
                elif v == "domain_samples":
                    pred = fit_classifier(torch.cat([enc(s.x) for s in doms], 1),
                                          torch.cat([torch.full((len(s),), i) for i, s in enumerate(doms)]),
                                          self.p.c)(f)
                elif head is not None:
                    pred = head(f)
                else:
                    outs.append(Skipped(victim, KIND, rnd, "own_head: the rows are not the input of the model's "
                                        "head (its predictions on public images differ from the model's)"))
                    continue
                attr, k = ("domain", len(doms)) if v == "domain_samples" else ("class", aux.num_classes)
                outs.append(Predictions(victim, KIND, rnd, attr, pred, k, truth=truth, rows=rows, variant=v))
        return outs

    def control(self):
        """Positive: a classifier on encodings of images of the victim's distribution; negative: shuffled labels."""
        w = control_world(self.p.seed)
        y = w["y"].numpy()
        z = encode(w["fn"], w["models"], w["near"], self.device)
        acc = M.balanced_accuracy(fit_classifier(z, w["near_y"], self.p.c)(w["f"]), y, w["k"])
        shuffled = w["near_y"][torch.randperm(len(w["near_y"]), generator=w["gen"])]
        sham = M.balanced_accuracy(fit_classifier(z, shuffled, self.p.c)(w["f"]), y, w["k"])
        return [Control("digits, default model and batch: class balanced accuracy, classifier from the victim's "
                        "distribution", "balanced_acc", acc, 0.6),
                Control("classifier trained on shuffled labels: balanced accuracy", "balanced_acc", sham, 0.35,
                        positive=False)]
