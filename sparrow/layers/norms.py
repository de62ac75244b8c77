"""RMSNorm variants of Qwen3.5/3.6 and Qwen3-MoE, with the exact dtype handling of the HF
reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.kernels import use_triton
from sparrow.kernels.rms_norm import naive
from sparrow.kernels.rms_norm import norm as kernels


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCenteredRMSNorm(nn.Module):
    """`rms_norm(x) * (1 + w)`, computed in fp32, cast back. The stored weight is w (init 0).
    With the kernel backend each call is one Triton kernel, fused with its neighbour: the
    residual add (`add`) or the rotary embedding of q/k (`with_rope`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels if use_triton(x) and x.is_contiguous() else naive
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm): the residual stream's step into the next sub-layer."""
        ops = kernels if use_triton(x) else naive
        return ops.add_rms_norm(x, residual, self.weight, self.eps)

    def with_rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: tuple | None = None
    ) -> torch.Tensor:
        """Per-head norm then partial RoPE: x [T, H, D] (a view of a projection is fine).
        cache = (v, k_cache, v_cache, rows): also write the result and v there (see
        `naive.rms_norm_rope`)."""
        fits = use_triton(x) and x.stride(-1) == 1 and x.shape[-1] & (x.shape[-1] - 1) == 0
        ops = kernels if fits else naive
        return ops.rms_norm_rope(x, self.weight, self.eps, cos, sin, cache)


class RMSNorm(nn.Module):
    """The plain RMSNorm of Qwen3-MoE: `w * rms_norm(x)` (w init 1), the normed row cast to
    x's dtype before the weight multiplies it (HF's `Qwen3MoeRMSNorm`). The calls of
    `ZeroCenteredRMSNorm` (`add`, `with_rope`), on the torch path only: the fused kernels
    compute the zero-centred form, rounding once from fp32, an ulp apart in 16-bit dtypes."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_norm(x, self.eps).to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm)."""
        s = residual + x
        return s, self(s)

    def with_rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: tuple | None = None
    ) -> torch.Tensor:
        """Per-head norm then RoPE on the first cos.shape[-1] dims: x [T, H, D]. cache = (v,
        k_cache, v_cache, rows): also write the result and v there (`naive.rms_norm_rope`)."""
        y = naive.apply_rotary(self(x), cos, sin)
        if cache is not None:
            v, k_cache, v_cache, rows = cache
            k_cache.index_copy_(0, rows, y)
            v_cache.index_copy_(0, rows, v)
        return y


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet output norm: `w * rms_norm(x) * silu(z)` (plain w, init 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = self.weight * rms_norm(x, self.eps).to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)
