"""MSA sparse attention for decode through the engine's GQA paged decode kernel, unchanged.

`sparse_decode_attention` has the contract of `naive.sparse_attention`. Each (query t, KV
group h) becomes one sequence of the split-K decode (`attention.paged.paged_decode_attention`)
with one KV head and G query heads:

- q [T, Hq, D] reads as [T * Hkv, G, D] (a view);
- the cache [pages, bs, Hkv, D] reads as per-head pages: `as_strided` with page step
  stride(2) (D) and token step stride(1) (Hkv * D) turns page p, head h into the virtual page
  p * (stride(0) / stride(2)) + h of a [virtual pages, bs, 1, D] view of the same memory;
- the (t, h) row of the page table lists the virtual pages of the selected blocks in
  ascending block order (sorted by one small kernel, `per_head_tables`), so the query's own
  block, possibly partial, comes last; its context length is bs per selected block, less
  the own block's slots after the query's position.

Softmax does not depend on the order of the keys, and every selected block before the own
block is full, so this equals attention over the selected blocks with the token-level causal
mask. No host reads: the launch shapes depend on T, Hkv and K only (capturable). The tables
take T x Hkv x K int32 (256 bytes per query at the real shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.attention.paged import DecodeTiles, paged_decode_attention
from sparrow.kernels.launch import fast

_UNUSED = tl.constexpr(1 << 40)  # sorts after every block id


def per_head_pages(cache: torch.Tensor) -> torch.Tensor:
    """[pages, bs, Hkv, D] -> [(pages - 1) * (stride(0) / stride(2)) + Hkv, bs, 1, D], the
    same memory read one head at a time (module docstring)."""
    pages, bs, hkv, d = cache.shape
    s0, s1, s2, s3 = cache.stride()
    if s3 != 1 or s2 < d or s0 % s2:
        raise ValueError(
            f"cache strides {cache.stride()}: expected unit stride on D and a "
            "page stride that is a multiple of the head stride"
        )
    if pages * (s0 // s2) >= 2**31:
        raise ValueError(f"{pages} pages of {s0 // s2} heads overflow int32 page ids")
    n_virtual = (pages - 1) * (s0 // s2) + hkv
    return cache.as_strided((n_virtual, bs, 1, d), (s2, s1, s2, 1), cache.storage_offset())


@triton.jit(do_not_specialize=["n_rows"])  # see kernels/launch.py
def _head_tables_kernel(
    blocks_ptr,
    tables_ptr,
    pos_ptr,
    virtual_ptr,
    ctx_ptr,
    n_rows,
    stride_tt,
    heads_per_page,
    HKV: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # a row is (query t, KV group h)
    m_r = rows < n_rows
    t, h = rows // HKV, rows % HKV
    o_k = tl.arange(0, K_PAD)
    m_k = m_r[:, None] & (o_k < K)[None, :]
    ids = tl.load(blocks_ptr + rows[:, None] * K + o_k[None, :], mask=m_k, other=-1)
    ids = tl.sort(tl.where(ids < 0, _UNUSED, ids).to(tl.int64), dim=1)
    valid = ids != _UNUSED
    logical = tl.where(valid, ids, 0)
    pages = tl.load(
        tables_ptr + t[:, None].to(tl.int64) * stride_tt + logical, mask=m_r[:, None], other=0
    ).to(tl.int64)
    tl.store(
        virtual_ptr + rows[:, None] * K + o_k[None, :],
        (pages * heads_per_page + h[:, None]).to(tl.int32),
        mask=m_k,
    )
    last = tl.max(tl.where(valid, ids, -1), axis=1)
    pos = tl.load(pos_ptr + t, mask=m_r, other=0).to(tl.int64)
    tail = tl.where(last == pos // BS, BS - 1 - pos % BS, 0)
    n_valid = tl.sum(valid.to(tl.int32), axis=1)
    tl.store(ctx_ptr + rows, (n_valid * BS - tail).to(tl.int32), mask=m_r)


def per_head_tables(
    tables: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """tables: [T, W] each query's block table; positions: [T]; blocks: [T, Hkv, K] logical
    ids <= position // bs, -1 unused. Returns the virtual page tables
    [T * Hkv, K] int32 of `per_head_pages(cache)` (each row's valid blocks in ascending
    order, then filler) and the context lengths [T * Hkv] int32. One launch."""
    t, hkv, k = blocks.shape
    virtual = torch.empty(t * hkv, k, device=blocks.device, dtype=torch.int32)
    ctx = torch.empty(t * hkv, device=blocks.device, dtype=torch.int32)
    rows = 16
    fast(_head_tables_kernel)[(triton.cdiv(t * hkv, rows),)](
        blocks.contiguous(),
        tables,
        positions,
        virtual,
        ctx,
        t * hkv,
        tables.stride(0),
        cache.stride(0) // cache.stride(2),
        HKV=hkv,
        K=k,
        K_PAD=triton.next_power_of_2(k),
        BS=cache.shape[1],
        ROWS=rows,
    )
    return virtual, ctx


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """`naive.sparse_attention` through `paged_decode_attention`. q: [T, Hq, D] (D a power
    of two); k_cache, v_cache: [pages, bs, Hkv, D] with equal strides; tables: [T, W] each
    query's block table; positions: [T]; blocks: [T, Hkv, K] (each row holds the ids of
    blocks at or before the query's, as selection gives, -1 unused, at least one valid).
    Returns [T, Hq, D] in q's dtype. tiles: the decode kernel's, default for T * Hkv
    sequences of one KV head."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"q {list(q.shape)} does not fit caches {list(k_cache.shape)}")
    if blocks.shape[:2] != (t, hkv) or tables.shape[0] != t or positions.shape != (t,):
        raise ValueError(
            f"blocks {list(blocks.shape)}, tables {list(tables.shape)}, positions "
            f"{list(positions.shape)} do not fit q {list(q.shape)}"
        )
    virtual, ctx = per_head_tables(tables, positions, blocks, k_cache)
    out = paged_decode_attention(
        q.reshape(t * hkv, hq // hkv, d),
        per_head_pages(k_cache),
        per_head_pages(v_cache),
        virtual,
        ctx,
        scale,
        tiles=tiles,
    )
    return out.view(t, hq, d)
