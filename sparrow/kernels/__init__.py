"""Triton kernels, one folder per op, each with `naive.py`: the PyTorch reference it must match.

One switch selects the path the model takes: `reference` (plain PyTorch everywhere), `triton`
(the kernels, also on CPU tensors under TRITON_INTERPRET=1), or `auto` (the default: kernels
for CUDA tensors, reference otherwise). Set it with SPARROW_KERNELS or `set_backend`.
"""

from __future__ import annotations

import os

import torch

_BACKENDS = ("auto", "reference", "triton")
_backend = os.environ.get("SPARROW_KERNELS", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"SPARROW_KERNELS={_backend!r}; expected one of {_BACKENDS}")


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {_BACKENDS}")
    _backend = name


def get_backend() -> str:
    return _backend


def fits_tiles(*dims: int) -> bool:
    """Whether head dims suit the kernels: powers of two, at least 16 (what tl.dot needs).
    Layers with other shapes take the reference path."""
    return all(n >= 16 and n & (n - 1) == 0 for n in dims)


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on `t` take the Triton kernels."""
    return _backend == "triton" or (_backend == "auto" and t.is_cuda)
