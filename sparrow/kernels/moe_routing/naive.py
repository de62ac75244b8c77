"""MoE routing in plain PyTorch: the spec of the routing kernels.

`route` is the model's router (softmax over experts, top-k, renormalised). `align` turns the
[T, k] expert choices into the layout the grouped GEMM walks: the T*k assignments (flat
index t * k + slot) grouped by expert, each expert's group padded to a multiple of
`block_m`, and for each block of `block_m` rows the expert it belongs to.
"""

from __future__ import annotations

import torch

from sparrow.layers.moe import route  # noqa: F401  (the routing math is the model's own)


def align(ids: torch.Tensor, num_experts: int, block_m: int):
    """ids: [T, k] expert ids. Returns
    sorted_ids [max_rows] int32: flat assignment indices grouped by expert, padding = T*k;
    block_expert [max_blocks] int32: expert of each block of block_m rows (-1 past the end);
    num_rows [1] int32: rows in use (sum of padded group sizes).
    max_rows = max_blocks * block_m, max_blocks = cdiv(T*k, block_m) + num_experts: an upper
    bound known without looking at the ids, so shapes never depend on data."""
    flat = ids.flatten().long()
    n = flat.numel()
    max_blocks = -(-n // block_m) + num_experts
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=ids.device)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32, device=ids.device)
    row = 0
    for e in range(num_experts):
        members = torch.nonzero(flat == e).flatten()
        if members.numel() == 0:
            continue
        sorted_ids[row : row + members.numel()] = members.to(torch.int32)
        blocks = -(-members.numel() // block_m)
        block_expert[row // block_m : row // block_m + blocks] = e
        row += blocks * block_m
    return sorted_ids, block_expert, torch.tensor([row], dtype=torch.int32, device=ids.device)
