"""Chunked gated delta rule for prefill (chunks of 64), varlen batches, states in a pool.

A program owns (sequence, v-head, BV columns of the state) and scans the sequence's chunks
with the state S [Dk, BV] held in registers the whole way. Per chunk (see naive.py for the
algebra), with G the cumulative log-decay from the chunk start and S0 the incoming state:

    (I + A) u = beta * (v - exp(G) k S0),  A[t, s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)
    o = exp(G) q S0 + ((q k^T) * exp(G_t - G_s), s <= t) u
    S = exp(G_last) S0 + (k * exp(G_last - G))^T u

The chunk is four sub-blocks of 16 rows: A's diagonal 16x16 blocks are inverted by forward
substitution (exact, stable), and the system is solved block by block. L2-norm and scale of
q/k are fused in; the state math is fp32 (dots in fp32, `ieee` precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_sub(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, row0, length, i_k, i_h, o_v,
              stride_qt, stride_vt, stride_gt, DK: tl.constexpr):  # fmt: skip
    """Rows row0..row0+16 of one sequence: normalised q (scaled), k, v [16, BV], g, beta."""
    o_t = row0 + tl.arange(0, 16)
    m_t = o_t < length
    o_dk = tl.arange(0, DK)
    p_qk = o_t[:, None] * stride_qt + i_k * DK + o_dk[None, :]
    b_q = tl.load(q_ptr + p_qk, mask=m_t[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + p_qk, mask=m_t[:, None], other=0.0).to(tl.float32)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None] * (1.0 / tl.sqrt(DK * 1.0))
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
    p_v = v_ptr + o_t[:, None] * stride_vt + o_v[None, :]
    b_v = tl.load(p_v, mask=m_t[:, None], other=0.0).to(tl.float32)
    b_g = tl.load(g_ptr + o_t * stride_gt + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(b_ptr + o_t * stride_gt + i_h, mask=m_t, other=0.0).to(tl.float32)
    return b_q, b_k, b_v, b_g, b_beta


@triton.jit
def _pair(k_i, k_j, gc_i, gc_j, beta_i):
    """A block [16, 16] between sub-blocks i > j: beta_i exp(G_i - G_j) k_i.k_j."""
    kk = tl.dot(k_i, tl.trans(k_j), input_precision="ieee")
    return kk * tl.exp(gc_i[:, None] - gc_j[None, :]) * beta_i[:, None]


@triton.jit
def _decay_in_block(gc, strict: tl.constexpr):
    """exp(G_t - G_s) for s < t (strict) or s <= t inside one sub-block, else 0."""
    o = tl.arange(0, 16)
    keep = (o[:, None] > o[None, :]) if strict else (o[:, None] >= o[None, :])
    return tl.exp(tl.where(keep, gc[:, None] - gc[None, :], float("-inf")))


@triton.jit
def _inverse_unit_lower(a):
    """(I + a)^-1 for strictly lower triangular a [16, 16], by forward substitution."""
    o = tl.arange(0, 16)
    inv = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    for r in tl.static_range(1, 16):
        a_r = tl.sum(tl.where(o[:, None] == r, a, 0.0), axis=0)  # row r of a
        row = tl.where(o == r, 1.0, 0.0) - tl.sum(a_r[:, None] * inv, axis=0)
        inv = tl.where(o[:, None] == r, row[None, :], inv)
    return inv


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _own(q, k, gc, u, s0):
    """Output of a sub-block from the incoming state and its own rows (s <= t)."""
    intra = _mm(q, tl.trans(k)) * _decay_in_block(gc, False)
    return tl.exp(gc)[:, None] * _mm(q, s0) + _mm(intra, u)


@triton.jit
def _cross(q_i, k_j, gc_i, gc_j, u_j):
    """Contribution of an earlier sub-block j of the same chunk to sub-block i's output."""
    return _mm(_mm(q_i, tl.trans(k_j)) * tl.exp(gc_i[:, None] - gc_j[None, :]), u_j)


