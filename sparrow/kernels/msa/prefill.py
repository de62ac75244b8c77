"""MSA sparse attention for prompts, KV-block major: each selected block's K/V is read for
all the queries that chose it, not once per query.

`sparse_prefill_attention` has the contract of `naive.sparse_attention`. Per chunk of
q_chunk queries:

1. Block lists (torch ops, no host reads): every valid (query t, KV group h, slot) of
   `blocks` [T, Hkv, K] is a pair keyed by its (page, h) row, row = page * Hkv + h. A stable
   sort by row gives CSR: `pairs` (the flat pair ids (t * Hkv + h) * K + slot, grouped by
   row) and `row_ptr` [pages * Hkv + 1] (searchsorted on the sorted rows). Each row is cut
   into tiles of `tile` pairs; `tile_start` lists the tiles' first pairs (a scatter at the
   cumsum of the tile starts) and `n_tiles` [1] counts them on the device.
2. `_block_major_kernel`: persistent programs walk the tiles (the count read on the
   device). A tile's pairs share one page and group: in sub-tiles of block_m pairs x G
   query heads (the rows of one register tile), it runs an online softmax over the block's
   keys in block_n steps with the token-level causal mask (key position <= query position,
   which also hides a tail block's unwritten slots) and writes the block's normalised
   partial output and log-sum-exp per (pair, head): o_part [Tc, Hkv, K, G, D] in q's dtype
   and lse [Tc, Hkv, K, G] fp32 (-inf for unused slots). When a block is one key step (the
   real shapes), its K and V are read once per tile, before the tile's pairs.
3. `_merge_kernel`: one program per (64 / G queries, KV group) merges the K partials of
   their G heads by log-sum-exp, slot by slot.

Memory per chunk: o_part Tc x Hq x K x D elements (in bf16 at Hq 64, K 16, D 128: 256 KiB
per query, 2 GiB at the default 8,192 queries, whatever the context length), lse Tc x Hq x
K x 4 bytes, the lists 3 x Tc x Hkv x K int64 and row_ptr (pages x Hkv + 1) int64. The
partials' traffic (written once, read once by the merge) is the kernel's largest: bf16
halves it against fp32 at a rounding well under the output's own. Longer chunks give each
(block, group) row more pairs to serve per K/V read: at 128K on the H200 chunks of 1,024 /
4,096 / 8,192 queries take 107.4 / 67.8 / 62.6 ms.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparrow.kernels.launch import fast

Q_CHUNK = 8192  # queries per block-list build and partial buffer


@triton.jit
def _block_major_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    pos_ptr,
    blocks_ptr,
    pairs_ptr,
    rows_ptr,
    row_ptr_ptr,
    tile_start_ptr,
    n_tiles_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    scale,
    HKV: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n_tiles = tl.load(n_tiles_ptr)
    o_r = tl.arange(0, ROWS)
    o_d = tl.arange(0, D)
    o_n = tl.arange(0, BLOCK_N)
    g = o_r % G
    for i_tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        start = tl.load(tile_start_ptr + i_tile)
        row = tl.load(rows_ptr + start)
        end = tl.minimum(tl.load(row_ptr_ptr + row + 1), start + TILE)
        page, i_h = row // HKV, row % HKV
        p_kv = page * stride_kb + i_h * stride_kh + o_n[:, None] * stride_kt + o_d[None, :]
        if BLOCK_N == BS:  # the whole block in one step: read once for all the tile's pairs
            k_block = tl.load(k_ptr + p_kv)
            v_block = tl.load(v_ptr + p_kv)
        for p0 in range(start, end, BLOCK_M):
            j = p0 + o_r // G
            m_r = (o_r < BLOCK_M * G) & (j < end)
            pair = tl.load(pairs_ptr + j, mask=m_r, other=0)
            t = pair // (HKV * K)
            k0 = tl.load(blocks_ptr + pair, mask=m_r, other=0) * BS  # the block's 1st position
            pos = tl.load(pos_ptr + t, mask=m_r, other=-1)
            p_q = q_ptr + t[:, None] * stride_qt + (i_h * G + g)[:, None] * stride_qh + o_d[None, :]
            b_q = tl.load(p_q, mask=m_r[:, None], other=0.0)
            m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([ROWS], dtype=tl.float32)
            b_acc = tl.zeros([ROWS, D], dtype=tl.float32)
            for n0 in tl.static_range(0, BS, BLOCK_N):
                if BLOCK_N == BS:
                    b_k = k_block
                else:
                    b_k = tl.load(k_ptr + p_kv + n0 * stride_kt)
                b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale
                keep = (k0[:, None] + n0 + o_n[None, :]) <= pos[:, None]
                b_s = tl.where(keep, b_s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no causal key yet
                b_p = tl.exp(b_s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(b_p, axis=1)
                if BLOCK_N == BS:
                    b_v = v_block
                else:
                    b_v = tl.load(v_ptr + p_kv + n0 * stride_kt)
                b_acc = b_acc * alpha[:, None] + tl.dot(
                    b_p.to(b_v.dtype), b_v, input_precision=PRECISION
                )
                m_i = m_new
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no causal key: an unused row
            b_o = b_acc / l_safe[:, None]
            b_lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
            o_part = pair.to(tl.int64) * G + g
            tl.store(
                o_ptr + o_part[:, None] * D + o_d[None, :],
                b_o.to(o_ptr.dtype.element_ty),
                mask=m_r[:, None],
            )
            tl.store(lse_ptr + o_part, b_lse, mask=m_r)


@triton.jit(do_not_specialize=["T"])  # see kernels/launch.py
def _merge_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    T,
    stride_ot,
    stride_oh,
    HKV: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
):
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    o_r = tl.arange(0, ROWS)
    t = i_m * BLOCK_T + o_r // G
    m_r = (o_r < BLOCK_T * G) & (t < T)
    o_d = tl.arange(0, D)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    b_acc = tl.zeros([ROWS, D], dtype=tl.float32)
    for slot in range(K):
        row = ((t * HKV + i_h) * K + slot).to(tl.int64) * G + o_r % G
        b_lse = tl.load(lse_ptr + row, mask=m_r, other=float("-inf"))
        m_new = tl.maximum(m_i, b_lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(b_lse == float("-inf"), 0.0, tl.exp(b_lse - m_safe))
        alpha = tl.exp(m_i - m_safe)
        b_o = tl.load(
            o_ptr + row[:, None] * D + o_d[None, :],
            mask=(b_lse > float("-inf"))[:, None],
            other=0.0,
        ).to(tl.float32)
        b_acc = b_acc * alpha[:, None] + b_o * w[:, None]
        l_i = l_i * alpha + w
        m_i = m_new
    b_out = b_acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    head = i_h * G + o_r % G
    p_out = out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + o_d[None, :]
    tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=m_r[:, None])


@dataclass(frozen=True)
class BlockMajorTiles:
    """Pairs per work item (tile), pairs per register tile (block_m: block_m * G rows), keys
    per step (block_n, at most a block), programs of the persistent grid (None: 8 per SM),
    num_warps, num_stages."""

    tile: int
    block_m: int
    block_n: int
    programs: int | None = None
    num_warps: int = 4
    num_stages: int = 1

    @classmethod
    def for_shape(cls, group: int, head_dim: int) -> BlockMajorTiles:
        """64 rows per register tile, 64 pairs per work item, 16384 / D keys per step (a
        whole 128-token block at D = 128), 4 warps, no pipelining: 255 registers, no spills,
        80 KB shared at the real shapes (ptxas, sm_90, tests/kernels/sm90_cases.py). On the
        H200 at 128K (bf16 partials, K/V read once per tile): 4 warps 91.9 ms, 8 warps 127.5;
        128 rows per register tile 115.3; 2 stages, 256-pair tiles or 2 programs per SM no
        faster."""
        block_m = max(1, 64 // group)
        return cls(max(64, block_m), block_m, max(16, min(128, 16384 // head_dim)))


@dataclass(frozen=True)
class BlockLists:
    """The CSR of one chunk's (query, group, slot) pairs by (page, group) row."""

    pairs: torch.Tensor  # [P] int64 flat pair ids (t * Hkv + h) * K + slot, grouped by row
    rows: torch.Tensor  # [P] int64 the row of each listed pair (pages * Hkv: unused slot)
    row_ptr: torch.Tensor  # [pages * Hkv + 1] int64 first listed pair of each row
    tile_start: torch.Tensor  # [max_tiles + 1] int64 first pair of each tile
    n_tiles: torch.Tensor  # [1] int64 tiles in use
    max_tiles: int  # host bound on n_tiles


