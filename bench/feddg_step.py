"""FedDG's local step and relay: the reused inner gradient vs the official second backward pass (wall-time ratio,
measured side by side, interleaved, in one process) and the relay bytes with ``relay = "full"`` vs ``"window"``.

    python bench/feddg_step.py [--steps 30] [--repeats 5] [--device auto]
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fdg_audit.bus import encode
from fdg_audit.data import DataConfig, load_data
from fdg_audit.seeding import run_seq as seed_sequence
from fdg_audit.models import ModelConfig
from fdg_audit.params import resolve_device
from methods.feddg import FedDGClient, Params, amplitude, central, half_window


def official_loss(client, model, x, y):
    """The official code's step: L_in back-propagated twice (retain_graph, then the sum)."""
    p = client.params
    with torch.no_grad():
        xt = client.transform(x)
    loss_in = F.cross_entropy(model(x), y)
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss_in, params, retain_graph=True)
    fast = {k: v - p.meta_step_size * g.clamp(-p.clip_value, p.clip_value) for k, v, g in zip(names, params, grads)}
    return loss_in + F.cross_entropy(functional_call(model, fast, (xt,)), y)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    dev = resolve_device(a.device)
    data = load_data(DataConfig(dataset="digits", family="rotated", domains=["rot0", "rot15", "rot30", "rot45"]))
    ctx = dict(params=Params(batch_size=32), device=dev, model_cfg=ModelConfig(), shape=(1, 28, 28, 10),
               seedseq=seed_sequence(0, "bench"), id="rot0", party=1, domain=data.domain("rot0"))
    client = FedDGClient(ctx)
    banks = {d: amplitude(data.domain(d).train.x) for d in ("rot15", "rot30", "rot45")}
    client.on_bank_relay(type("M", (), {"arrays": {f"{d}/amp": v for d, v in banks.items()}})())
    x, y = client.train.x[:32], client.train.y[:32]
    model, opt = client.model, torch.optim.SGD(client.model.parameters(), lr=0.01)

    def run(fn):
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(a.steps):
            opt.zero_grad(set_to_none=True)
            fn(model, x, y).backward()
            opt.step()
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t
    run(client.episodic_loss), run(lambda m, x, y: official_loss(client, m, x, y))   # warm-up
    new, old = [], []
    for _ in range(a.repeats):
        new.append(run(client.episodic_loss))
        old.append(run(lambda m, x, y: official_loss(client, m, x, y)))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    print(f"device {dev}, {a.steps} steps x {a.repeats} repeats, batch 32, cnn_small")
    print(f"episodic step: second backward / reused inner gradient = {med(old) / med(new):.2f} (median wall time)")
    b = half_window(Params(), 28, 28)
    full = sum(len(encode({f"{o}/amp": banks[o] for o in banks if o != c})) for c in banks)
    win = sum(len(encode({f"{o}/amp": central(banks[o], b).contiguous() for o in banks if o != c})) for c in banks)
    print(f"relay bytes, 3 clients of 240 images: full {full} B, window {win} B, ratio {full / win:.1f}")


if __name__ == "__main__":
    main()
