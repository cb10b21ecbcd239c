"""Progress lines that tell the time: the phase, items done and left, and an estimate of the time left."""
from __future__ import annotations

import time


class Eta:
    """Time left in a phase, from the mean time per finished item so far: "training 12/45 done, 3m10s elapsed,
    about 8m left"."""

    def __init__(self, phase: str, total: int):
        self.phase, self.total, self.done, self.t0 = phase, total, 0, time.perf_counter()

    def tick(self) -> str:
        self.done += 1
        spent = time.perf_counter() - self.t0
        left = spent / self.done * (self.total - self.done)
        return f"{self.phase} {self.done}/{self.total} done, {_mins(spent)} elapsed, about {_mins(left)} left"


def _mins(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"
