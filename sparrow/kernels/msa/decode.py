"""MSA sparse attention for decode through the engine's GQA paged decode kernel, unchanged.

`sparse_decode_attention` has the contract of `naive.sparse_attention`. Each (query t, KV
group h) becomes one sequence of the split-K decode (`attention.paged.paged_decode_attention`)
with one KV head and G query heads:

- q [T, Hq, D] reads as [T * Hkv, G, D] (a view);
- the cache [pages, bs, Hkv, D] reads as per-head pages: `as_strided` with page step
  stride(2) (D) and token step stride(1) (Hkv * D) turns page p, head h into the virtual page
  p * (stride(0) / stride(2)) + h of a [virtual pages, bs, 1, D] view of the same memory;
- the (t, h) row of the page table lists the virtual pages of the selected blocks in
  ascending block order (sorted with torch ops), so the query's own block, possibly
  partial, comes last; its context length is bs per selected block, less the own block's
  slots after the query's position.

Softmax does not depend on the order of the keys, and every selected block before the own
block is full, so this equals attention over the selected blocks with the token-level causal
mask. No host reads: the launch shapes depend on T, Hkv and K only (capturable). The tables
take T x Hkv x K int32 (256 bytes per query at the real shapes).
"""

from __future__ import annotations

import torch

from sparrow.kernels.attention.paged import DecodeTiles, paged_decode_attention

_UNUSED = 1 << 40  # sorts after every block id


def per_head_pages(cache: torch.Tensor) -> torch.Tensor:
    """[pages, bs, Hkv, D] -> [(pages - 1) * (stride(0) / stride(2)) + Hkv, bs, 1, D], the
    same memory read one head at a time (module docstring)."""
    pages, bs, hkv, d = cache.shape
    s0, s1, s2, s3 = cache.stride()
    if s3 != 1 or s2 < d or s0 % s2:
        raise ValueError(f"cache strides {cache.stride()}: expected unit stride on D and a "
                         "page stride that is a multiple of the head stride")  # fmt: skip
    if pages * (s0 // s2) >= 2**31:
        raise ValueError(f"{pages} pages of {s0 // s2} heads overflow int32 page ids")
    n_virtual = (pages - 1) * (s0 // s2) + hkv
    return cache.as_strided((n_virtual, bs, 1, d), (s2, s1, s2, 1), cache.storage_offset())


def per_head_tables(tables: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
                    cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """tables: [T, W] each query's block table; positions: [T]; blocks: [T, Hkv, K] logical
    ids <= position // bs, -1 unused. Returns the virtual page tables [T * Hkv, K] int32 of
    `per_head_pages(cache)` and the context lengths [T * Hkv] int32."""
    t, hkv, k = blocks.shape
    bs = cache.shape[1]
    heads_per_page = cache.stride(0) // cache.stride(2)
    ids = blocks.long().masked_fill(blocks < 0, _UNUSED).sort(-1).values
    valid = ids != _UNUSED
    n_valid = valid.sum(-1)  # [T, Hkv]
    logical = ids.masked_fill(~valid, 0)
    pages = tables.gather(1, logical.flatten(1)).long().view(t, hkv, k)
    heads = torch.arange(hkv, device=blocks.device)[:, None]
    virtual = pages * heads_per_page + heads
    last = logical.gather(-1, (n_valid - 1).clamp(min=0)[..., None])[..., 0]
    pos = positions.long()[:, None]
    tail = torch.where(last == pos // bs, bs - 1 - pos % bs, 0)
    ctx = n_valid * bs - tail
    return virtual.view(t * hkv, k).to(torch.int32), ctx.view(t * hkv).to(torch.int32)


def sparse_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            tables: torch.Tensor, positions: torch.Tensor,
                            blocks: torch.Tensor, scale: float,
                            tiles: DecodeTiles | None = None) -> torch.Tensor:  # fmt: skip
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
        raise ValueError(f"blocks {list(blocks.shape)}, tables {list(tables.shape)}, positions "
                         f"{list(positions.shape)} do not fit q {list(q.shape)}")  # fmt: skip
    virtual, ctx = per_head_tables(tables, positions, blocks, k_cache)
    out = paged_decode_attention(q.reshape(t * hkv, hq // hkv, d), per_head_pages(k_cache),
                                 per_head_pages(v_cache), virtual, ctx, scale,
                                 tiles=tiles)  # fmt: skip
    return out.view(t, hq, d)
