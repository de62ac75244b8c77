"""Depthwise causal conv1d + SiLU with a carried state: the spec of the conv kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x: [L, C]; conv_state: [C, K-1]; weight: [C, K].
    Returns (y [L, C], new conv_state)."""
    x_ext = torch.cat((conv_state, x.t().to(conv_state.dtype)), dim=-1)  # [C, K-1+L]
    y = F.conv1d(x_ext[None].to(weight.dtype), weight[:, None], groups=weight.shape[0])[0]
    return F.silu(y).t().to(x.dtype), x_ext[:, x_ext.shape[1] - conv_state.shape[1] :]


def conv_state_after(x: torch.Tensor, conv_state: torch.Tensor, n: int) -> torch.Tensor:
    """The conv state [C, K-1] after the first n tokens of x [L, C] (0 <= n <= L), from
    conv_state [C, K-1] before them: the last K - 1 inputs."""
    x_ext = torch.cat((conv_state, x[:n].t().to(conv_state.dtype)), dim=-1)
    return x_ext[:, x_ext.shape[1] - conv_state.shape[1] :]


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


def causal_conv1d_step(
    x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """One new token for each of B sequences, with no host reads (it can be captured in a
    CUDA graph). x: [B, C]; conv_states: [S, C, K - 1], rows `slots` [B] read and updated in
    place; weight: [C, K]. Returns silu(conv) [B, C]: `causal_conv1d` with L = 1."""
    rows = slots.long()
    window = torch.cat((conv_states[rows], x[:, :, None].to(conv_states.dtype)), dim=-1)
    conv_states.index_copy_(0, rows, window[:, :, 1:])
    y = (window.to(weight.dtype) * weight).sum(-1)  # [B, C]
    return torch.nn.functional.silu(y).to(x.dtype)


def causal_conv1d_tokens(
    x: torch.Tensor,
    seq_lens: list[int],
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """`causal_conv1d_step`'s arithmetic for every token of B sequences back to back: each
    token's window of its last K inputs [C, K], times the weight, summed over K, through
    SiLU, all windows in one [T, C, K] tensor laid out as the step's. Under
    `kernels.batch_invariant` a token's output is then the same bits decoded or in a prompt.
    x: [T, C]; seq_lens [B] (host); conv_states: [S, C, K - 1], rows `slots` [B] read and
    updated in place; weight: [C, K]. Returns silu(conv) [T, C]."""
    width, windows = weight.shape[1], []
    for b, x_b in enumerate(x.split(seq_lens)):
        slot = int(slots[b])
        ext = torch.cat((conv_states[slot], x_b.t().to(conv_states.dtype)), dim=-1)
        windows.append(ext.unfold(1, width, 1).transpose(0, 1))  # [L, C, K]
        conv_states[slot] = ext[:, ext.shape[1] - width + 1 :]
    y = (torch.cat(windows).to(weight.dtype) * weight).sum(-1)  # [T, C]
    return torch.nn.functional.silu(y).to(x.dtype)
