"""Progress lines that tell the time: the phase, items done and left, and an estimate of the time left."""
from __future__ import annotations

import time


class Eta:
    """Time left in a phase: "training 12/45 done, 3m10s elapsed, about 8m left". ``weights``: each item's estimated
    seconds in the order they finish (None: not estimated, counted as a mean estimated item); the time left is then
    the estimate of the items left x measured / estimated of the items done. Without weights: the mean time per item."""

    def __init__(self, phase: str, total: int, weights: list | None = None):
        self.phase, self.total, self.done, self.t0 = phase, total, 0, time.perf_counter()
        known = [w for w in weights or [] if w is not None]
        mean = sum(known) / len(known) if known and sum(known) > 0 else 1.0
        self.w = [mean if w is None else w for w in weights] if known else [1.0] * total

    def tick(self) -> str:
        self.done += 1
        spent = time.perf_counter() - self.t0
        est_done, est_left = sum(self.w[:self.done]), sum(self.w[self.done:self.total])
        left = spent * est_left / est_done if est_done > 0 else spent / self.done * (self.total - self.done)
        return f"{self.phase} {self.done}/{self.total} done, {_mins(spent)} elapsed, about {_mins(left)} left"


def _mins(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"
