"""The routed-expert computation of one MoE layer in plain PyTorch: the spec of the grouped
GEMM kernels. Expert weights are group-affine quantised (MLX layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparrow.quant.affine import QuantSpec, dequantize


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    spec: QuantSpec,
) -> torch.Tensor:
    """x: [T, D]; weights, ids: [T, k]; gate_up: (packed [E, 2I, D/8], scales, biases);
    down: (packed [E, D, I/8], scales, biases). Returns sum_j w_tj * expert_{ids_tj}(x_t),
    [T, D] in x's dtype: down(silu(gate) * up) with fp32 accumulation."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        w_gu = dequantize(*(t[e] for t in gate_up), spec)
        w_d = dequantize(*(t[e] for t in down), spec)
        gate, up = (x[token].float() @ w_gu.t()).chunk(2, dim=-1)
        h = (F.silu(gate) * up).to(x.dtype).float()  # the kernel stores h in x's dtype
        out.index_add_(0, token, (h @ w_d.t()) * weights[token, slot, None].float())
    return out.to(x.dtype)


def combine(partial: torch.Tensor, shared: torch.Tensor, shared_gate: torch.Tensor) -> torch.Tensor:
    """The MoE layer's output: partial [T, k, D] fp32 (weighted expert outputs), shared
    [T, D] (the shared expert's output), shared_gate [T, 1] (its gate logit).
    sum_j partial[:, j] + sigmoid(shared_gate) * shared, in shared's dtype."""
    routed = partial.sum(1).to(shared.dtype)
    return routed + torch.sigmoid(shared_gate) * shared
