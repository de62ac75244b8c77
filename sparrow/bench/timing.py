"""GPU timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable

import torch

HBM_BYTES_PER_S = 4.3e12  # measured copy bandwidth of our H200
BF16_FLOP_PER_S = 790e12  # measured dense bf16 matmul rate of our H200


def event_ms(fn: Callable[[], object], rounds: int = 3, reps: int = 1) -> float:
    """Median over `rounds` of the milliseconds per call of `reps` calls of `fn` back to back,
    timed by CUDA events (after one warm-up call)."""
    fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def graph_time_us(calls: list[Callable[[], object]], replays: int = 20, rounds: int = 5) -> float:
    """Median time per call, in microseconds, of `calls` captured back to back in one CUDA
    graph (how decode runs). Pass calls over distinct buffers larger than L2 together so
    every call reads from HBM, as in a real decode step."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm up: compile kernels, allocate outputs
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    return statistics.median(times)


def kernel_profile(fn: Callable[[], object], top: int = 20) -> dict:
    """Run `fn` once (after one warm-up call) under the profiler: CUDA time and launch count
    per kernel, the busiest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            per_kernel[event.name].append(event.device_time_total)
    rows = sorted(((n, len(t), sum(t)) for n, t in per_kernel.items()), key=lambda r: -r[2])
    return {
        "kernels": sum(r[1] for r in rows),
        "kernel_time_us": sum(r[2] for r in rows),
        "top": [{"kernel": n[:90], "count": c, "us": round(us, 1)} for n, c, us in rows[:top]],
    }
