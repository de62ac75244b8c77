"""y = x @ W^T with W in the group-affine format: the spec of the fused-dequant kernels."""

from __future__ import annotations

import torch

from sparrow.quant.affine import QuantSpec, dequantize


def quant_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
) -> torch.Tensor:
    """x: [M, K]; packed: [N, K * bits / 32] int32; scales, biases: [N, K / group].
    Returns [M, N] in x's dtype, accumulated in fp32."""
    w = dequantize(packed, scales, biases, spec, torch.float32)
    return (x.float() @ w.t()).to(x.dtype)