@triton.jit
def _store_sub(o_seq, row0, length, o_v, stride_vt, o_blk):
    o_t = row0 + tl.arange(0, 16)
    tl.store(o_seq + o_t[:, None] * stride_vt + o_v[None, :], o_blk, mask=(o_t < length)[:, None])


@triton.jit
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, state_ptr, slot_ptr, cu_ptr,
    stride_qt, stride_vt, stride_gt, stride_ss, stride_sh,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k = i_h // RATIO
    start = tl.load(cu_ptr + i_b)
    length = tl.load(cu_ptr + i_b + 1) - start
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    o_dk = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    p_s = state_ptr + slot * stride_ss + i_h * stride_sh + o_dk[:, None] * DV + o_v[None, :]
    b_s = tl.load(p_s)  # [DK, BV] fp32, carried in registers across all chunks
    # per-sequence base pointers (v and o rows hold all heads: offset the head here)
    q_seq, k_seq = q_ptr + start * stride_qt, k_ptr + start * stride_qt
    v_seq, o_seq = v_ptr + start * stride_vt + i_h * DV, o_ptr + start * stride_vt + i_h * DV
    g_seq, b_seq = g_ptr + start * stride_gt, b_ptr + start * stride_gt
    for c0 in range(0, length, 64):
        # the four 16-row sub-blocks of the chunk
        # fmt: off
        q0, k0, v0, g0, be0 = _load_sub(q_seq, k_seq, v_seq, g_seq, b_seq, c0, length, i_k, i_h,
                                        o_v, stride_qt, stride_vt, stride_gt, DK)
        q1, k1, v1, g1, be1 = _load_sub(q_seq, k_seq, v_seq, g_seq, b_seq, c0 + 16, length, i_k,
                                        i_h, o_v, stride_qt, stride_vt, stride_gt, DK)
        q2, k2, v2, g2, be2 = _load_sub(q_seq, k_seq, v_seq, g_seq, b_seq, c0 + 32, length, i_k,
                                        i_h, o_v, stride_qt, stride_vt, stride_gt, DK)
        q3, k3, v3, g3, be3 = _load_sub(q_seq, k_seq, v_seq, g_seq, b_seq, c0 + 48, length, i_k,
                                        i_h, o_v, stride_qt, stride_vt, stride_gt, DK)
        # fmt: on
        # cumulative log-decay from the chunk start
        gc0 = tl.cumsum(g0, axis=0)
        gc1 = tl.sum(g0, axis=0) + tl.cumsum(g1, axis=0)
        gc2 = tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.cumsum(g2, axis=0)
        gc3 = tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0) + tl.cumsum(g3, axis=0)
        g_last = tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0) + tl.sum(g3, axis=0)
        # right-hand sides beta * (v - exp(G) k S0)
        r0 = be0[:, None] * (v0 - tl.exp(gc0)[:, None] * _mm(k0, b_s))
        r1 = be1[:, None] * (v1 - tl.exp(gc1)[:, None] * _mm(k1, b_s))
        r2 = be2[:, None] * (v2 - tl.exp(gc2)[:, None] * _mm(k2, b_s))
        r3 = be3[:, None] * (v3 - tl.exp(gc3)[:, None] * _mm(k3, b_s))
        # block forward substitution of (I + A) u = r
        a10, a20, a30 = (
            _pair(k1, k0, gc1, gc0, be1),
            _pair(k2, k0, gc2, gc0, be2),
            _pair(k3, k0, gc3, gc0, be3),
        )
        a21, a31, a32 = (
            _pair(k2, k1, gc2, gc1, be2),
            _pair(k3, k1, gc3, gc1, be3),
            _pair(k3, k2, gc3, gc2, be3),
        )
        t0 = _inverse_unit_lower(_mm(k0, tl.trans(k0)) * _decay_in_block(gc0, True) * be0[:, None])
        t1 = _inverse_unit_lower(_mm(k1, tl.trans(k1)) * _decay_in_block(gc1, True) * be1[:, None])
        t2 = _inverse_unit_lower(_mm(k2, tl.trans(k2)) * _decay_in_block(gc2, True) * be2[:, None])
        t3 = _inverse_unit_lower(_mm(k3, tl.trans(k3)) * _decay_in_block(gc3, True) * be3[:, None])
        u0 = _mm(t0, r0)
        u1 = _mm(t1, r1 - _mm(a10, u0))
        u2 = _mm(t2, r2 - _mm(a20, u0) - _mm(a21, u1))
        u3 = _mm(t3, r3 - _mm(a30, u0) - _mm(a31, u1) - _mm(a32, u2))
        # outputs: the incoming state plus the chunk's own contributions (s <= t)
        o0 = _own(q0, k0, gc0, u0, b_s)
        o1 = _own(q1, k1, gc1, u1, b_s) + _cross(q1, k0, gc1, gc0, u0)
        o2 = (
            _own(q2, k2, gc2, u2, b_s) + _cross(q2, k0, gc2, gc0, u0) + _cross(q2, k1, gc2, gc1, u1)
        )
        o3 = (
            _own(q3, k3, gc3, u3, b_s) + _cross(q3, k0, gc3, gc0, u0)
            + _cross(q3, k1, gc3, gc1, u1) + _cross(q3, k2, gc3, gc2, u2)
        )  # fmt: skip
        _store_sub(o_seq, c0, length, o_v, stride_vt, o0)
        _store_sub(o_seq, c0 + 16, length, o_v, stride_vt, o1)
        _store_sub(o_seq, c0 + 32, length, o_v, stride_vt, o2)
        _store_sub(o_seq, c0 + 48, length, o_v, stride_vt, o3)
        # state to the end of the chunk
        b_s = tl.exp(g_last) * b_s \
            + _mm(tl.trans(k0 * tl.exp(g_last - gc0)[:, None]), u0) \
            + _mm(tl.trans(k1 * tl.exp(g_last - gc1)[:, None]), u1) \
            + _mm(tl.trans(k2 * tl.exp(g_last - gc2)[:, None]), u2) \
            + _mm(tl.trans(k3 * tl.exp(g_last - gc3)[:, None]), u3)  # fmt: skip
    tl.store(p_s, b_s)


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    block_v: int = 32,
) -> torch.Tensor:
    """q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] (log-decay, write strength);
    sequences back to back (cu_seqlens [B + 1] int32); states: [S, Hv, Dk, Dv] fp32 pool, each
    sequence starts from states[slots[b]] and its final state is written back there.
    Returns o: [T, Hv, Dv] fp32. q/k are L2-normalised and q scaled by Dk^-0.5 here."""
    t, hk, dk = q.shape
    _, hv, dv = v.shape
    if k.shape != q.shape or g.shape != (t, hv) or beta.shape != (t, hv) or hv % hk:
        raise ValueError(
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, "
            f"beta {list(beta.shape)}: expected k like q, g and beta [T, Hv], Hv % Hk == 0"
        )
    if states.shape[1:] != (hv, dk, dv) or states.dtype != torch.float32:
        raise ValueError(f"states {list(states.shape)} must be fp32 [S, {hv}, {dk}, {dv}]")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(t, hv, dv, device=q.device, dtype=torch.float32)
    block_v = min(block_v, dv)
    grid = (dv // block_v, hv, cu_seqlens.numel() - 1)
    _chunk_kernel[grid](
        q, k, v, g, beta, o, states, slots, cu_seqlens,
        q.stride(0), v.stride(0), g.stride(0), states.stride(0), states.stride(1),
        RATIO=hv // hk, DK=dk, DV=dv, BV=block_v,
    )  # fmt: skip
    return o
