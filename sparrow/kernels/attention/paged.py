"""Causal attention over a paged KV cache for prefill chunks and decode, varlen batches.

One program per (query block, KV head, sequence). GQA packing: the G = Hq / Hkv query heads
of a KV head are rows of one tile ([BLOCK_M query positions x G heads]), so each key/value
row loaded from the cache serves all of them. Keys are walked in BLOCK_N steps through the
block table with an online softmax (fp32); the sigmoid output gate is applied before the
store.

Decode (one query per sequence) has its own split-K schedule (flash-decoding): with 2 KV
heads a sequence would otherwise give the GPU 2 programs, so each (sequence, KV head) is
split into `num_splits` contiguous key ranges, each program writes an unnormalised partial
output with its running max and sum, and a second kernel merges them by log-sum-exp (and
applies the gate). The split count depends only on the batch shape and each split's range
on the context length read on the device, so the launch is the same for every step and can
be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparrow.kernels.launch import fast
from sparrow.kernels.pdl import launch_args, wait_for_previous

# Keys per step at least: tl.dot takes K >= 16 (p @ v reduces over the keys). A step may span
# several cache blocks (each key looks its block up), as with MSA's small test blocks.
MIN_KEYS = 16


@triton.jit
def _gated(b_o, b_g, DT: tl.constexpr):
    """o * sigmoid(gate) rounded as the layer's torch ops in DT round: o, the sigmoid and
    their product each in DT (fp32 in)."""
    b_s = tl.sigmoid(b_g.to(tl.float32)).to(DT).to(tl.float32)
    return b_o.to(DT).to(tl.float32) * b_s


@triton.jit
def _paged_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    gate_ptr,
    o_ptr,
    tables_ptr,
    cu_q_ptr,
    ctx_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_tb,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
):
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
        p_kv = (
            block.to(tl.int64)[:, None] * stride_kb
            + (n % CACHE_BLOCK)[:, None] * stride_kt
            + i_kvh * stride_kh
            + o_d[None, :]
        )
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
        b_g = tl.load(gate_ptr + p_o, mask=m_r[:, None], other=0.0)
        b_o = _gated(b_o, b_g, o_ptr.dtype.element_ty)
    tl.store(o_ptr + p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_r[:, None])


@dataclass(frozen=True)
class PagedTiles:
    """The prefill kernel's query positions per program (block_m: a tile of block_m * G
    rows), keys per step (block_n, at most a cache block but at least MIN_KEYS), num_warps."""

    block_m: int
    block_n: int
    num_warps: int

    @classmethod
    def for_shape(cls, max_q_len: int, group: int, head_dim: int) -> PagedTiles:
        """64 rows per tile (one query position when decoding). Wide heads take narrow key
        blocks and 8 warps: at D = 256 (64 rows) the 64-key, 4-warp tile spills 3.5 KB of
        registers, 16 keys with 8 warps 8 bytes (ptxas, sm_90, tests/kernels/sm90_cases.py)."""
        block_m = 1 if max_q_len == 1 else max(1, 64 // group)
        return cls(block_m, max(16, min(64, 4096 // head_dim)), 8 if head_dim >= 256 else 4)


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
    tiles: PagedTiles | None = None,
) -> torch.Tensor:
    """Same contract as `naive.paged_attention`. q (and gate): [T, Hq, D] with D a power of
    two; k_cache, v_cache: [num_blocks, block_size, Hkv, D] with the same strides;
    block_tables [B, max_blocks] int32; cu_seqlens_q [B + 1] and context_lens [B] int32.
    max_q_len bounds the grid (default: T, known without reading device memory). tiles:
    default `PagedTiles.for_shape`."""
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
    tiles = tiles or PagedTiles.for_shape(max_q_len, g, d)
    block_m = tiles.block_m
    rows = max(16, triton.next_power_of_2(block_m * g))
    block_n = max(MIN_KEYS, min(tiles.block_n, cache_block))
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_q_len, block_m), hkv, cu_seqlens_q.numel() - 1)
    fast(_paged_attn_kernel)[grid](
        q,
        k_cache,
        v_cache,
        gate if gate is not None else q,
        out,
        block_tables,
        cu_seqlens_q,
        context_lens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        scale,
        G=g,
        D=d,
        ROWS=rows,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CACHE_BLOCK=cache_block,
        HAS_GATE=gate is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
    )
    return out


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    acc_ptr,
    ml_ptr,
    tables_ptr,
    ctx_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_tb,
    scale,
    S: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    i_s, i_kvh, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + i_b)
    per_split = tl.cdiv(tl.cdiv(ctx, S), BLOCK_N) * BLOCK_N
    lo = i_s * per_split
    hi = tl.minimum(ctx, lo + per_split)
    o_r = tl.arange(0, ROWS)
    m_r = o_r < G
    head = i_kvh * G + o_r
    o_d = tl.arange(0, D)
    b_q = tl.load(
        q_ptr + i_b * stride_qb + head[:, None] * stride_qh + o_d[None, :],
        mask=m_r[:, None],
        other=0.0,
    )
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    b_acc = tl.zeros([ROWS, D], dtype=tl.float32)
    o_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + o_n
        m_n = n < hi
        block = tl.load(tables_ptr + i_b * stride_tb + n // CACHE_BLOCK, mask=m_n, other=0)
        p_kv = (
            block.to(tl.int64)[:, None] * stride_kb
            + (n % CACHE_BLOCK)[:, None] * stride_kt
            + i_kvh * stride_kh
            + o_d[None, :]
        )
        b_k = tl.load(k_ptr + p_kv, mask=m_n[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1))  # finite: every block has a key
        b_p = tl.exp(b_s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(b_p, axis=1)
        b_v = tl.load(v_ptr + p_kv, mask=m_n[:, None], other=0.0)
        b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
        m_i = m_new
    # partials laid out [B, Hq, S, ...]; an empty split leaves m = -inf, l = 0
    row = (i_b * (G * tl.num_programs(1)) + head) * S + i_s
    tl.store(acc_ptr + row[:, None] * D + o_d[None, :], b_acc, mask=m_r[:, None])
    tl.store(ml_ptr + row * 2, m_i, mask=m_r)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=m_r)


@triton.jit
def _decode_merge_kernel(
    acc_ptr,
    ml_ptr,
    gate_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    stride_gb,
    stride_gh,
    HQ,
    S: tl.constexpr,
    SP: tl.constexpr,
    D: tl.constexpr,
    HAS_GATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    i_h, i_b = tl.program_id(0), tl.program_id(1)
    o_s = tl.arange(0, SP)
    m_s = o_s < S
    row = (i_b * HQ + i_h) * S + o_s
    b_m = tl.load(ml_ptr + row * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(ml_ptr + row * 2 + 1, mask=m_s, other=0.0)
    m_all = tl.max(b_m, axis=0)
    w = tl.where(b_m == float("-inf"), 0.0, tl.exp(b_m - m_all))
    o_d = tl.arange(0, D)
    b_acc = tl.load(acc_ptr + row[:, None] * D + o_d[None, :], mask=m_s[:, None], other=0.0)
    b_o = tl.sum(b_acc * w[:, None], axis=0) / tl.sum(b_l * w, axis=0)
    p_o = i_b * stride_ob + i_h * stride_oh + o_d
    if HAS_GATE:
        p_g = gate_ptr + i_b * stride_gb + i_h * stride_gh + o_d
        b_o = _gated(b_o, tl.load(p_g), o_ptr.dtype.element_ty)
    tl.store(o_ptr + p_o, b_o.to(o_ptr.dtype.element_ty))


@dataclass(frozen=True)
class DecodeTiles:
    """The split-K decode's key ranges per (sequence, KV head) (splits) and keys per step
    (block_n, at most a cache block but at least MIN_KEYS)."""

    splits: int
    block_n: int

    @classmethod
    def for_shape(
        cls, batch: int, num_kv_heads: int, head_dim: int, target_programs: int = 256
    ) -> DecodeTiles:
        """Splits: enough programs to fill the GPU at small batch, one split once the batch
        alone fills it (a power of two, at most 64). Keys per step: 8192 / D, at most 64 (D
        = 256: 32 keys, no spills)."""
        want = max(1, target_programs // (batch * num_kv_heads))
        return cls(min(64, triton.next_power_of_2(want)), min(64, 8192 // head_dim))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """One query per sequence (decode), split-K. q (and gate): [B, Hq, D], gate with any
    strides but unit stride on D (a view of the q projection); the rest as in
    `paged_attention` (every context length >= 1). Returns [B, Hq, D] in q's dtype. tiles:
    default `DecodeTiles.for_shape`."""
    bsz, hq, d = q.shape
    _, cache_block, hkv, _ = k_cache.shape
    if hq % hkv or k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ValueError(f"q {list(q.shape)} does not fit caches {list(k_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches need unit stride on D, the caches equal strides")
    if gate is not None and (gate.shape != q.shape or gate.stride(-1) != 1):
        raise ValueError("gate must have q's shape and unit stride on D")
    g = hq // hkv
    tiles = tiles or DecodeTiles.for_shape(bsz, hkv, d)
    splits = tiles.splits
    acc = torch.empty(bsz, hq, splits, d, device=q.device, dtype=torch.float32)
    ml = torch.empty(bsz, hq, splits, 2, device=q.device, dtype=torch.float32)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (splits, hkv, bsz)
    fast(_decode_split_kernel)[grid](
        q,
        k_cache,
        v_cache,
        acc,
        ml,
        block_tables,
        context_lens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        scale,
        S=splits,
        G=g,
        D=d,
        ROWS=max(16, triton.next_power_of_2(g)),
        BLOCK_N=max(MIN_KEYS, min(tiles.block_n, cache_block)),
        CACHE_BLOCK=cache_block,
        PRECISION=precision,
        **launch_args(acc, grid),
    )
    out = torch.empty(bsz, hq, d, device=q.device, dtype=q.dtype)
    gate_strides = (gate.stride(0), gate.stride(1)) if gate is not None else (0, 0)
    fast(_decode_merge_kernel)[(hq, bsz)](
        acc,
        ml,
        gate if gate is not None else q,
        out,
        out.stride(0),
        out.stride(1),
        *gate_strides,
        hq,
        S=splits,
        SP=max(2, splits),
        D=d,
        HAS_GATE=gate is not None,
        **launch_args(out, (hq, bsz)),
    )
    return out
