"""MSA block selection for decode with the top-k fused: one kernel launch for the batch (and
a memset of its counters), no host reads, capturable.

`fused_decode_select_blocks` has the contract of `naive.decode_select_blocks`. Programs are
(sequence, split); a split holds NB consecutive key blocks (NB a power of two chosen so a
sequence has at most SPLITS splits: 128, about one program per SM for one sequence at 1M
context). Each program scores its blocks for all Hi index heads at once (rows of one tile,
BLOCK_N keys per step: max of iq . ik over the causal keys, +inf on the local blocks), picks
its own top-k per head by k rounds of max-and-remove, and writes them as candidates
[B, Hi, splits * k] (score, block id). It then bumps its sequence's counter (an acq_rel
atomic, so the candidates are visible); the program that brings the counter to `splits`
merges the sequence's candidates per head by the same k rounds and writes [B, Hi, k].

fp8 index keys (SCALED): codes converted to the query dtype in registers, each key's column
of the dot multiplied by its fp32 scale before the block max, as in `select.py`.

Ties go to the lower block id (`torch.topk` in the reference leaves their order open), slots
whose score is -inf hold -1. Scratch: 2 x B x Hi x splits x k x 4 bytes (64 KiB per sequence
at 1M) and B int32 counters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.launch import fast
from sparrow.kernels.msa.select import check_index_scales

SPLITS = 128  # most splits per sequence


@triton.jit(do_not_specialize=["n_splits"])  # see kernels/launch.py
def _select_topk_kernel(
    iq_ptr,
    ik_ptr,
    scale_ptr,
    tables_ptr,
    pos_ptr,
    cand_s_ptr,
    cand_i_ptr,
    count_ptr,
    out_ptr,
    n_splits,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_sb,
    stride_tb,
    HI: tl.constexpr,
    ROWS: tl.constexpr,
    DI: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
    TOPK: tl.constexpr,
    CW: tl.constexpr,
    LOCAL: tl.constexpr,
    SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_b, i_s = tl.program_id(0), tl.program_id(1)
    pos = tl.load(pos_ptr + i_b)
    q_block = pos // BS
    o_h = tl.arange(0, ROWS)
    m_h = o_h < HI
    o_d = tl.arange(0, DI)
    b_q = tl.load(
        iq_ptr + i_b * stride_qb + o_h[:, None] * stride_qh + o_d[None, :],
        mask=m_h[:, None],
        other=0.0,
    )
    o_j = tl.arange(0, NB)
    o_n = tl.arange(0, BLOCK_N)
    j_lo = i_s * NB
    b_sc = tl.full([ROWS, NB], float("-inf"), dtype=tl.float32)
    for jj in range(0, tl.minimum(NB, q_block + 1 - j_lo)):
        page = tl.load(tables_ptr + i_b * stride_tb + j_lo + jj).to(tl.int64)
        b_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        for n0 in tl.static_range(0, BS, BLOCK_N):
            p_k = ik_ptr + page * stride_kb + (n0 + o_n)[:, None] * stride_kt + o_d[None, :]
            b_k = tl.load(p_k).to(b_q.dtype)  # fp8 codes: converted here
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
            if SCALED:
                b_s *= tl.load(scale_ptr + page * stride_sb + n0 + o_n)[None, :]
            causal = ((j_lo + jj) * BS + n0 + o_n)[None, :] <= pos
            b_max = tl.maximum(b_max, tl.max(tl.where(causal, b_s, float("-inf")), axis=1))
        local = (q_block - j_lo - jj) < LOCAL
        b_max = tl.where(local, float("inf"), b_max)
        b_sc = tl.where(o_j[None, :] == jj, b_max[:, None], b_sc)
    # this split's top-k per head -> candidates [B, Hi, n_splits * TOPK]
    ids = j_lo + o_j
    row = (i_b * HI + o_h) * (n_splits * TOPK) + i_s * TOPK
    for r in tl.static_range(TOPK):
        b_top = tl.max(b_sc, axis=1)
        b_id = tl.min(tl.where(b_sc == b_top[:, None], ids[None, :], 2**30), axis=1)
        tl.store(cand_s_ptr + row + r, b_top, mask=m_h)
        tl.store(cand_i_ptr + row + r, b_id, mask=m_h)
        b_sc = tl.where(ids[None, :] == b_id[:, None], float("-inf"), b_sc)
    tl.debug_barrier()  # every thread's candidates stored before the release
    done = tl.atomic_add(count_ptr + i_b, 1, sem="acq_rel")
    if done == n_splits - 1:  # the sequence's last split merges
        o_c = tl.arange(0, CW)
        m_c = o_c < n_splits * TOPK
        for h in tl.static_range(HI):
            base = (i_b * HI + h) * (n_splits * TOPK)
            c_s = tl.load(
                cand_s_ptr + base + o_c, mask=m_c, other=float("-inf"), cache_modifier=".cg"
            )  # from L2: other programs wrote them
            c_i = tl.load(cand_i_ptr + base + o_c, mask=m_c, other=2**30, cache_modifier=".cg")
            for r in tl.static_range(TOPK):
                c_top = tl.max(c_s, axis=0)
                c_id = tl.min(tl.where(c_s == c_top, c_i, 2**30), axis=0)
                tl.store(
                    out_ptr + (i_b * HI + h) * TOPK + r,
                    tl.where(c_top == float("-inf"), -1, c_id).to(tl.int64),
                )
                c_s = tl.where((c_i == c_id) & (c_s == c_top), float("-inf"), c_s)


def fused_decode_select_blocks(
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    local_blocks: int,
    kv_blocks: int | None = None,
    ik_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`naive.decode_select_blocks` in one launch. iq: [B, Hi, Di]; ik_cache: [pages, bs,
    Di] (fp8 codes if ik_scale [pages, bs] is given); block_tables: [B, W]; positions: [B].
    Returns int64 [B, Hi, topk], best first. kv_blocks: blocks per split (default: the power
    of two giving at most SPLITS)."""
    bsz, hi, di = iq.shape
    bs, w = ik_cache.shape[1], block_tables.shape[1]
    if ik_cache.shape[-1] != di or iq.stride(-1) != 1 or ik_cache.stride(-1) != 1:
        raise ValueError(f"iq {list(iq.shape)} does not fit ik_cache {list(ik_cache.shape)}")
    check_index_scales(ik_cache, ik_scale)
    nb = kv_blocks or max(16, triton.next_power_of_2(triton.cdiv(w, SPLITS)))
    n_splits = triton.cdiv(w, nb)
    cand_s = torch.empty(bsz, hi, n_splits * topk, device=iq.device, dtype=torch.float32)
    cand_i = torch.empty(bsz, hi, n_splits * topk, device=iq.device, dtype=torch.int32)
    count = torch.zeros(bsz, device=iq.device, dtype=torch.int32)
    out = torch.empty(bsz, hi, topk, device=iq.device, dtype=torch.int64)
    scale = ik_cache if ik_scale is None else ik_scale  # not read unless SCALED
    fast(_select_topk_kernel)[(bsz, n_splits)](
        iq,
        ik_cache,
        scale,
        block_tables,
        positions,
        cand_s,
        cand_i,
        count,
        out,
        n_splits,
        iq.stride(0),
        iq.stride(1),
        ik_cache.stride(0),
        ik_cache.stride(1),
        scale.stride(0),
        block_tables.stride(0),
        HI=hi,
        ROWS=max(16, triton.next_power_of_2(hi)),
        DI=di,
        BS=bs,
        BLOCK_N=min(bs, 64),
        NB=nb,
        TOPK=topk,
        CW=triton.next_power_of_2(n_splits * topk),
        LOCAL=local_blocks,
        SCALED=ik_scale is not None,
        PRECISION="ieee" if iq.dtype == torch.float32 else "tf32",
    )
    return out
