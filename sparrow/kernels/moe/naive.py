"""The MoE layer's routed experts in plain PyTorch: the spec of the kernels in this folder.

`route` is the model's router (softmax over experts, top-k, renormalised). `align` turns the
[T, k] expert choices into the layout the grouped GEMM walks: the T*k assignments (flat
index t * k + slot) grouped by expert, each expert's group cut into blocks of `block_m` rows,
and for each block its first row and the expert it belongs to. With `small_m`, an expert's
last rows, when at most `small_m` of them remain after its full blocks, take one block of
`small_m` rows instead (a second list of blocks, run with smaller tiles). `experts` is the
experts' gated MLPs over float weights (the model's reference path), `moe_experts` the same
over group-affine quantised weights with the kernels' precision, `combine` the layer's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sparrow.quant.affine import QuantSpec, dequantize


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E]. Returns (weights [T, k] in the logits' dtype, expert ids [T, k]):
    softmax in fp32 over all experts, top-k, renormalised to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


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
    return Routing(
        sorted_ids.to(ids.device),
        Blocks(*(t.to(ids.device) for t in big)),
        small and Blocks(*(t.to(ids.device) for t in small)),
    )


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [.., 2I] gate_up output (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    act: Callable[[torch.Tensor], torch.Tensor] = swiglu,
) -> torch.Tensor:
    """x: [T, hidden]; weights, ids: [T, k]; expert_weights(e): expert e's float (gate_up
    [2I, hidden], down [hidden, I]). Returns sum_j w_tj * down(act(gate_up(x_t))) over the
    experts that received rows (act: the GLU of gate and up, `swiglu` by default), in x's
    dtype (matmuls in x's dtype, as the model's reference path). Reads the ids on the host."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        gate_up, down = expert_weights(e)
        h = act(F.linear(x[token], gate_up.to(x.dtype)))
        y = F.linear(h, down.to(x.dtype)) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    spec: QuantSpec,
    act: Callable[[torch.Tensor], torch.Tensor] = swiglu,
) -> torch.Tensor:
    """The spec of the expert kernels. x: [T, D]; weights, ids: [T, k]; gate_up: (packed [E,
    2I, D/8], scales, biases); down: (packed [E, D, I/8], scales, biases). Returns sum_j w_tj
    * expert_{ids_tj}(x_t), [T, D] in x's dtype: down(act(gate_up)) with fp32 accumulation,
    act (`swiglu` by default) on the fp32 gate_up output."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        w_gu = dequantize(*(t[e] for t in gate_up), spec)
        w_d = dequantize(*(t[e] for t in down), spec)
        h = act(x[token].float() @ w_gu.t()).to(x.dtype).float()  # the kernel stores h so
        out.index_add_(0, token, (h @ w_d.t()) * weights[token, slot, None].float())
    return out.to(x.dtype)


def combine(
    partial: torch.Tensor,
    shared: torch.Tensor,
    shared_gate: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """The MoE layer's output: partial [T, k, D] fp32 (weighted expert outputs), shared
    [T, D] (the shared expert's output), shared_gate [T, 1] (its gate logit; None: ungated).
    scale * sum_j partial[:, j] + sigmoid(shared_gate) * shared (or + shared), in shared's
    dtype."""
    routed = partial.sum(1) * scale
    gate = 1.0 if shared_gate is None else torch.sigmoid(shared_gate.float())
    return (routed + gate * shared.float()).to(shared.dtype)