def block_lists(
    tables: torch.Tensor, blocks: torch.Tensor, num_pages: int, tile: int
) -> BlockLists:
    """tables: [T, W] each query's block table; blocks: [T, Hkv, K] logical block ids, -1
    unused. Torch ops only, no host reads."""
    t, hkv, k = blocks.shape
    n_rows, n = num_pages * hkv, blocks.numel()
    pages = tables.gather(1, blocks.clamp(min=0).flatten(1).long()).long().view(t, hkv, k)
    heads = torch.arange(hkv, device=blocks.device)[:, None]
    key = torch.where(blocks >= 0, pages * hkv + heads, n_rows).flatten()
    rows, pairs = key.sort(stable=True)
    row_ptr = torch.searchsorted(rows, torch.arange(n_rows + 1, device=rows.device))
    idx = torch.arange(n, device=rows.device)
    first = ((idx - row_ptr[rows]) % tile == 0) & (rows < n_rows)
    max_tiles = triton.cdiv(n, tile) + min(n, n_rows)
    slot = torch.where(first, first.cumsum(0) - 1, max_tiles)
    tile_start = torch.zeros(max_tiles + 1, dtype=torch.int64, device=rows.device)
    tile_start.scatter_(0, slot, idx)  # non-starts all land in the spare last slot
    return BlockLists(pairs, rows, row_ptr, tile_start, first.sum(0, keepdim=True), max_tiles)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(tiles: BlockMajorTiles, device: torch.device, max_tiles: int) -> int:
    """The persistent grid: tiles.programs, else 8 per SM (8 under the interpreter)."""
    if tiles.programs is not None:
        want = tiles.programs
    elif device.type == "cuda":
        want = 8 * _sm_count(device.index if device.index is not None else 0)
    else:
        want = 8
    return max(1, min(want, max_tiles))


