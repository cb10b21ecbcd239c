"""What stacking runs could save: the cost per image of one SGD step of the main job's model against the batch size.

    python bench/step_cost.py [--threads 1] [--repeats 5]
    python bench/step_cost.py --variants      (batch 32: ReLU or max-pool first, torch.compile)

Training many runs as one stacked model (seeds or held-out targets vectorised with torch.func) turns R steps of a
32-image batch into one step of 32 R images. It pays only as far as a bigger batch is cheaper per image. This prints,
for cnn_small with GroupNorm on 1x28x28 and 3x28x28 digits (the main job's runs: one thread per run, two runs at
once), the median wall time per image of forward + backward + SGD step at batch 8 ... 512, and its ratio to batch 32
(the main job's). Batches are timed interleaved, ``--repeats`` rounds, so a drift of the machine hits all alike.

``--variants``: other ways to make the same step cheaper, at batch 32, timed interleaved against the trunk's order
(conv, norm, ReLU, pool): each stage's max-pool before its ReLU (the same function, as max commutes with ReLU, and
the same gradients, checked here, on 4x fewer ReLU elements), and ``torch.compile`` of the trunk (its compile time
printed apart).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fdg_audit.models import ModelConfig, build_model  # noqa: E402

BATCHES = (8, 32, 128, 512)


def step_time(net, opt, x, y, images: int) -> float:
    """Seconds per image over about ``images`` images of steps at this batch."""
    n = max(3, images // len(x))
    t = time.perf_counter()
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return (time.perf_counter() - t) / (n * len(x))


def ordered(net, pool_first: bool):
    """A copy of the network whose stages end in (pool, ReLU) if ``pool_first``, else in (ReLU, pool)."""
    net = copy.deepcopy(net)
    for stage in net.trunk:
        if isinstance(stage[2], torch.nn.MaxPool2d) != pool_first:
            stage[2], stage[3] = stage[3], stage[2]
    return net


def variants(ch: int, repeats: int) -> None:
    """Batch 32: the textbook order against pool-before-ReLU and torch.compile, interleaved; ratios to the first."""
    torch.manual_seed(0)
    built = build_model(ModelConfig("cnn_small", "group"), ch, 10, 28)
    x, y = torch.rand(32, ch, 28, 28), torch.randint(0, 10, (32,))
    base = ordered(built, pool_first=False)
    nets = {"ReLU, then pool": base, "pool, then ReLU": ordered(built, pool_first=True)}
    grads = []
    for net in nets.values():
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    t = time.perf_counter()
    nets["torch.compile"] = compiled = torch.compile(copy.deepcopy(base))
    F.cross_entropy(compiled(x), y).backward()
    print(f"{ch}x28x28: torch.compile's first step {time.perf_counter() - t:.1f} s; pool, then ReLU gives the "
          f"same gradients: {same}")
    opts = {k: torch.optim.SGD(n.parameters(), lr=0.05) for k, n in nets.items()}
    for k in nets:   # warm-up
        step_time(nets[k], opts[k], x, y, 640)
    times = {k: [] for k in nets}
    for _ in range(repeats):
        for k in nets:
            times[k].append(step_time(nets[k], opts[k], x, y, 3200))
    ref = statistics.median(times["ReLU, then pool"])
    for k, v in times.items():
        print(f"  {k:17s}: {statistics.median(v) * 1e6:7.1f} us per image  {statistics.median(v) / ref:5.2f}x  "
              f"(min {min(v) / ref:.2f}x, max {max(v) / ref:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", action="store_true", help="batch 32: ReLU or pool first, torch.compile")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.variants:
        for ch in (1, 3):
            variants(ch, a.repeats)
        return
    for ch in (1, 3):
        torch.manual_seed(0)
        net = build_model(ModelConfig("cnn_small", "group"), ch, 10, 28)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        data = {b: (torch.rand(b, ch, 28, 28), torch.randint(0, 10, (b,))) for b in BATCHES}
        for b in BATCHES:   # warm-up
            step_time(net, opt, *data[b], 2 * b)
        times = {b: [] for b in BATCHES}
        for _ in range(a.repeats):
            for b in BATCHES:
                times[b].append(step_time(net, opt, *data[b], 3200))
        ref = statistics.median(times[32])
        print(f"{ch}x28x28, {a.threads} thread(s), median of {a.repeats}:")
        for b in BATCHES:
            med = statistics.median(times[b])
            print(f"  batch {b:4d}: {med * 1e6:7.1f} us per image  {med / ref:5.2f}x batch 32  "
                  f"(min {min(times[b]) / ref:.2f}x, max {max(times[b]) / ref:.2f}x)")


if __name__ == "__main__":
    main()
