"""Side-by-side timing: every round runs each variant once, in turn; medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class Clock:
    """Wall-clock timing that waits for the device; progress lines with elapsed time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {text}", flush=True)


def time_side_by_side(
    clock: Clock, label: str, variants: dict[str, Callable[[], None]], rounds: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per call of each variant; every round calls each variant once, in turn."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(warmup + rounds):
        for name, fn in variants.items():
            start = clock.now()
            fn()
            elapsed = clock.now() - start
            if r >= warmup:
                samples[name].append(elapsed)
        if r >= warmup:
            clock.say(
                f"{label} round {r - warmup + 1}/{rounds}: "
                + ", ".join(f"{n} {samples[n][-1] * 1e3:.1f} ms" for n in variants)
            )
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in samples.items()}