def _attend_chunk(q, k_cache, v_cache, tables, positions, blocks, scale, tiles, out):
    """One chunk of queries into out (a view of the output rows)."""
    t, hq, d = q.shape
    num_pages, bs, hkv, _ = k_cache.shape
    g, k = hq // hkv, blocks.shape[-1]
    lists = block_lists(tables, blocks, num_pages, tiles.tile)
    o_part = torch.empty(t, hkv, k, g, d, device=q.device, dtype=q.dtype)
    lse = torch.full((t, hkv, k, g), -torch.inf, device=q.device, dtype=torch.float32)
    grid = (_programs(tiles, q.device, lists.max_tiles),)
    fast(_block_major_kernel)[grid](
        q,
        k_cache,
        v_cache,
        o_part,
        lse,
        positions,
        blocks,
        lists.pairs,
        lists.rows,
        lists.row_ptr,
        lists.tile_start,
        lists.n_tiles,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale,
        HKV=hkv,
        K=k,
        G=g,
        D=d,
        BS=bs,
        ROWS=max(16, triton.next_power_of_2(tiles.block_m * g)),
        BLOCK_M=tiles.block_m,
        TILE=tiles.tile,
        BLOCK_N=min(tiles.block_n, bs),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    block_t = max(1, 64 // g)
    fast(_merge_kernel)[(triton.cdiv(t, block_t), hkv)](
        o_part,
        lse,
        out,
        t,
        out.stride(0),
        out.stride(1),
        HKV=hkv,
        K=k,
        G=g,
        ROWS=max(16, triton.next_power_of_2(block_t * g)),
        BLOCK_T=block_t,
        D=d,
    )
    return out


def sparse_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
    q_chunk: int = Q_CHUNK,
    tiles: BlockMajorTiles | None = None,
) -> torch.Tensor:
    """`naive.sparse_attention`, KV-block major. q: [T, Hq, D] (D a power of two);
    k_cache, v_cache: [pages, bs, Hkv, D] with equal strides, unit stride on D; tables:
    [T, W] each query's block table (`naive.token_tables`); positions: [T]; blocks: [T, Hkv,
    K] logical block ids, -1 unused, no id twice in a row. Returns [T, Hq, D] in q's dtype.
    No host reads."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv or k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ValueError(f"q {list(q.shape)} does not fit caches {list(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need equal strides, q and them unit stride on D")
    if blocks.shape[:2] != (t, hkv) or tables.shape[0] != t or positions.shape != (t,):
        raise ValueError(
            f"blocks {list(blocks.shape)}, tables {list(tables.shape)}, positions "
            f"{list(positions.shape)} do not fit q {list(q.shape)}"
        )
    tiles = tiles or BlockMajorTiles.for_shape(hq // hkv, d)
    out = torch.empty_like(q)
    for c0 in range(0, t, q_chunk):
        rows = slice(c0, c0 + q_chunk)
        _attend_chunk(
            q[rows],
            k_cache,
            v_cache,
            tables[rows],
            positions[rows],
            blocks[rows].contiguous(),
            scale,
            tiles,
            out[rows],
        )
    return out
