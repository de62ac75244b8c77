"""RMSNorm variants of Qwen3.5/3.6, with the exact dtype handling of the HF reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCenteredRMSNorm(nn.Module):
    """`rms_norm(x) * (1 + w)`, computed in fp32, cast back. The stored weight is w (init 0)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet output norm: `w * rms_norm(x) * silu(z)` (plain w, init 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = self.weight * rms_norm(x, self.eps).to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)
