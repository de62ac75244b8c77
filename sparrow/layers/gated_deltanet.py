"""Gated DeltaNet (linear attention) layer of Qwen3.5/3.6 with per-sequence recurrent state."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.config import ModelConfig
from sparrow.kernels import use_triton
from sparrow.kernels.causal_conv1d.conv import causal_conv1d_varlen
from sparrow.kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_varlen
from sparrow.kernels.gated_delta_rule.fused_recurrent import fused_recurrent_step
from sparrow.kernels.gated_delta_rule.naive import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from sparrow.layers.norms import GatedRMSNorm


@dataclass
class GDNState:
    """One sequence's state for one GDN layer."""

    conv: torch.Tensor  # [conv_dim, kernel - 1]: the last inputs of the causal conv
    recurrent: torch.Tensor  # [Hv, Dk, Dv] fp32


def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x: [L, C]; conv_state: [C, K-1]; weight: [C, K].
    Returns (y [L, C], new conv_state)."""
    x_ext = torch.cat((conv_state, x.t().to(conv_state.dtype)), dim=-1)  # [C, K-1+L]
    y = F.conv1d(x_ext[None].to(weight.dtype), weight[:, None], groups=weight.shape[0])[0]
    return F.silu(y).t().to(x.dtype), x_ext[:, x_ext.shape[1] - conv_state.shape[1] :]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.conv_dim, self.kernel = cfg.linear_conv_dim, cfg.linear_conv_kernel
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)
        # The kernels tile head dims in powers of two (>= 16, as tl.dot needs); other shapes
        # take the reference path.
        self.kernels_fit = all(
            n >= 16 and n & (n - 1) == 0 for n in (self.head_k_dim, self.head_v_dim)
        )

    def new_state(self, device: torch.device, dtype: torch.dtype) -> GDNState:
        return GDNState(
            conv=torch.zeros(self.conv_dim, self.kernel - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(
                self.num_v_heads, self.head_k_dim, self.head_v_dim,
                device=device, dtype=torch.float32,
            ),
        )  # fmt: skip

    def forward(self, x: torch.Tensor, seq_lens: list[int], states: list[GDNState]) -> torch.Tensor:
        """x: [T, hidden] for the sequences of `seq_lens` back to back."""
        if use_triton(x) and self.kernels_fit:
            return self._forward_kernels(x, seq_lens, states)
        mixed_qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0]
        outs = []
        for qkv_s, g_s, beta_s, state in zip(
            mixed_qkv.split(seq_lens), g.split(seq_lens), beta.split(seq_lens), states, strict=True
        ):
            qkv_s, state.conv = causal_conv1d(qkv_s, state.conv, weight)
            q, k, v = qkv_s.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
            q = q.unflatten(-1, (self.num_k_heads, self.head_k_dim))
            k = k.unflatten(-1, (self.num_k_heads, self.head_k_dim))
            v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
            rule = recurrent_gated_delta_rule if len(v) == 1 else chunk_gated_delta_rule
            o, state.recurrent = rule(q, k, v, g_s, beta_s, state.recurrent)
            outs.append(o.to(x.dtype))
        o = torch.cat(outs)  # [T, Hv, Dv]
        o = self.norm(o, z.view_as(o))
        return self.out_proj(o.flatten(1))

    def _forward_kernels(
        self, x: torch.Tensor, seq_lens: list[int], states: list[GDNState]
    ) -> torch.Tensor:
        """The same layer through the Triton kernels: conv, then the fused recurrent step when
        every sequence brings one token (decode), else the chunked scan. The per-sequence
        states are stacked into a pool for the kernels and handed back after."""
        cu = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=x.device)
        slots = torch.arange(len(states), dtype=torch.int32, device=x.device)
        conv_pool = torch.stack([s.conv for s in states])
        state_pool = torch.stack([s.recurrent for s in states])
        weight = self.conv1d.weight[:, 0]
        qkv = causal_conv1d_varlen(self.in_proj_qkv(x), cu, conv_pool, slots, weight)
        a, b = self.in_proj_a(x), self.in_proj_b(x)
        if all(n == 1 for n in seq_lens):
            o = fused_recurrent_step(qkv, a, b, self.A_log, self.dt_bias, state_pool, slots,
                                     self.num_k_heads)  # fmt: skip
        else:
            q, k, v = qkv.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
            o = chunk_gated_delta_rule_varlen(
                q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
                g, b.sigmoid().float(), cu, state_pool, slots,
            )  # fmt: skip
        for i, s in enumerate(states):
            s.conv, s.recurrent = conv_pool[i], state_pool[i]
        o = o.to(x.dtype)
        o = self.norm(o, self.in_proj_z(x).view_as(o))
        return self.out_proj(o.flatten(1))
