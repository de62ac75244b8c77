"""Depthwise causal conv1d + SiLU with a carried state: the spec of the conv kernels."""

from __future__ import annotations

import torch

from sparrow.layers.gated_deltanet import causal_conv1d  # noqa: F401  (the model's own)


def causal_conv1d_varlen(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """x: [T, C], sequences back to back (cu_seqlens [B + 1]); conv_states: [S, C, K - 1], a
    pool indexed by slots [B], updated in place; weight: [C, K]. Returns silu(conv) [T, C]."""
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        slot = int(slots[b])
        y, new_state = causal_conv1d(x[start:end], conv_states[slot], weight)
        out[start:end] = y
        conv_states[slot] = new_state
    return out
