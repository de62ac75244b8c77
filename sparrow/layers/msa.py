"""MiniMax M3 attention: per-head Gemma q/k norms, partial RoPE, GQA, no output gate; on
sparse layers the MSA indexer picks `topk` key blocks per (query, KV group) and attention
runs over those blocks only (`sparrow.kernels.msa.naive` defines both steps)."""

from __future__ import annotations

import torch
from torch import nn

from sparrow.core.cache_spec import PagedKVSpec, SparseKVSpec
from sparrow.kernels import fits_tiles, use_triton
from sparrow.kernels.attention import naive as dense
from sparrow.kernels.attention import paged
from sparrow.kernels.msa import kernels as msa_kernels
from sparrow.kernels.msa import naive as msa
from sparrow.layers.metadata import StepMetadata
from sparrow.layers.norms import ZeroCenteredRMSNorm


class Indexer(nn.Module):
    """Index queries (Hi heads) and one index key per token, both Gemma-normed and rotated
    with the attention's RoPE tables cut to the index head dim."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, head_dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ik_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        ik_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, hidden]. Writes the index keys to ik_cache [pages, bs, Di] at slot_mapping
        [T] (with ik_scale [pages, bs]: their fp8 codes there and their scales in ik_scale);
        returns the index queries [T, Hi, Di]."""
        t, di = x.shape[0], self.head_dim
        cos, sin = cos[:, :di].contiguous(), sin[:, :di].contiguous()
        iq = self.q_norm.with_rope(self.q_proj(x).view(t, self.num_heads, di), cos, sin)
        ik = self.k_norm.with_rope(self.k_proj(x).view(t, 1, di), cos, sin)[:, 0]
        if ik_scale is None:
            ik_cache.view(-1, di).index_copy_(0, slot_mapping, ik)
            return iq
        codes, scale = msa.quantize_index_keys(ik)
        rows = ik_cache.view(torch.uint8).view(-1, di)  # bytes: no float8 index_copy_ on a CPU
        rows.index_copy_(0, slot_mapping, codes.view(torch.uint8))
        ik_scale.view(-1).index_copy_(0, slot_mapping, scale)
        return iq


def index_cache(cache: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sparse layer's index keys [pages, bs, Di] and, for fp8 keys, their scales [pages,
    bs] (else None): cache is (k, v, keys) or (k, v, codes, scales)."""
    return cache[2], cache[3] if len(cache) > 3 else None


class M3Attention(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        sparse: dict | None = None,
    ):
        """sparse: None for full attention, else the MSA settings {index_heads,
        index_head_dim, block_size, topk, local_blocks}."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.sparse = sparse
        if sparse is not None:
            self.indexer = Indexer(hidden, sparse["index_heads"], sparse["index_head_dim"], eps)

    def cache_spec(self) -> PagedKVSpec | SparseKVSpec:
        if self.sparse is None:
            return PagedKVSpec(self.num_kv_heads, self.head_dim)
        return SparseKVSpec(
            self.num_kv_heads,
            self.head_dim,
            self.sparse["index_head_dim"],
            self.sparse["block_size"],
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: StepMetadata,
        cache: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, rotary]; cache: this layer's paged K and V
        [pages, bs, Hkv, D] (and on sparse layers the index keys, `index_cache`), written
        here for the step's tokens, then read."""
        t, hkv, d = x.shape[0], self.num_kv_heads, self.head_dim
        q = self.q_norm.with_rope(self.q_proj(x).view(t, self.num_heads, d), cos, sin)
        v = self.v_proj(x).view(t, hkv, d)
        k_cache, v_cache = cache[0], cache[1]
        rows = (k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d), meta.slot_mapping)
        self.k_norm.with_rope(self.k_proj(x).view(t, hkv, d), cos, sin, cache=(v, *rows))
        if self.sparse is None:
            out = self._dense(q, k_cache, v_cache, meta)
        else:
            ik_cache, ik_scale = index_cache(cache)
            iq = self.indexer(x, cos, sin, ik_cache, meta.slot_mapping, ik_scale)
            out = self._sparse(q, iq, cache, meta)
        return self.o_proj(out.reshape(t, -1))

    def _dense(self, q, k_cache, v_cache, meta: StepMetadata) -> torch.Tensor:
        if use_triton(q) and fits_tiles(self.head_dim):
            if meta.max_q_len == 1:
                return paged.paged_decode_attention(
                    q.contiguous(),
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.context_lens,
                    self.scale,
                )
            return paged.paged_attention(
                q.contiguous(),
                k_cache,
                v_cache,
                meta.block_tables,
                meta.cu_seqlens,
                meta.context_lens,
                self.scale,
                max_q_len=meta.max_q_len,
            )
        if meta.max_q_len == 1:  # no host reads
            return dense.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale
            )
        return dense.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens, meta.context_lens, self.scale
        )

    def _sparse(self, q, iq, cache, meta: StepMetadata) -> torch.Tensor:
        """The MSA kernels (`kernels.msa.kernels`) with the Triton backend where the dims
        suit them, else the reference (`kernels.msa.naive`): the same functions."""
        k_cache, v_cache = cache[0], cache[1]
        ik_cache, ik_scale = index_cache(cache)
        topk, local = self.sparse["topk"], self.sparse["local_blocks"]
        dims = (self.head_dim, self.sparse["index_head_dim"], self.sparse["block_size"])
        ops = msa_kernels if use_triton(q) and fits_tiles(*dims) else msa
        if meta.max_q_len == 1:  # one query per sequence: no host reads
            blocks = ops.decode_select_blocks(
                iq, ik_cache, meta.block_tables, meta.positions, topk, local, ik_scale=ik_scale
            )
            tables = meta.block_tables
        else:
            blocks = self._select_per_sequence(ops, iq, ik_cache, ik_scale, meta, topk, local)
            tables = ops.token_tables(meta.block_tables, meta.cu_seqlens, q.shape[0])
        return ops.sparse_attention(q, k_cache, v_cache, tables, meta.positions, blocks, self.scale)

    @staticmethod
    def _select_per_sequence(
        ops, iq, ik_cache, ik_scale, meta: StepMetadata, topk: int, local: int
    ):
        """Prompts and chunks: each sequence's queries score its keys (read once per chunk);
        reads the context lengths on the host."""
        out, start = [], 0
        for b, (n, ctx) in enumerate(zip(meta.seq_lens, meta.context_lens.tolist(), strict=True)):
            out.append(
                ops.select_blocks(
                    iq[start : start + n],
                    ik_cache,
                    meta.block_tables[b],
                    range(ctx - n, ctx),
                    topk,
                    local,
                    ik_scale=ik_scale,
                )
            )
            start += n
        return torch.cat(out)
