"""Gated full attention of Qwen3.5/3.6: q/k RMSNorm, partial RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sparrow.config import ModelConfig
from sparrow.kernels.attention.naive import causal_attention
from sparrow.layers.norms import ZeroCenteredRMSNorm
from sparrow.layers.rotary import apply_rotary


@dataclass
class KVCache:
    """One sequence's keys and values for one attention layer: [L, Hkv, D] each."""

    k: torch.Tensor
    v: torch.Tensor

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = torch.cat((self.k, k))
        self.v = torch.cat((self.v, v))
        return self.k, self.v


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # q_proj rows are per head [q (head_dim) | gate (head_dim)].
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def new_state(self, device: torch.device, dtype: torch.dtype) -> KVCache:
        empty = torch.empty(0, self.num_kv_heads, self.head_dim, device=device, dtype=dtype)
        return KVCache(empty, empty.clone())

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: list[int],
        caches: list[KVCache],
    ) -> torch.Tensor:
        """x: [T, hidden] for the sequences of `seq_lens` back to back; cos, sin: [T, rotary]."""
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        k = apply_rotary(k, cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        outs = []
        for q_s, k_s, v_s, cache in zip(
            q.split(seq_lens), k.split(seq_lens), v.split(seq_lens), caches, strict=True
        ):
            k_all, v_all = cache.append(k_s, v_s)
            outs.append(causal_attention(q_s, k_all, v_all, self.scale))
        out = torch.cat(outs).reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)
