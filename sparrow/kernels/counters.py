"""Arrival counters for kernels whose programs finish a shared piece of work: each program
does its part, then (after a CTA barrier) one acq_rel atomic add on the piece's counter; the
program that sees the count reach its last value does the shared part (reading what the
others wrote, past L1) and sets the counter back to zero. So the counters are zero before
and after every launch, and a CUDA graph can replay the kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters, allocated once per device (generously, so that a
    CUDA-graph capture does not allocate them)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return buf


@triton.jit
def last_to_arrive(p_count, arrivals):
    """Count this program in at p_count (after a CTA barrier: every earlier read and write of
    the program comes first); True for the last of `arrivals`, which also resets the count."""
    tl.debug_barrier()
    last = tl.atomic_add(p_count, 1) == arrivals - 1
    if last:
        tl.store(p_count, 0)
    return last
