"""MSA block selection: index scores per key block in Triton, then the top-k.

`select_blocks` (a prompt or prompt chunk of one sequence) and `decode_select_blocks` (one
query per sequence, the whole batch in one launch, no host reads) have the contracts of their
namesakes in `naive.py` and return the same int64 block ids [Q, Hi, topk], best first, -1
where fewer than topk blocks hold a causal key.

One kernel computes both. A program takes a tile of BLOCK_M queries x Hi index heads as the
rows of one register tile (the index key is shared by the heads, so each key row loaded
serves all of them) and walks NB consecutive key blocks of the queries' sequence through its
block table, BLOCK_N keys per step: score = max over the block's causal keys of iq . ik (fp32,
no scale), +inf for the query's own block and the `local_blocks - 1` before it, written to a
[Q, Hi, W] fp32 buffer (W = max(blocks, topk)); blocks after a tile's last position are
never read and keep the buffer's -inf. torch.topk then picks the blocks.

fp8 index keys (`naive.quantize_index_keys`, SCALED): the tile loads the e4m3 codes,
converts them to the query dtype in registers, and multiplies each key's column of the dot
by its fp32 scale before the block max (the scale factors out of iq . ik).

Prompt tiles share one block table row (stride 0); decode tiles are one query each with its
own row. The buffer is bounded by chunking queries: SCORE_BYTES (128 MiB) per chunk, that is
8,192 queries per chunk at 128K context (W = 1,024) and 1,024 at 1M (W = 8,192). Decode needs
B x Hi x W x 4 bytes: 8 MiB for 64 sequences at 1M.

Decode (`decode_select_blocks`, one query per sequence) takes either that kernel (one query
per tile) or `_decode_scores_kernel`, as `DecodeSelectTiles` says (DECODE_TILES for keys in
the query dtype, DECODE_TILES_FP8 for fp8 codes). The decode kernel puts the keys on the M
side of the dot ([BLOCK_N keys, Di] x [Di, 16 head rows]: the key tile goes from shared
memory straight into the tensor cores), can load its NB page ids as one vector up front
(sm_90 TTGIR: with a page id loaded per block the pipelined loop waits for every copy, one
key block in flight; preloaded, two at 3 stages), writes every score of its blocks (-inf
past the query's block: no memset of the buffer), and for fp8 codes can quantise the query
per (sequence, head) to e4m3 (fp8 x fp8 dot) or to fp16 (codes converted exactly) with an
fp32 scale (the row's largest |element| / 448) that multiplies the block max (max(s x) =
s max(x) for s > 0), after each key's own scale. Its block loop is a `tl.range` with its own
stage count, so the pipeliner prefetches the key scales too (a plain `range` leaves them a
synchronous load per block). The top-k is torch.topk or `top_blocks_triton` (k rounds of
max over (score, block) packed in an int64, ties to the lower block: a program per row,
or per chunk of a row and then per row).
The options are timed on the H200 by a sweep script (1M context, batch 1 and 8).

`decode_select.py` fuses the top-k into the scoring launch for decode; this unfused form is
faster on the H200 (bench/msa.py) and is what `kernels.decode_select_blocks` takes.

Ties: torch.topk orders equal scores in no documented way, the reference uses the same
call; the local blocks all score +inf, so which of them comes first is not part of the
contract (compare selections as sets).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sparrow.kernels.launch import fast

SCORE_BYTES = 1 << 27  # score buffer per prompt chunk
KV_BLOCKS = 16  # key blocks per program
DOT_DTYPES = ("query", "fp16", "fp8")  # what the decode kernel's dot takes (DecodeSelectTiles)


@triton.jit(do_not_specialize=["T"])  # see kernels/launch.py
def _block_scores_kernel(
    iq_ptr,
    ik_ptr,
    scale_ptr,
    tables_ptr,
    pos_ptr,
    out_ptr,
    T,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_sb,
    stride_tq,
    stride_ot,
    stride_oh,
    HI: tl.constexpr,
    DI: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
    LOCAL: tl.constexpr,
    SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_m, i_j = tl.program_id(0), tl.program_id(1)
    o_r = tl.arange(0, ROWS)
    i_q = i_m * BLOCK_M + o_r // HI
    head = o_r % HI
    m_r = (o_r < BLOCK_M * HI) & (i_q < T)
    pos = tl.load(pos_ptr + i_q, mask=m_r, other=0)
    q_block = pos // BS
    j_lo = i_j * NB
    j_hi = tl.minimum(j_lo + NB, tl.max(tl.where(m_r, q_block, -1)) + 1)
    o_d = tl.arange(0, DI)
    p_q = iq_ptr + i_q[:, None] * stride_qt + head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None], other=0.0)
    p_table = tables_ptr + (i_m * BLOCK_M).to(tl.int64) * stride_tq
    o_n = tl.arange(0, BLOCK_N)
    for j in range(j_lo, j_hi):
        page = tl.load(p_table + j).to(tl.int64)
        b_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        for n0 in tl.static_range(0, BS, BLOCK_N):
            p_k = ik_ptr + page * stride_kb + (n0 + o_n)[:, None] * stride_kt + o_d[None, :]
            b_k = tl.load(p_k).to(b_q.dtype)  # fp8 codes: converted here
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # [ROWS, BLOCK_N]
            if SCALED:
                b_s *= tl.load(scale_ptr + page * stride_sb + n0 + o_n)[None, :]
            causal = (j * BS + n0 + o_n)[None, :] <= pos[:, None]
            b_max = tl.maximum(b_max, tl.max(tl.where(causal, b_s, float("-inf")), axis=1))
        local = (q_block - j >= 0) & (q_block - j < LOCAL)
        b_max = tl.where(local, float("inf"), b_max)
        tl.store(out_ptr + i_q * stride_ot + head * stride_oh + j, b_max, mask=m_r)


@triton.jit
def _decode_scores_kernel(
    iq_ptr,
    ik_ptr,
    scale_ptr,
    tables_ptr,
    pos_ptr,
    out_ptr,
    width,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_sb,
    stride_tb,
    stride_ob,
    stride_oh,
    HI: tl.constexpr,
    ROWS: tl.constexpr,
    DI: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
    NB_P2: tl.constexpr,
    LOCAL: tl.constexpr,
    SCALED: tl.constexpr,
    QUANT: tl.constexpr,
    PRELOAD: tl.constexpr,
    PRECISION: tl.constexpr,
    STAGES: tl.constexpr,
):
    i_b, i_j = tl.program_id(0), tl.program_id(1)
    pos = tl.load(pos_ptr + i_b)
    q_block = pos // BS
    o_h = tl.arange(0, ROWS)
    m_h = o_h < HI
    o_d = tl.arange(0, DI)
    p_q = iq_ptr + i_b * stride_qb + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_h[:, None], other=0.0)
    if QUANT == 0:
        b_qt = tl.trans(b_q)  # [DI, ROWS]
    else:  # per head row: b_q ~ codes * q_scale, |codes| <= 448 (the largest e4m3)
        b_qf = b_q.to(tl.float32)
        b_amax = tl.max(tl.abs(b_qf), axis=1)
        q_scale = tl.where(b_amax > 0, b_amax / 448.0, 1.0)
        b_c = tl.clamp(tl.div_rn(b_qf, q_scale[:, None]), -448.0, 448.0)
        if QUANT == 1:
            b_qt = tl.trans(b_c.to(tl.float16))
        else:
            b_qt = tl.trans(b_c.to(tl.float8e4nv))
    j_lo = i_j * NB
    j_end = tl.minimum(j_lo + NB, width)
    j_hi = tl.minimum(j_end, q_block + 1)
    p_table = tables_ptr + i_b.to(tl.int64) * stride_tb
    o_p = tl.arange(0, NB_P2)
    if PRELOAD:  # the program's page ids as one vector; each step picks its own
        b_pages = tl.load(p_table + j_lo + o_p, mask=j_lo + o_p < j_hi, other=0)
    p_out = out_ptr + i_b * stride_ob + o_h * stride_oh
    o_n = tl.arange(0, BLOCK_N)
    # a loop with its own stage count: the pipeliner also prefetches the key scales
    for j in tl.range(j_lo, j_hi, num_stages=STAGES):
        if PRELOAD:
            page = tl.sum(tl.where(o_p == j - j_lo, b_pages, 0)).to(tl.int64)
        else:
            page = tl.load(p_table + j).to(tl.int64)
        b_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        for n0 in tl.static_range(0, BS, BLOCK_N):
            p_k = ik_ptr + page * stride_kb + (n0 + o_n)[:, None] * stride_kt + o_d[None, :]
            b_k = tl.load(p_k).to(b_qt.dtype)  # fp8 x fp8: no conversion
            b_s = tl.dot(b_k, b_qt, input_precision=PRECISION)  # [BLOCK_N, ROWS]
            if SCALED:
                b_s *= tl.load(scale_ptr + page * stride_sb + n0 + o_n)[:, None]
            causal = (j * BS + n0 + o_n)[:, None] <= pos
            b_max = tl.maximum(b_max, tl.max(tl.where(causal, b_s, float("-inf")), axis=0))
        if QUANT != 0:
            b_max *= q_scale
        b_max = tl.where(q_block - j < LOCAL, float("inf"), b_max)
        tl.store(p_out + j, b_max, mask=m_h)
    o_j = j_lo + o_p  # the program's blocks past the query's own: -inf
    m_past = m_h[:, None] & ((o_j > q_block) & (o_j < j_end))[None, :]
    b_inf = tl.full([ROWS, NB_P2], float("-inf"), dtype=tl.float32)
    tl.store(p_out[:, None] + o_j[None, :], b_inf, mask=m_past)


@triton.jit
def _top_id(top, NEG_INF_KEY: tl.constexpr):
    """The block id a packed top-k key holds, -1 where its score is -inf."""
    block = 2**31 - 1 - (top - ((top >> 32) << 32))
    return tl.where((top >> 32) > NEG_INF_KEY, block, -1)


@triton.jit
def _chunk_top_kernel(
    scores_ptr,
    out_ptr,
    width,
    stride_row,
    n_chunks,
    TOPK: tl.constexpr,
    CHUNK: tl.constexpr,
    FINAL: tl.constexpr,
    NEG_INF_KEY: tl.constexpr,
):
    """Program (row, chunk): the top TOPK of CHUNK scores of a row, by k rounds of max over
    packed keys (the score's order bits over 2^31 - 1 - id: ties go to the lower id). FINAL
    (one chunk a row): their ids -> out [row, TOPK], -1 where -inf; else the keys -> out
    [row, chunk, TOPK] for `_merge_top_kernel`."""
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    o_w = i_c * CHUNK + tl.arange(0, CHUNK)
    p_s = scores_ptr + i_r.to(tl.int64) * stride_row + o_w
    b_s = tl.load(p_s, mask=o_w < width, other=float("-inf"))
    bits = b_s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # ordered as the scores
    b_p = (key.to(tl.int64) << 32) | (2**31 - 1 - o_w).to(tl.int64)
    p_out = out_ptr + (i_r.to(tl.int64) * n_chunks + i_c) * TOPK
    for r in tl.static_range(TOPK):
        top = tl.max(b_p, axis=0)
        if FINAL:
            tl.store(p_out + r, _top_id(top, NEG_INF_KEY))
        else:
            tl.store(p_out + r, top)
        b_p = tl.where(b_p == top, -(2**63), b_p)


@triton.jit
def _merge_top_kernel(
    cand_ptr,
    out_ptr,
    n_cand,
    TOPK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NEG_INF_KEY: tl.constexpr,
):
    """One row's candidates (packed keys) per program -> its top TOPK ids, -1 where -inf."""
    i_r = tl.program_id(0)
    o_c = tl.arange(0, BLOCK_C)
    b_p = tl.load(cand_ptr + i_r.to(tl.int64) * n_cand + o_c, mask=o_c < n_cand, other=-(2**63))
    for r in tl.static_range(TOPK):
        top = tl.max(b_p, axis=0)
        tl.store(out_ptr + i_r * TOPK + r, _top_id(top, NEG_INF_KEY))
        b_p = tl.where(b_p == top, -(2**63), b_p)


def block_scores(
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    width: int,
    local_blocks: int,
    block_m: int,
    kv_blocks: int = KV_BLOCKS,
    ik_scale: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """iq: [Q, Hi, Di]; ik_cache: [pages, bs, Di] (fp8 codes if ik_scale [pages, bs] is
    given); tables: [W'] one sequence's pages (every query reads it) or [Q, W'] one row per
    query (then block_m must be 1); positions: [Q]. Returns fp32 block scores [Q, Hi, width],
    -inf past each query's own block, +inf on its local blocks. Launches one kernel; reads
    nothing on the host. block_n (keys per dot, at most bs), num_warps, num_stages: the
    launch (Triton's defaults)."""
    nq, hi, di = iq.shape
    bs = ik_cache.shape[1]
    _check_shapes(iq, ik_cache, ik_scale)
    if tables.dim() == 2 and block_m != 1:
        raise ValueError("per-query tables need one query per tile (block_m = 1)")
    out = torch.full((nq, hi, width), -torch.inf, device=iq.device, dtype=torch.float32)
    if nq == 0:
        return out
    stride_tq = tables.stride(0) if tables.dim() == 2 else 0
    grid = (triton.cdiv(nq, block_m), triton.cdiv(width, kv_blocks))
    scale = ik_cache if ik_scale is None else ik_scale  # not read unless SCALED
    fast(_block_scores_kernel)[grid](
        iq,
        ik_cache,
        scale,
        tables,
        positions,
        out,
        nq,
        iq.stride(0),
        iq.stride(1),
        ik_cache.stride(0),
        ik_cache.stride(1),
        scale.stride(0),
        stride_tq,
        out.stride(0),
        out.stride(1),
        HI=hi,
        DI=di,
        ROWS=max(16, triton.next_power_of_2(block_m * hi)),
        BLOCK_M=block_m,
        BS=bs,
        BLOCK_N=min(bs, block_n),
        NB=kv_blocks,
        LOCAL=local_blocks,
        SCALED=ik_scale is not None,
        PRECISION="ieee" if iq.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


TOPK_CHUNK = 8192  # scores per program of the first top-k pass (one pass up to 8,192 blocks)


@dataclass(frozen=True)
class DecodeSelectTiles:
    """How decode selection runs (module docstring). kv_blocks: key blocks per program (the
    grid is B x cdiv(W, kv_blocks)); block_n: keys per dot (at most a cache block);
    keys_major: `_decode_scores_kernel` (else `_block_scores_kernel`, one query per tile);
    dot (keys_major only): "query" converts the keys to the query's dtype, "fp16" / "fp8"
    quantise the query per (sequence, head) and convert fp8 codes to fp16 / use them as
    they are (fp8 index keys only); preload_pages (keys_major only): the program's page ids
    as one vector load; triton_topk: `top_blocks_triton` instead of torch.topk, with
    topk_chunk scores per program of its first pass."""

    kv_blocks: int = KV_BLOCKS
    block_n: int = 64
    keys_major: bool = False
    dot: str = "query"
    preload_pages: bool = False
    num_warps: int = 4
    num_stages: int = 3
    triton_topk: bool = False
    topk_chunk: int = TOPK_CHUNK

    def __post_init__(self):
        if self.dot not in DOT_DTYPES:
            raise ValueError(f"dot {self.dot!r}: expected one of {DOT_DTYPES}")
        if not self.keys_major and (self.dot != "query" or self.preload_pages):
            raise ValueError("dot and preload_pages are options of the keys-major kernel")
        if self.kv_blocks < 1 or self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"kv_blocks {self.kv_blocks}, block_n {self.block_n}")


# The engine's decode selection, as the sweep on the H200 picked (1M context, batch 1 and 8;
# docs/PERF.md "MSA"): keys-major scoring, 8 blocks a program, page ids preloaded, the
# Triton top-k; on fp8 codes an fp8 x fp8 dot.
DECODE_TILES = DecodeSelectTiles(
    kv_blocks=8, block_n=128, keys_major=True, preload_pages=True, triton_topk=True
)
DECODE_TILES_FP8 = replace(DECODE_TILES, dot="fp8")


def decode_block_scores(
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    width: int,
    local_blocks: int,
    ik_scale: torch.Tensor | None = None,
    tiles: DecodeSelectTiles | None = None,
) -> torch.Tensor:
    """One query per sequence: iq [B, Hi, Di]; ik_cache [pages, bs, Di] (fp8 codes if
    ik_scale [pages, bs] is given); block_tables [B, W]; positions [B]; width >= W. Returns
    fp32 block scores [B, Hi, width] as `block_scores`. One launch, no host reads. tiles:
    DECODE_TILES (DECODE_TILES_FP8 with ik_scale) unless given."""
    if tiles is None:
        tiles = DECODE_TILES if ik_scale is None else DECODE_TILES_FP8
    if not tiles.keys_major:
        return block_scores(
            iq,
            ik_cache,
            block_tables,
            positions,
            width,
            local_blocks,
            1,
            tiles.kv_blocks,
            ik_scale,
            tiles.block_n,
            tiles.num_warps,
            tiles.num_stages,
        )
    bsz, hi, di = iq.shape
    bs = ik_cache.shape[1]
    _check_shapes(iq, ik_cache, ik_scale)
    if tiles.dot != "query" and ik_scale is None:
        raise ValueError(f"dot {tiles.dot!r} takes fp8 index keys (ik_scale)")
    out = torch.empty(bsz, hi, width, device=iq.device, dtype=torch.float32)
    if bsz == 0:
        return out
    scale = ik_cache if ik_scale is None else ik_scale  # not read unless SCALED
    fast(_decode_scores_kernel)[(bsz, triton.cdiv(width, tiles.kv_blocks))](
        iq,
        ik_cache,
        scale,
        block_tables,
        positions,
        out,
        width,
        iq.stride(0),
        iq.stride(1),
        ik_cache.stride(0),
        ik_cache.stride(1),
        scale.stride(0),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HI=hi,
        ROWS=max(16, triton.next_power_of_2(hi)),
        DI=di,
        BS=bs,
        BLOCK_N=min(bs, tiles.block_n),
        NB=tiles.kv_blocks,
        NB_P2=triton.next_power_of_2(tiles.kv_blocks),
        LOCAL=local_blocks,
        SCALED=ik_scale is not None,
        QUANT=DOT_DTYPES.index(tiles.dot),
        PRELOAD=tiles.preload_pages,
        PRECISION="ieee" if iq.dtype == torch.float32 and tiles.dot == "query" else "tf32",
        STAGES=tiles.num_stages,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def _check_shapes(iq: torch.Tensor, ik_cache: torch.Tensor, ik_scale: torch.Tensor | None):
    if ik_cache.shape[-1] != iq.shape[-1] or iq.stride(-1) != 1 or ik_cache.stride(-1) != 1:
        raise ValueError(
            f"iq {list(iq.shape)}, ik_cache {list(ik_cache.shape)}: expected "
            "[Q, Hi, Di] and [pages, bs, Di] with unit stride on Di"
        )
    check_index_scales(ik_cache, ik_scale)


def check_index_scales(ik_cache: torch.Tensor, ik_scale: torch.Tensor | None) -> None:
    """ValueError unless ik_scale is None or fp32 [pages, bs] (unit stride on bs) beside
    float8_e4m3fn codes ik_cache [pages, bs, Di]."""
    if ik_scale is None:
        return
    codes_ok = ik_cache.dtype == torch.float8_e4m3fn
    scale_ok = ik_scale.dtype == torch.float32 and ik_scale.shape == ik_cache.shape[:2]
    if not (codes_ok and scale_ok and ik_scale.stride(-1) == 1):
        raise ValueError(
            f"ik_scale {ik_scale.dtype} {list(ik_scale.shape)}: expected float32 "
            f"{list(ik_cache.shape[:2])} with unit stride beside float8_e4m3fn "
            f"codes (ik_cache: {ik_cache.dtype})"
        )


def top_blocks(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [.., W] (W >= topk) -> int64 ids [.., topk] best first, -1 where -inf."""
    values, ids = scores.topk(topk, dim=-1)
    return ids.masked_fill(values == -torch.inf, -1)


NEG_INF_KEY = -2139095041  # the order key of -inf (0xff800000 ^ 0x7fffffff)


def top_blocks_triton(
    scores: torch.Tensor, topk: int, chunk: int = TOPK_CHUNK, num_warps: int = 8
) -> torch.Tensor:
    """`top_blocks` in Triton: a program per row (rows of at most `chunk` scores), or per
    row and chunk of `chunk` scores, each picking its own top k, and a program per row
    merging them (`_chunk_top_kernel`, `_merge_top_kernel`). scores [.., W] fp32 with unit
    stride on W; ties go to the lower id."""
    width = scores.shape[-1]
    rows = scores.reshape(-1, width)
    out = torch.empty(*scores.shape[:-1], topk, device=scores.device, dtype=torch.int64)
    if rows.shape[0] == 0:
        return out
    if scores.dtype != torch.float32 or rows.stride(-1) != 1 or width < topk:
        raise ValueError(f"scores {scores.dtype} {list(scores.shape)}: fp32 [.., W >= {topk}]")
    chunk = max(min(chunk, triton.next_power_of_2(width)), triton.next_power_of_2(topk))
    n_chunks = triton.cdiv(width, chunk)
    final = n_chunks == 1
    cand = out if final else rows.new_empty(rows.shape[0], n_chunks * topk, dtype=torch.int64)
    fast(_chunk_top_kernel)[(rows.shape[0], n_chunks)](
        rows,
        cand,
        width,
        rows.stride(0),
        n_chunks,
        TOPK=topk,
        CHUNK=chunk,
        FINAL=final,
        NEG_INF_KEY=NEG_INF_KEY,
        num_warps=num_warps,
    )
    if not final:
        fast(_merge_top_kernel)[(rows.shape[0],)](
            cand,
            out,
            n_chunks * topk,
            TOPK=topk,
            BLOCK_C=triton.next_power_of_2(n_chunks * topk),
            NEG_INF_KEY=NEG_INF_KEY,
            num_warps=num_warps,
        )
    return out


def _device_positions(q_pos: list[int] | range, device: torch.device) -> torch.Tensor:
    if isinstance(q_pos, range):
        return torch.arange(q_pos.start, q_pos.stop, q_pos.step, device=device)
    return torch.as_tensor(list(q_pos), device=device)


def select_blocks(
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    table: torch.Tensor,
    q_pos: list[int] | range,
    topk: int,
    local_blocks: int,
    q_chunk: int | None = None,
    kv_blocks: int = KV_BLOCKS,
    ik_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`naive.select_blocks` in Triton. iq: [Q, Hi, Di] at host positions q_pos [Q];
    ik_cache: [pages, bs, Di] (fp8 codes if ik_scale [pages, bs] is given); table: [W] the
    sequence's pages. Returns int64 [Q, Hi, topk], -1 padded. q_chunk: queries per score
    buffer (default: SCORE_BYTES of scores)."""
    nq, hi, _ = iq.shape
    bs = ik_cache.shape[1]
    q_pos = list(q_pos) if not isinstance(q_pos, range) else q_pos
    pos = _device_positions(q_pos, iq.device)
    width_all = max(q_pos, default=0) // bs + 1
    q_chunk = q_chunk or max(64, SCORE_BYTES // (4 * hi * max(width_all, topk)))
    block_m = max(1, 64 // hi)
    out = []
    for c0 in range(0, nq, q_chunk):
        c1 = min(c0 + q_chunk, nq)
        width = max(max(q_pos[c0:c1]) // bs + 1, topk)
        scores = block_scores(
            iq[c0:c1],
            ik_cache,
            table,
            pos[c0:c1],
            width,
            local_blocks,
            block_m,
            kv_blocks,
            ik_scale,
        )
        out.append(top_blocks(scores, topk))
    if not out:
        return torch.empty(0, hi, topk, device=iq.device, dtype=torch.int64)
    return torch.cat(out)


def decode_select_blocks(
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    local_blocks: int,
    kv_blocks: int | None = None,
    ik_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`naive.decode_select_blocks` in Triton: one query per sequence, one scoring launch for
    the batch and a top-k, no host reads (capturable). iq: [B, Hi, Di]; block_tables:
    [B, W]; positions: [B]; ik_scale: as `select_blocks`. Returns int64 [B, Hi, topk]. The
    launch: DECODE_TILES (DECODE_TILES_FP8 with ik_scale), kv_blocks overriding theirs."""
    tiles = DECODE_TILES if ik_scale is None else DECODE_TILES_FP8
    if kv_blocks is not None:
        tiles = replace(tiles, kv_blocks=kv_blocks)
    return decode_select_with(
        tiles, iq, ik_cache, block_tables, positions, topk, local_blocks, ik_scale
    )


def decode_select_with(
    tiles: DecodeSelectTiles,
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    local_blocks: int,
    ik_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_select_blocks` run as `tiles` says."""
    width = max(block_tables.shape[1], topk)
    scores = decode_block_scores(
        iq, ik_cache, block_tables, positions, width, local_blocks, ik_scale, tiles
    )
    if tiles.triton_topk:
        return top_blocks_triton(scores, topk, chunk=tiles.topk_chunk)
    return top_blocks(scores, topk)
