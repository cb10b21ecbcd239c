"""Label-distribution inference from a client's weight update (docs/attacks.md §5.6, table row L1), server.

The bias of the last layer moves by the summed softmax residuals: one SGD step on a batch of size B changes
b_c by -eta * g_c with g_c = (1/B) sum_i (p_ic - y_ic). Over a round of T steps in which every image is seen
T B / n times, sum_s g_c(s) = (T/n) (S_c - n_c), where S_c = sum_i p_ic is the model's total predicted mass on
class c. So

    n_c = S_c - (n / T) sum_s g_c(s).

Recovering sum_s g_c(s) from the observed delta_b = b_upload - b_broadcast with the protocol's public optimizer
settings (SGD, momentum mu, weight decay lambda, PyTorch's update buf = mu buf + g + lambda b; b -= eta buf):
delta_b = -eta sum_s w_s (g_s + lambda b_s) with w_s = (1 - mu^(T-s+1)) / (1 - mu); taking the gradients as
constant over the round, sum_s g_s ~ -delta_b T / (eta sum_s w_s) - lambda T (b_0 + b_1)/2 (mu = lambda = 0
gives the textbook n_c = S_c + B delta_b_c / (eta E)).

Public-data calibration (Dimitrov et al. / LLG): S_c ~ n * q_c, where q is the mean softmax of the attacker's
public images, linearly interpolated between the broadcast model (q_0) and the uploaded one (q_1) at the mean
step position: q = q_0 + (q_1 - q_0)(T - 1)/(2T) (one step: the broadcast model only). n: the ``n_samples`` the
client sent, else the ``dataset_size`` estimator (BN step count or update-norm calibration). T = local_steps, or
E ceil(n/B). The result is clipped at 0, rescaled to sum n and rounded by largest remainders. Adam: skipped (no
linear relation). CCST trains on K styled copies of every image: the counts are divided by K.

Controls: FedSGD, one full-batch step from a zero-initialised head (uniform softmax, so S_c = n/C exactly) gives
the exact counts; one epoch of four local steps with momentum and weight decay, calibrated on the client's own
distribution (an oracle for S_c, isolating the step accounting), give count accuracy >= 0.9. Baseline (scorer):
the uniform prior n/C per class.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.api import ModelConfig, build_model
from fdg_audit.api import metrics as M
from fdg_audit.api.attack import Attack, AttackParams, Control, Estimate, Skipped, sample_victims

from .stats import SIZE_WORDS, augmentation_factor, estimate_size, weight_rounds, weights_pair

BIAS = "head.bias"


def round_to_total(v: np.ndarray, n: int) -> np.ndarray:
    """Clip at 0 (nan as 0), rescale to sum n (uniform when nothing is left), round by largest remainders (ties to
    the lower index): an integer count vector summing to n."""
    v = np.clip(np.nan_to_num(np.asarray(v, dtype=np.float64)), 0, None)
    v = v * (n / v.sum()) if v.sum() > 0 else np.full(len(v), n / len(v))
    out = np.floor(v).astype(np.int64)
    out[np.argsort(-(v - out), kind="stable")[:int(n) - out.sum()]] += 1
    return out


def estimate_counts(b0: torch.Tensor, b1: torch.Tensor, q0: torch.Tensor, q1: torch.Tensor, n: float, steps: int,
                    lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> np.ndarray:
    """Label counts from a bias update (see the module docstring); q0/q1: mean softmax of the calibration data."""
    b0, b1, q0, q1 = (t.double() for t in (b0, b1, q0, q1))
    T = max(1, int(steps))
    s = torch.arange(1, T + 1, dtype=torch.float64)
    w = (1 - momentum ** (T - s + 1)) / (1 - momentum) if momentum else torch.ones(T, dtype=torch.float64)
    grad_sum = -(b1 - b0) * T / (lr * w.sum()) - weight_decay * T * (b0 + b1) / 2
    q = q0 + (q1 - q0) * (T - 1) / (2 * T)
    return round_to_total((n * q - (n / T) * grad_sum).numpy(), int(round(n)))


@torch.no_grad()
def mean_softmax(model, x: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    model.eval()
    return torch.cat([F.softmax(model(x[i:i + chunk]), 1) for i in range(0, len(x), chunk)]).mean(0).cpu()


@dataclass
class LabelParams(AttackParams):
    round: int = 1               # 1 = the first update (most accurate early in training); -1 = last; 0 = all
    seed: int = 0


class LabelDistribution(Attack):
    name = "label_distribution"
    consumes = ("weights",)
    adversary = "server"
    aux = ("public",)
    outputs = {k: "the last-layer bias update under the protocol's public optimizer settings, calibrated with the "
                  f"model's mean softmax on public images; data size: {w}" for k, w in SIZE_WORDS.items()}
    Params = LabelParams

    def cost(self) -> dict:   # the cost guard (fdg_audit.audit.coverage.estimate): its own CPU s per run, main job's
        return {"run": 0.5}

    def run(self, view, aux):
        p = view.settings   # the method's public protocol (TrainParams fields)
        gen = torch.Generator().manual_seed(self.p.seed)
        outs = []
        for victim in sample_victims(view, view.clients, self.p.max_victims):
            for rnd in weight_rounds(view, victim, self.p.round):
                if p.optimizer != "sgd":
                    outs.append(Skipped(victim, "weights", rnd, "the bias update of Adam is not linear in the labels"))
                    continue
                down, up = weights_pair(view, victim, rnd)
                if BIAS not in up:
                    outs.append(Skipped(victim, "weights", rnd, f"no {BIAS} in the uploaded state"))
                    continue
                n, how = estimate_size(view, victim, rnd, aux.public, gen=gen)
                if n is None:
                    outs.append(Skipped(victim, "weights", rnd, how))
                    continue
                K = augmentation_factor(view)
                n_train = n * K
                steps = p.local_steps or p.local_epochs * -(-int(round(n_train)) // int(p.batch_size))
                x = aux.public.x.to(self.device)
                q0, q1 = mean_softmax(view.model(down), x), mean_softmax(view.model(up), x)
                counts = estimate_counts(down[BIAS], up[BIAS], q0, q1, n_train, steps, p.lr,
                                         p.momentum if p.optimizer == "sgd" else 0.0, p.weight_decay)
                outs.append(Estimate(victim, "weights", rnd, "label_counts", counts / K, how))
        return outs

    def control(self):
        gen = torch.Generator().manual_seed(self.p.seed)
        torch.manual_seed(self.p.seed)
        true = np.array([9, 0, 4, 0, 1, 0, 0, 12, 0, 6])
        y = torch.as_tensor(np.repeat(np.arange(10), true))
        x = torch.rand(len(y), 1, 16, 16, generator=gen)
        out = []
        # FedSGD: one full-batch plain SGD step from a zero head
        model = build_model(ModelConfig(arch="cnn_small"), 1, 10, 16)
        torch.nn.init.zeros_(model.head.weight)
        torch.nn.init.zeros_(model.head.bias)
        b0, q0 = model.head.bias.detach().clone(), mean_softmax(model, x)
        m = copy.deepcopy(model).train()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        F.cross_entropy(m(x), y).backward()
        opt.step()
        est = estimate_counts(b0, m.head.bias.detach(), q0, mean_softmax(m, x), len(y), 1, 0.1)
        out.append(Control("FedSGD one step, zero head: count accuracy", "label_count_acc",
                           float(M.label_count_accuracy(est, true)), 1.0))
        # FedAvg: one epoch of 4 steps, batch 8, momentum 0.9, weight decay 5e-4; calibrated on the client's data
        model = build_model(ModelConfig(arch="cnn_small"), 1, 10, 16)
        b0 = model.head.bias.detach().clone()
        calib = x + 0.01 * torch.randn(x.shape, generator=gen)
        q0 = mean_softmax(model, calib)
        m = copy.deepcopy(model).train()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), 8):          # one epoch: 4 steps
            j = perm[i:i + 8]
            opt.zero_grad()
            F.cross_entropy(m(x[j]), y[j]).backward()
            opt.step()
        est = estimate_counts(b0, m.head.bias.detach(), q0, mean_softmax(m, calib), len(y), 4, 0.05, 0.9, 5e-4)
        out.append(Control("FedAvg 4 steps, momentum + wd, oracle calibration: count accuracy", "label_count_acc",
                           float(M.label_count_accuracy(est, true)), 0.9))
        return out
