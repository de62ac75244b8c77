"""What the benchmarks and the numerical checks measure with: relative error, and wall time
with the GPU's queued work included."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (in float64)."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def sync_time() -> float:
    """time.perf_counter() once the GPU's queued work is done (no GPU: at once)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds `fn` takes with its GPU work, its result)."""
    t0 = sync_time()
    result = fn()
    return sync_time() - t0, result


def median_s(fn: Callable[[], T], rounds: int) -> tuple[float, T]:
    """(median seconds of `rounds` calls of `fn` with their GPU work, the last result)."""
    times, out = [], None
    for _ in range(rounds):
        t, out = timed(fn)
        times.append(t)
    return statistics.median(times), out
