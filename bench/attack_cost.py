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

    python bench/attack_cost.py --against RUN_DIR --log LOG [--parallel 2]

The cost guard against an attacked run folder: per attack, the guard's estimate for the folder's scenario
(config.resolved.toml, planned again: its data are built) next to the measured time from the attack lines of LOG
(the scenario's or ``attack``'s stderr): "C CPU s" where the line has it (workers + harness), else the wall seconds x
``--parallel`` (an upper bound of the CPU seconds on that many cores, marked "wall").
"""
from __future__ import annotations

import argparse
import math
import re
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


def against(run_dir: str, log: str, parallel: int) -> None:
    """Print the cost guard's estimate of each attack of ``run_dir`` beside the time LOG's attack lines measured."""
    from fdg_audit.audit.checks import check_attacks
    from fdg_audit.runner import cost_guard
    from fdg_audit.scenario import load_raw, plan
    runs = plan(load_raw(Path(run_dir) / "config.resolved.toml"))
    est = cost_guard(runs, check_attacks(runs[0]["sc"].attacks), math.inf, quiet=True)
    got = {}
    for m in re.finditer(r"^attack (\S+): (\d+) runs[^,]*, (\d+) s(?:, (\d+) CPU s)?", Path(log).read_text(), re.M):
        got[m[1]] = (float(m[4]), "CPU") if m[4] else (parallel * float(m[3]), "wall")
    print(f"{'attack':<28} {'estimate CPU s':>14} {'measured s':>11} {'':4} {'ratio':>6}")
    tot_e = tot_m = 0.0
    for label in sorted(set(est) | set(got)):
        e, (m, how) = est.get(label), got.get(label, (math.nan, ""))
        tot_e, tot_m = tot_e + (e or 0.0), tot_m + (0.0 if math.isnan(m) else m)
        print(f"{label:<28} {'not estimated' if e is None else f'{e:.0f}':>14} {m:>11.0f} {how:4} "
              f"{(e or math.nan) / m:>6.2f}")
    print(f"{'total':<28} {tot_e:>14.0f} {tot_m:>11.0f} {'':4} {tot_e / tot_m:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--victims", type=int, default=4, help="victims per batch for the batched row")
    ap.add_argument("--prior-steps", type=int, default=50, help="VAE training steps timed (and used by the rows)")
    ap.add_argument("--dataset", default="mnist", help="mnist (the main job's real digits) or digits (embedded)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--against", help="an attacked run folder: compare the cost guard with LOG (see above)")
    ap.add_argument("--log", help="the attack lines of that folder's run (its stderr)")
    ap.add_argument("--parallel", type=int, default=2, help="cores the attacks ran on (wall x this = CPU bound)")
    a = ap.parse_args()
    if a.against:
        return against(a.against, a.log, a.parallel)
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
