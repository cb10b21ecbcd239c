"""PerAda (Xie et al., CVPR 2024, "PerAda: Parameter-Efficient Federated Learning Personalization with
Generalization Guarantees"), docs/methods.md §11; code read in NVlabs/PerAda (optim/our.py, optim/base.py,
aggregation/averaging.py, aggregation/distillation.py, models/resnet_bn_utils.py, scripts/oh/perada-kd.sh).

Model: a pretrained backbone u, frozen, with residual adapters; only the adapters, the norm layers and the head are
trained and shared (an "adapter state"). Each client keeps a personalised adapter v_k (never sent) and a local one
theta_k (sent). Protocol:
0. round 0 (``backbone``): the server broadcasts the whole model once (kind ``weights``): the backbone it pretrained
   on the public data (``model.pretrain_epochs`` on ``data.public``, or ``model.weights``) with the initial adapters.
   Each client keeps it as theta_k and v_k. So the backbone is on the ledger, and an attacker holds it (Kerckhoffs).
1. each round t (``train``): the server broadcasts the global adapter state w (kind ``adapter``). Client k (when
   sampled) first trains v_k for ``local_epochs`` on CE + lam/2 ||v_k - w||^2 (Ditto; v_k carries over between
   rounds), then sets theta_k <- w and trains it on plain CE, and uploads theta_k (kind ``adapter``: the trained
   tensors, parameters and buffers, named as in the full model's state dict).
2. the server sets w to the uniform mean of the uploads, then, in rounds t <= ``kd_rounds``, distils w for
   ``kd_steps`` batches of ``kd_batch`` public images on KL(softmax(T_mean / tau) || softmax(w(x) / tau)), T_mean the
   mean logits of the uploaded theta_k (each merged onto the backbone): only the public images are read, never their
   labels (Adam ``kd_lr``, cosine schedule over the steps, as the code).
Evaluation: the harness evaluates w (global accuracy); at each evaluated round the server asks every client for its
v_k's accuracy on its own validation split (``evaluate``, kind ``metric``, one scalar) and reports the mean over
clients as ``personal_acc`` in metrics.csv (``Server.extra_metrics``).

Attacks: ``partial_state = ("adapter",)``, so the attacks on weights read every adapter message merged onto the round-0
model (fdg_audit.api.attack.Merged). Client-level DP: the upload kind is ``adapter``, so ``[privacy.client] kinds``
must name it (refused otherwise); central mode needs ``kd_rounds = 0`` (the distillation reads each upload, not only
their mean); the evaluation replies (kind ``metric``) are outside the guarantee, as other methods' metrics. DP-SGD is
refused (``dp_sgd_refused``). ``participation < 1`` samples the clients as the code's clients_per_round.

Differences from the paper and the code:
* backbone: the code's ImageNet-pretrained ResNet-18; here the project's model (cnn_small by default), pretrained by
  the server on the public domain (nothing is downloaded). Without ``model.pretrain_epochs`` or ``model.weights`` the
  run is refused: a random frozen backbone is not PerAda.
* adapters: the code puts one (BN -> dropout -> 1x1 conv without bias, init N(0, 1e-4), plus identity) after conv1 and
  after conv2 of every residual block, before bn1/bn2. Here one after every conv of kernel > 1 in the trunk, before
  its norm (cnn_small: both conv stages; resnet18: also the stem conv, which the code leaves without one). The
  adapter's norm follows ``model.norm`` (GroupNorm by default; ``model.norm = "batch"`` gives the code's BatchNorm).
* trained and shared: the code's "adapter", "bn1", "bn2", "fc" keys (block and stem BN, not the downsample BN); here
  the adapters, every norm layer and the head (resnet18: the downsample BN too). cnn_small's hidden Linear is frozen
  with the backbone.
* lam: the paper writes lam/2 ||v - w||^2, the code adds lmbda ||v - w||^2 (lmbda = 0.1 in scripts/oh): lam = 0.2 is
  the code's objective.
* local optimisers: the code's plain SGD (no momentum, no weight decay, re-created every round) at lr 0.05 (scripts/oh)
  are the defaults here; batch size is the project's 32 (code 128).
* distillation: the code evaluates the student on a labelled server split of the clients' own data every batch, stops
  early, and keeps the averaged w when distillation did not beat it. The server here holds no client data, and the
  public labels stay unused: a fixed number of steps, no selection. Teachers run in eval mode (the code's are in train
  mode, dropout on). KD data: the public domain (the code: CIFAR-10 for Office-Home, a server split for CIFAR-10).
  The code's budget (100 batches of 256 per round) is half an epoch of its 50,000 aux images; on a public domain of a
  few hundred images it is ~100 epochs per round and the run's main cost: lower kd_steps / kd_batch there.
* personalised accuracy: the unweighted mean over clients of v_k on their validation splits (the code weights by test
  size), so the clients send no sizes.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fdg_audit.api import UserError
from fdg_audit.api.method import (Client, MethodPlugin, Reply, Server, TrainParams, accuracy, default_build,
                                  make_optimizer, register_kind, state_arrays)

from .fedavg import weighted_average

KIND = "adapter"
register_kind(KIND)


@dataclass
class Params(TrainParams):
    lr: float = 0.05                 # scripts/oh/perada-kd.sh
    momentum: float = 0.0            # the code's SGD has none
    weight_decay: float = 0.0
    lam: float = 0.2                 # lam/2 ||v - w||^2 (the code's lmbda = 0.1 times ||v - w||^2)
    adapter_dropout: float = 0.3     # the code's default
    kd_rounds: int = 30              # distil in rounds t <= kd_rounds (kd_max_round); 0 = plain averaging
    kd_steps: int = 100              # total_n_server_pseudo_batches
    kd_batch: int = 256              # kd_batch_size
    kd_lr: float = 1e-4              # Adam
    kd_temperature: float = 1.0      # kd_KL_temperature

    def __post_init__(self):
        if self.lam < 0 or not 0 <= self.adapter_dropout < 1 or self.kd_rounds < 0 or self.kd_steps < 0:
            raise UserError("perada: use lam >= 0, adapter_dropout in [0, 1), kd_rounds >= 0 and kd_steps >= 0")
        if self.kd_batch < 1 or self.kd_lr <= 0 or self.kd_temperature <= 0:
            raise UserError("perada: use kd_batch >= 1, kd_lr > 0 and kd_temperature > 0")


class Adapter(nn.Module):
    """x + conv1x1(dropout(norm(x))), the conv near zero at the start (the code's AdapterBlock)."""

    def __init__(self, ch: int, norm: str, dropout: float):
        super().__init__()
        self.norm = {"group": lambda: nn.GroupNorm(min(8, ch), ch), "batch": lambda: nn.BatchNorm2d(ch),
                     "none": nn.Identity}[norm]()
        self.drop = nn.Dropout(dropout)
        self.conv = nn.Conv2d(ch, ch, 1, bias=False)
        nn.init.normal_(self.conv.weight, 0.0, 1e-4)

    def forward(self, x):
        return x + self.conv(self.drop(self.norm(x)))


class AdaptedConv(nn.Conv2d):
    """A frozen conv followed by its adapter; the conv's own keys keep their names (``weight``, ``bias``)."""

    def forward(self, x):
        return self.adapter(super().forward(x))


def add_adapters(module: nn.Module, norm: str, dropout: float) -> None:
    for name, c in module.named_children():
        if isinstance(c, nn.Conv2d) and max(c.kernel_size) > 1:
            a = AdaptedConv(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding, c.dilation, c.groups,
                            c.bias is not None, c.padding_mode)
            a.load_state_dict(c.state_dict())
            a.adapter = Adapter(c.out_channels, norm, dropout)
            setattr(module, name, a)
        else:
            add_adapters(c, norm, dropout)


def build(party) -> nn.Module:
    """The model zoo's net (pretrained on the server) with adapters; only adapters, norm layers and head train."""
    net = default_build(party)
    add_adapters(net.trunk, party.model_cfg.norm, party.params.adapter_dropout)
    net.requires_grad_(False)
    for m in net.modules():
        if isinstance(m, (Adapter, nn.GroupNorm, nn.BatchNorm2d)):
            m.requires_grad_(True)
    net.head.requires_grad_(True)
    return net.to(party.device)


def shared_keys(model: nn.Module) -> list[str]:
    """State keys of the trained part: parameters and buffers of every module that holds a trainable parameter."""
    mods = {n for n, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))}
    return [k for k in model.state_dict() if k.rpartition(".")[0] in mods]


