"""Gated full attention of Qwen3.5/3.6: q/k RMSNorm, partial RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from sparrow.config import ModelConfig
from sparrow.kernels import fits_tiles, use_triton
from sparrow.kernels.attention import naive
from sparrow.kernels.attention.paged import paged_attention, paged_decode_attention
from sparrow.layers.linear import Projections
from sparrow.layers.norms import ZeroCenteredRMSNorm
from sparrow.worker.cache import StepMetadata


class GatedAttention(Projections, nn.Module):
    FUSED = {"qkv": ("q_proj", "k_proj", "v_proj")}

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
        self.kernel_fits = fits_tiles(self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: StepMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x: [T, hidden] (the step's new tokens); cos, sin: [T, rotary]; kv_cache: this
        layer's paged K and V [num_blocks, block_size, Hkv, D], written here, then read."""
        t = x.shape[0]
        q, k, v = self.project("qkv", x)
        q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm.with_rope(q, cos, sin)
        k = self.k_norm.with_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        args = (k_cache, v_cache, meta.block_tables, meta.cu_seqlens, meta.context_lens, self.scale)
        if use_triton(x) and self.kernel_fits and meta.max_q_len == 1:  # decode
            out = paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.block_tables,
                                         meta.context_lens, self.scale,
                                         gate.contiguous())  # fmt: skip
        elif use_triton(x) and self.kernel_fits:
            out = paged_attention(q.contiguous(), *args, gate=gate.contiguous(),
                                  max_q_len=meta.max_q_len)  # fmt: skip
        else:
            out = naive.paged_attention(q, *args) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(t, -1))
