"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start
while the kernel before it in the stream is still running. Its programs wait at once
(`griddepcontrol.wait`) until that kernel has finished and its writes are visible, then let
the next kernel launch (`griddepcontrol.launch_dependents`). What it saves is the launch gap
between consecutive kernels, which at decode (hundreds of kernels of a few microseconds per
step, replayed from a CUDA graph) is a large part of a step.

Every kernel launched this way waits before its first memory access, so the order of reads
and writes is the stream's, as without it. Kernels launched without it (PyTorch's) wait for
the whole previous kernel as usual.

Off unless SPARROW_EXPERIMENTAL names `pdl` (see `sparrow.kernels`); on CPU tensors (the
interpreter) never.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sparrow.kernels import experimental


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """First statement of a kernel that may be launched with `launch_args(...)`."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    return (device.type == "cuda" and experimental("pdl")
            and _supported(device.index if device.index is not None
                           else torch.cuda.current_device()))  # fmt: skip


def launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel that starts with `wait_for_previous`."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(t.device) else {"USE_PDL": False}
