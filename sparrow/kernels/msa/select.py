"""MSA block selection: index scores per key block in Triton, the top-k in torch.

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

`decode_select.py` fuses the top-k into the scoring launch for decode; this unfused form is
faster on the H200 (bench/msa.py) and is what `kernels.decode_select_blocks` takes.

Ties: torch.topk orders equal scores in no documented way, the reference uses the same
call; the local blocks all score +inf, so which of them comes first is not part of the
contract (compare selections as sets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.launch import fast

SCORE_BYTES = 1 << 27  # score buffer per prompt chunk
KV_BLOCKS = 16  # key blocks per program


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
) -> torch.Tensor:
    """iq: [Q, Hi, Di]; ik_cache: [pages, bs, Di] (fp8 codes if ik_scale [pages, bs] is
    given); tables: [W'] one sequence's pages (every query reads it) or [Q, W'] one row per
    query (then block_m must be 1); positions: [Q]. Returns fp32 block scores [Q, Hi, width],
    -inf past each query's own block, +inf on its local blocks. Launches one kernel; reads
    nothing on the host."""
    nq, hi, di = iq.shape
    bs = ik_cache.shape[1]
    if ik_cache.shape[-1] != di or iq.stride(-1) != 1 or ik_cache.stride(-1) != 1:
        raise ValueError(
            f"iq {list(iq.shape)}, ik_cache {list(ik_cache.shape)}: expected "
            "[Q, Hi, Di] and [pages, bs, Di] with unit stride on Di"
        )
    check_index_scales(ik_cache, ik_scale)
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
        BLOCK_N=min(bs, 64),
        NB=kv_blocks,
        LOCAL=local_blocks,
        SCALED=ik_scale is not None,
        PRECISION="ieee" if iq.dtype == torch.float32 else "tf32",
    )
    return out


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
    kv_blocks: int = KV_BLOCKS,
    ik_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`naive.decode_select_blocks` in Triton: one query per sequence, one scoring launch for
    the batch and a torch.topk, no host reads (capturable). iq: [B, Hi, Di]; block_tables:
    [B, W]; positions: [B]; ik_scale: as `select_blocks`. Returns int64 [B, Hi, topk]."""
    width = max(block_tables.shape[1], topk)
    scores = block_scores(
        iq, ik_cache, block_tables, positions, width, local_blocks, 1, kv_blocks, ik_scale
    )
    return top_blocks(scores, topk)