def load_part(model: nn.Module, arrays: dict) -> nn.Module:
    dev = next(model.parameters()).device
    model.load_state_dict({k: v.to(dev) for k, v in arrays.items()}, strict=False)
    return model


def trainable(model: nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> torch.Tensor:
    """KL(softmax(teacher / tau) || softmax(student / tau)), batch mean (the code's ``divergence``; no tau^2)."""
    return F.kl_div(F.log_softmax(student / tau, 1), F.softmax(teacher / tau, 1), reduction="batchmean")


class PerAdaClient(Client):
    new_model = build

    def setup(self):
        self.local = self.new_model()          # theta_k
        self.personal = None                   # v_k, from the round-0 model

    def on_backbone(self, msg):
        self.local.load_state_dict({k: v.to(self.device) for k, v in msg.arrays.items()})
        self.personal = copy.deepcopy(self.local)

    def on_train(self, msg):
        w = {k: v.to(self.device) for k, v in msg.arrays.items()}
        ref = {n: w[n] for n, p in self.personal.named_parameters() if p.requires_grad}
        lam = self.params.lam

        def personal_loss(m, x, y):
            prox = sum(((p - ref[n]) ** 2).sum() for n, p in m.named_parameters() if p.requires_grad)
            return F.cross_entropy(m(x), y) + lam / 2 * prox

        self.fit(self.personal, personal_loss, make_optimizer(self.params, trainable(self.personal)))
        load_part(self.local, w)
        self.fit(self.local, opt=make_optimizer(self.params, trainable(self.local)))
        state = state_arrays(self.local)
        return Reply(KIND, {k: state[k] for k in w})

    def on_evaluate(self, msg):
        return Reply("metric", scalars={"personal_acc": accuracy(self.personal, self.val, self.device)})


class PerAdaServer(Server):
    new_model = build

    def setup(self):
        if self.pretrained is None and not self.model_cfg.weights:
            raise UserError("perada freezes a pretrained backbone: set model.pretrain_epochs (the server pretrains on "
                            "data.public) or model.weights")
        c = self.privacy.client if self.privacy is not None else None
        if c is not None and KIND not in c.kinds:
            raise UserError(f"privacy.client.kinds = {c.kinds}: perada uploads kind \"{KIND}\"; add it, or the "
                            "uploads go out unprotected")
        self.keys = shared_keys(self.model)

    def begin(self):
        self.broadcast("backbone", "weights", state_arrays(self.model))

    def step(self, t):
        state = state_arrays(self.model)
        ups = self.broadcast("train", KIND, {k: state[k] for k in self.keys})
        thetas = [r.arrays for r in ups.values()]
        load_part(self.model, weighted_average(thetas, [1 / len(thetas)] * len(thetas)))
        if t <= self.params.kd_rounds and self.params.kd_steps:
            self.distill(thetas)

    @torch.no_grad()
    def teacher_logits(self, thetas: list[dict], x: torch.Tensor) -> torch.Tensor:
        """Mean logits on x of the uploaded adapter states, each on the backbone (eval mode)."""
        m = copy.deepcopy(self.model).eval()
        out = 0
        for th in thetas:
            load_part(m, th)
            out = out + torch.cat([m(x[i:i + 512]) for i in range(0, len(x), 512)]) / len(thetas)
        return out

    def distill(self, thetas: list[dict]) -> None:
        """KD of w from the uploads' mean logits on the public images (their labels are never read)."""
        p, x = self.params, self.public.x
        self.reseed()   # the student's dropout draws from torch's global RNG: the server's stream in every engine
        teacher = self.teacher_logits(thetas, x)
        opt = torch.optim.Adam(trainable(self.model), lr=p.kd_lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, p.kd_steps)
        self.model.train()
        b, done = min(p.kd_batch, len(x)), 0
        while done < p.kd_steps:
            for j in torch.randperm(len(x), generator=self.gen).split(b)[:p.kd_steps - done]:
                j = j.to(x.device)
                opt.zero_grad(set_to_none=True)
                kd_loss(self.model(x[j]), teacher[j], p.kd_temperature).backward()
                opt.step()
                sched.step()
                done += 1

    def extra_metrics(self):
        accs = [r["personal_acc"] for r in self.ask("evaluate", to=self.clients).values()]
        return {"personal_acc": sum(accs) / len(accs)}


def kd_free_mean(params) -> float:
    """Without distillation w is the uniform mean of the uploads (share 1); the distillation reads each upload."""
    return 1.0 if not (params.kd_rounds and params.kd_steps) else math.inf


class PerAda(MethodPlugin):
    name = "perada"
    title = "PerAda"
    Params = Params
    Server = PerAdaServer
    Client = PerAdaClient
    kinds = ("weights", KIND, "metric")
    build = staticmethod(build)
    partial_state = (KIND,)
    public_data = "its server distils the global adapter on unlabeled public images and pretrains the backbone"
    partial_participation = True
    aggregate_share = staticmethod(kd_free_mean)
    dp_sgd_refused = ("its personalised adapter trains on the private data with the proximal term lam/2 ||v - w||^2, "
                      "a regulariser and not a per-example loss")
