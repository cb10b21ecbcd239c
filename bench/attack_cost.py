"""Per-iteration cost of each reconstruction attack at each client size, on the main job's model and data.

    python bench/attack_cost.py [--sizes 1 4 16 64] [--iterations 30] [--victims 4] [--threads 1]

The main job's setting (scenarios/feddg_vs_csac.toml): cnn_small with GroupNorm, real MNIST digits of rot30, one
local epoch of batch 32 at lr 0.05 from a fresh model, 1 restart. Per client size n (the victim's training images),
each attack runs ``--iterations`` iterations with the plateau rule off (a fixed count, so every row does the same
work) and the table gives milliseconds per iteration (wall and process CPU), the ratio to phase retrieval ("box")
on the same n images, and the ratio to the same attack at the smallest size:
  * update_inversion, pixel space and learned prior (``prior = "learned"``), one victim;
  * update_inversion batched: ``--victims`` victims of size n as one vmapped optimisation (``invert_many``),
    per victim-iteration (what each victim costs when a run's victims of one size are batched);
  * fedavg_leakage (one dummy copy of the data per epoch; one epoch here);
  * amplitude_phase_retrieval "box" (HIO on the n images' amplitudes) and "learned" (latent Adam steps through the
    VAE; its pixel stage costs as "box").
Training the learned prior is a one-off per (data set, seed, aux), shared across jobs: its per-step cost is the
last row. Run it on an idle machine with one torch thread; under load the numbers mean little.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch                                      # noqa: E402
import torch.nn.functional as F                   # noqa: E402

from attacks.amplitude import retrieve            # noqa: E402
from attacks.fedavg_leak import Params as LeakParams, epoch_steps, leak   # noqa: E402
from attacks.inversion import Params, Protocol, invert_many, schedule     # noqa: E402
from attacks.prior import PriorSettings, fit_amplitude, train_prior      # noqa: E402
from fdg_audit.api import DataConfig, ModelConfig, build_model, load_data  # noqa: E402
from fdg_audit.api.method import TrainParams, make_optimizer              # noqa: E402


def clock(fn, its: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per iteration of ``fn()``, which runs ``its`` iterations."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return 1e3 * (time.perf_counter() - w) / its, 1e3 * (time.process_time() - c) / its


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--victims", type=int, default=4, help="victims per batch for the batched row")
    ap.add_argument("--prior-steps", type=int, default=50, help="VAE training steps timed (and used by the rows)")
    ap.add_argument("--dataset", default="mnist", help="mnist (the main job's real digits) or digits (embedded)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    its, sizes = a.iterations, sorted(a.sizes)
    need = a.victims * max(sizes)
    d = load_data(DataConfig(dataset=a.dataset, family="rotated", domains=["rot30", "rot75"],
                             per_domain=max(need + need // 4 + 1, 200)))
    pool, public = d.domains[0].train, torch.cat([d.domains[1].train.x, d.domains[1].val.x])
    torch.manual_seed(0)
    net = build_model(ModelConfig("cnn_small", "group"), 1, 10, 28)
    theta = {k: v.detach().clone() for k, v in net.named_parameters()}
    tp = TrainParams(lr=0.05, batch_size=32, local_epochs=1)
    pr = Protocol.of(vars(tp))
    off = dict(iterations=its, restarts=1, plateau_tol=0.0)       # a fixed count: the plateau rule off
    t = time.process_time()
    prior = train_prior(public, PriorSettings(steps=a.prior_steps), 0)
    prior_ms = 1e3 * (time.process_time() - t) / max(1, a.prior_steps)

    def update(x, y):
        net.load_state_dict(theta, strict=False)
        opt = make_optimizer(tp, net.parameters())
        for i in range(0, len(x), tp.batch_size):
            opt.zero_grad()
            F.cross_entropy(net(x[i:i + tp.batch_size]), y[i:i + tp.batch_size]).backward()
            opt.step()
        out = {k: p.detach() - theta[k] for k, p in net.named_parameters()}
        net.load_state_dict(theta, strict=False)
        return out

    rows = []
    for n in sizes:
        xs = [pool.x[v * n:(v + 1) * n] for v in range(a.victims)]
        ys = [pool.y[v * n:(v + 1) * n] for v in range(a.victims)]
        obs = [update(x, y) for x, y in zip(xs, ys)]
        steps, _ = schedule(n, pr)
        gen = lambda v=0: torch.Generator().manual_seed(v)  # noqa: E731
        ig = lambda k, prior=None: invert_many(net, [theta] * k, obs[:k], ys[:k], [steps], pr, (1, 28, 28),  # noqa
                                               Params(**off), [gen(v) for v in range(k)], prior=prior)
        lsteps, m, e = epoch_steps(n, pr)
        amp = torch.fft.fft2(xs[0]).abs()
        cost = {"update_inversion": clock(lambda: ig(1), its),
                "update_inversion learned": clock(lambda: ig(1, prior), its),
                f"update_inversion x{a.victims} batched, per victim": tuple(c / a.victims for c in
                                                                            clock(lambda: ig(a.victims), its)),
                "fedavg_leakage": clock(lambda: leak(net, theta, obs[0], ys[0].repeat(e, 1), lsteps, pr, (1, 28, 28),
                                                     LeakParams(**off), gen()), its),
                "amplitude_phase_retrieval box": clock(lambda: retrieve(amp[:, 0], None, "constant", its, 0, 1, tol=0.0,
                                                                        gen=gen(), plateau_tol=0.0), its),
                "amplitude_phase_retrieval learned": clock(lambda: fit_amplitude(prior, amp, 1, its, gen(), tol=0.0),
                                                           its)}
        rows += [(name, n, w, c) for name, (w, c) in cost.items()]
    ref = {n: w for name, n, w, _ in rows if name == "amplitude_phase_retrieval box"}
    first = {name: w for name, n, w, _ in rows if n == sizes[0]}
    print(f"{its} iterations per cell, {a.threads} torch thread(s), {a.dataset} rot30, cnn_small (GroupNorm), "
          "1 restart")
    print(f"{'attack':<46} {'n':>3} {'wall ms/it':>11} {'CPU ms/it':>10} {'x PR box':>9} {f'x n={sizes[0]}':>8}")
    for name, n, w, c in rows:
        print(f"{name:<46} {n:>3} {w:>11.2f} {c:>10.2f} {w / max(ref[n], 1e-9):>9.1f} "
              f"{w / max(first[name], 1e-9):>8.1f}")
    print(f"{'learned prior training (one-off, per step)':<46} {'':>3} {'':>11} {prior_ms:>10.2f}")


if __name__ == "__main__":
    main()
