"""The zero-centred RMSNorm of Qwen3.5/3.6 with the neighbours it is fused with, in plain
PyTorch with the model's exact dtype handling: the spec of the kernels in `norm.py`."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, R] with R <= D. Rotates the first R dims of every head."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    x_rot = x_rot * cos[:, None] + rotated * sin[:, None]
    return torch.cat((x_rot, x_pass), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x) * (1 + w)` over the last dim, computed in fp32, cast back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(
        x.dtype
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream step: s = residual + x (in x's dtype), then (s, rms_norm(s))."""
    s = residual + x
    return s, rms_norm(s, weight, eps)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-head q/k norm then partial RoPE. x: [T, H, D]; cos, sin: [T, R], R <= D.
    cache = (v [T, H, D], k_cache, v_cache [rows, H, D], rows [T]): also write the result
    and v to the caches at rows (the attention layer's K/V step)."""
    y = apply_rotary(rms_norm(x, weight, eps), cos, sin)
    if cache is not None:
        v, k_cache, v_cache, rows = cache
        k_cache.index_copy_(0, rows, y)
        v_cache.index_copy_(0, rows, v)
    return y
