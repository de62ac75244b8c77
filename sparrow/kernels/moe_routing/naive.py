"""MoE routing in plain PyTorch: the spec of the routing kernels.

`route` is the model's router (softmax over experts, top-k, renormalised). `align` turns the
[T, k] expert choices into the layout the grouped GEMM walks: the T*k assignments (flat
index t * k + slot) grouped by expert, each expert's group cut into blocks of `block_m` rows,
and for each block its first row and the expert it belongs to. With `small_m`, an expert's
last rows, when at most `small_m` of them remain after its full blocks, take one block of
`small_m` rows instead (a second list of blocks, run with smaller tiles).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparrow.layers.moe import route  # noqa: F401  (the routing math is the model's own)


class Blocks(NamedTuple):
    """Blocks of one size: first row in sorted_ids and expert of each, -1 for both past the
    blocks in use."""

    start: torch.Tensor
    expert: torch.Tensor


class Routing(NamedTuple):
    sorted_ids: torch.Tensor
    blocks: Blocks  # of block_m rows
    small: Blocks | None  # of small_m rows, at most one per expert (None: no small_m)


def group_blocks(count: int, block_m: int, small_m: int) -> tuple[int, int]:
    """(blocks of block_m, blocks of small_m) for an expert's `count` rows: full blocks of
    block_m, then the rest in one block of small_m if it fits, else in one more of block_m."""
    full, rest = divmod(count, block_m)
    if rest == 0:
        return full, 0
    return (full, 1) if rest <= small_m else (full + 1, 0)


def max_blocks(num_assignments: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks of block_m rows, known without looking at the ids (so
    shapes never depend on data); sorted_ids has max_blocks * block_m rows."""
    return -(-num_assignments // block_m) + num_experts


def align(ids: torch.Tensor, num_experts: int, block_m: int, small_m: int = 0) -> Routing:
    """ids: [T, k] expert ids -> Routing: sorted_ids [max_blocks * block_m] int32, the flat
    assignment indices grouped by expert (each expert's rows: its blocks of block_m, then
    its block of small_m), padding = T*k; the blocks of block_m [max_blocks] and, given
    small_m, those of small_m [num_experts]."""
    flat = ids.flatten().long()
    n = flat.numel()
    rows = max_blocks(n, num_experts, block_m)
    sorted_ids = torch.full((rows * block_m,), n, dtype=torch.int32)
    big = Blocks(*torch.full((2, rows), -1, dtype=torch.int32))
    small = Blocks(*torch.full((2, num_experts), -1, dtype=torch.int32)) if small_m else None
    row = num_big = num_small = 0
    for e in range(num_experts):
        members = torch.nonzero(flat == e).flatten()
        sorted_ids[row : row + members.numel()] = members.to(torch.int32)
        n_big, n_small = group_blocks(members.numel(), block_m, small_m)
        for _ in range(n_big):
            big.start[num_big], big.expert[num_big] = row, e
            row, num_big = row + block_m, num_big + 1
        if n_small:
            small.start[num_small], small.expert[num_small] = row, e
            row, num_small = row + small_m, num_small + 1
    return Routing(sorted_ids.to(ids.device), Blocks(*(t.to(ids.device) for t in big)),
                   small and Blocks(*(t.to(ids.device) for t in small)))  # fmt: skip
