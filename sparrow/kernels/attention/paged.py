"""Causal attention over a paged KV cache for prefill chunks and decode, varlen batches.

One program per (query block, KV head, sequence). GQA packing: the G = Hq / Hkv query heads
of a KV head are rows of one tile ([BLOCK_M query positions x G heads]), so each key/value
row loaded from the cache serves all of them. Keys are walked in BLOCK_N steps through the
block table with an online softmax (fp32); the sigmoid output gate is applied before the
store. Decode is the case of one query per sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, gate_ptr, o_ptr, tables_ptr, cu_q_ptr, ctx_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, scale,
    G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, HAS_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    i_m, i_kvh, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + i_b)
    q_len = tl.load(cu_q_ptr + i_b + 1) - q_start
    if i_m * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + i_b)
    o_r = tl.arange(0, ROWS)
    q_idx = i_m * BLOCK_M + o_r // G  # query position inside the chunk
    head = i_kvh * G + o_r % G
    m_r = (o_r < BLOCK_M * G) & (q_idx < q_len)
    pos = ctx - q_len + q_idx  # absolute position of each query
    o_d = tl.arange(0, D)
    p_q = q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None], other=0.0)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    b_acc = tl.zeros([ROWS, D], dtype=tl.float32)
    # keys up to the last query of this block (causal)
    last = ctx - q_len + tl.minimum(q_len, (i_m + 1) * BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, last, BLOCK_N):
        n = n0 + o_n
        m_n = n < last
        block = tl.load(tables_ptr + i_b * stride_tb + n // CACHE_BLOCK, mask=m_n, other=0)
        p_kv = block.to(tl.int64)[:, None] * stride_kb + (n % CACHE_BLOCK)[:, None] * stride_kt \
            + i_kvh * stride_kh + o_d[None, :]  # fmt: skip
        b_k = tl.load(k_ptr + p_kv, mask=m_n[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale  # [ROWS, BLOCK_N]
        keep = m_n[None, :] & (n[None, :] <= pos[:, None])
        b_s = tl.where(keep, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        b_p = tl.exp(b_s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(b_p, axis=1)
        b_v = tl.load(v_ptr + p_kv, mask=m_n[:, None], other=0.0)
        b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
        m_i = m_new
    b_o = b_acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    p_o = (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + o_d[None, :]
    if HAS_GATE:
        b_g = tl.load(gate_ptr + p_o, mask=m_r[:, None], other=0.0).to(tl.float32)
        b_o = b_o * tl.sigmoid(b_g)
    tl.store(o_ptr + p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_r[:, None])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
    max_q_len: int | None = None,
    block_m: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Same contract as `naive.paged_attention`. q (and gate): [T, Hq, D] with D a power of
    two; k_cache, v_cache: [num_blocks, block_size, Hkv, D] with the same strides;
    block_tables [B, max_blocks] int32; cu_seqlens_q [B + 1] and context_lens [B] int32.
    max_q_len bounds the grid (default: T, known without reading device memory)."""
    t, hq, d = q.shape
    _, cache_block, hkv, _ = k_cache.shape
    if hq % hkv or k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ValueError(
            f"q {list(q.shape)}, k_cache {list(k_cache.shape)}, v_cache "
            f"{list(v_cache.shape)}: expected caches [blocks, block_size, Hkv, D], Hq % Hkv == 0"
        )
    if k_cache.stride() != v_cache.stride() or q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need equal strides, unit stride on D")
    if gate is not None and (gate.shape != q.shape or gate.stride() != q.stride()):
        raise ValueError("gate must have q's shape and strides")
    g = hq // hkv
    max_q_len = max_q_len or t
    block_m = block_m or (1 if max_q_len == 1 else max(1, 64 // g))
    rows = max(16, triton.next_power_of_2(block_m * g))
    block_n = min(block_n, cache_block)
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_q_len, block_m), hkv, cu_seqlens_q.numel() - 1)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, gate if gate is not None else q, out, block_tables, cu_seqlens_q,
        context_lens, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), scale,
        G=g, D=d, ROWS=rows, BLOCK_M=block_m, BLOCK_N=block_n, CACHE_BLOCK=cache_block,
        HAS_GATE=gate is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
