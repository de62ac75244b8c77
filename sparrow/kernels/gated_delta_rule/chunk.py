"""Chunked gated delta rule for prefill (chunks of 64), varlen batches, states in a pool.

Per chunk (see naive.py for the algebra), with G the cumulative log-decay from the chunk
start and S0 the incoming state, the delta rule's writes u solve

    (I + A) u = beta * (v - exp(G) k S0),  A[t, s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)

so u = U - W S0 with U = (I + A)^-1 (beta v) and W = (I + A)^-1 (beta exp(G) k), which do not
depend on the state. Four kernels, only the third sequential:

1. `_blocks_kernel`, one program per (chunk, head), all in parallel: G, the k row norms and
   the ten 16x16 blocks of the solve over four 16-row sub-blocks (off-diagonal blocks of A;
   diagonal blocks inverted exactly by forward substitution).
2. `_solve_kernel`, same grid: U and W by block forward substitution, 32 columns of [W | U]
   at a time. (One kernel doing both spilled 1.7 KB of registers at sm_90; split, neither
   spills: ptxas via tests/kernels/sm90_cases.py.)
3. `_state_kernel`, sequential over a sequence's chunks, one program per (sequence, v-head,
   BV columns of the state), the state S [Dk, BV] in registers the whole way: it stores each
   chunk's incoming state, then  u = U - W S  (in place of U)  and
   S = exp(G_last) S + (k * exp(G_last - G))^T u.  Two small dots per chunk. Optionally
   (`ChunkTiles.segment_chunks`) parallel over segments of a sequence: S maps affinely
   across a segment, S_end = M S_begin + E; `_segment_kernel` finds each segment's (E, M)
   in parallel, `_carry_kernel` chains them (one step per segment), and `_state_kernel` then
   scans each segment from its incoming state.
4. `_output_kernel`, parallel again:  o = exp(G) q S_c + ((q k^T) * exp(G_t - G_s), s <= t) u.

L2-norm and scale of q/k are fused in. W, U, u and the per-chunk states are stored in the
activation dtype (bf16 in the model: half the traffic; fp32 in the exactness tests). Dots use
tensor cores for 16-bit inputs (tf32 in the solve; the state and output dots round their
operands to the stored dtype, as W, U and the chunk states already are) and exact fp32
(`ieee`) for fp32 inputs; the carried state and the decay math are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _mm_as(a, b, DT: tl.constexpr):
    """a @ b with both operands rounded to the stored dtype DT (bf16 in the model: tensor
    cores at full rate, fp32 accumulation; exact fp32 when DT is fp32)."""
    if DT == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _scaled(kk, n_i, n_j, gc_i, gc_j, beta_i):
    """Block [16, 16] of A between sub-blocks i and j from the raw dot products kk of their
    k rows: beta_i exp(G_i - G_j) (k_i / |k_i|).(k_j / |k_j|) (for i == j the caller keeps
    the strictly lower part)."""
    decay = tl.exp(tl.minimum(gc_i[:, None] - gc_j[None, :], 0.0))
    return kk * (n_i * beta_i)[:, None] * n_j[None, :] * decay


@triton.jit
def _lower(strict: tl.constexpr):
    o = tl.arange(0, 16)
    return tl.where((o[:, None] > o[None, :]) if strict else (o[:, None] >= o[None, :]), 1.0, 0.0)


@triton.jit
def _inverse_unit_lower(a):
    """(I + a)^-1 for strictly lower triangular a [16, 16]. a is nilpotent (a^16 = 0), so the
    inverse is the series I - a + a^2 - ... - a^15 = (I - a)(I + a^2)(I + a^4)(I + a^8): six
    exact fp32 products (row-by-row substitution needs a reduction across warps per row)."""
    o = tl.arange(0, 16)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    a2 = tl.dot(a, a, input_precision="ieee")
    a4 = tl.dot(a2, a2, input_precision="ieee")
    a8 = tl.dot(a4, a4, input_precision="ieee")
    inv = tl.dot(eye - a, eye + a2, input_precision="ieee")
    inv = tl.dot(inv, eye + a4, input_precision="ieee")
    return tl.dot(inv, eye + a8, input_precision="ieee")


@triton.jit
def _rhs(k_ptr, v_ptr, row0, length, i_k, inv, gc, beta, col, stride_kt, stride_vt,
         DK: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """Right-hand side of rows row0..row0+16 for columns col..col+BC of [W | U]:
    beta exp(G) k (normalised) for the first DK columns, beta v after."""
    o_t = row0 + tl.arange(0, 16)
    m_t = (o_t < length)[:, None]
    o_c = tl.arange(0, BC)
    is_k = col < DK
    p_k = k_ptr + o_t[:, None] * stride_kt + i_k * DK + col + o_c[None, :]
    p_v = v_ptr + o_t[:, None] * stride_vt + (col - DK) + o_c[None, :]
    b_x = tl.load(tl.where(is_k, p_k, p_v), mask=m_t, other=0.0).to(tl.float32)
    return b_x * tl.where(is_k, inv * beta * tl.exp(gc), beta)[:, None]


@triton.jit
def _store_rows(ptr, row0, length, col, stride_t, x):
    o_t = row0 + tl.arange(0, 16)
    o_c = tl.arange(0, x.shape[1])
    p = ptr + o_t[:, None] * stride_t + col + o_c[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=(o_t < length)[:, None])


@triton.jit
def _length(cu_ptr, i_b):
    return tl.load(cu_ptr + i_b + 1) - tl.load(cu_ptr + i_b)


@triton.jit
def _mat_offsets():
    o = tl.arange(0, 16)
    return o[:, None] * 16 + o[None, :]


@triton.jit
def _blocks_kernel(
    k_ptr, g_ptr, b_ptr, mats_ptr, gc_ptr, kinv_ptr, cu_ptr, chunk_ptr,
    stride_kt, stride_gt, RATIO: tl.constexpr, DK: tl.constexpr,
):  # fmt: skip
    """Per (chunk, head): G, the inverse k norms, and the ten 16x16 blocks of the solve
    (inverted diagonal blocks t_i, off-diagonal blocks a_ij of A) into `mats`."""
    i_c, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c0, start, length = i_c * 64, tl.load(cu_ptr + i_b), _length(cu_ptr, i_b)
    if c0 >= length:
        return
    i_k = i_h // RATIO
    DT: tl.constexpr = k_ptr.dtype.element_ty  # k k^T in the stored dtype (`_mm_as`)
    BK: tl.constexpr = 32 if DK > 32 else DK
    k_seq = k_ptr + start * stride_kt + i_k * DK
    # the ten dot products of the four 16-row sub-blocks, BK columns of k at a time (whole
    # 128-wide fp32 rows of all four kept live spill registers), and the row norms
    kk00 = tl.zeros([16, 16], dtype=tl.float32)
    kk10, kk20, kk30, kk11, kk21 = kk00, kk00, kk00, kk00, kk00
    kk31, kk22, kk32, kk33 = kk00, kk00, kk00, kk00
    ss0 = tl.zeros([16], dtype=tl.float32)
    ss1, ss2, ss3 = ss0, ss0, ss0
    for kb in range(DK // BK):
        x0 = _cols(k_seq, c0, length, kb * BK, stride_kt, BK)
        x1 = _cols(k_seq, c0 + 16, length, kb * BK, stride_kt, BK)
        x2 = _cols(k_seq, c0 + 32, length, kb * BK, stride_kt, BK)
        x3 = _cols(k_seq, c0 + 48, length, kb * BK, stride_kt, BK)
        ss0, ss1 = ss0 + tl.sum(x0 * x0, axis=1), ss1 + tl.sum(x1 * x1, axis=1)
        ss2, ss3 = ss2 + tl.sum(x2 * x2, axis=1), ss3 + tl.sum(x3 * x3, axis=1)
        kk00 += _mm_as(x0, tl.trans(x0), DT)
        kk10 += _mm_as(x1, tl.trans(x0), DT)
        kk20 += _mm_as(x2, tl.trans(x0), DT)
        kk30 += _mm_as(x3, tl.trans(x0), DT)
        kk11 += _mm_as(x1, tl.trans(x1), DT)
        kk21 += _mm_as(x2, tl.trans(x1), DT)
        kk31 += _mm_as(x3, tl.trans(x1), DT)
        kk22 += _mm_as(x2, tl.trans(x2), DT)
        kk32 += _mm_as(x3, tl.trans(x2), DT)
        kk33 += _mm_as(x3, tl.trans(x3), DT)
    n0, n1 = tl.rsqrt(ss0 + 1e-6), tl.rsqrt(ss1 + 1e-6)
    n2, n3 = tl.rsqrt(ss2 + 1e-6), tl.rsqrt(ss3 + 1e-6)
    g_seq, b_seq, sg = g_ptr + start * stride_gt, b_ptr + start * stride_gt, stride_gt
    g0, g1 = _rows16(g_seq, c0, length, sg, i_h), _rows16(g_seq, c0 + 16, length, sg, i_h)
    g2, g3 = _rows16(g_seq, c0 + 32, length, sg, i_h), _rows16(g_seq, c0 + 48, length, sg, i_h)
    be0, be1 = _rows16(b_seq, c0, length, sg, i_h), _rows16(b_seq, c0 + 16, length, sg, i_h)
    be2, be3 = _rows16(b_seq, c0 + 32, length, sg, i_h), _rows16(b_seq, c0 + 48, length, sg, i_h)
    gc0 = tl.cumsum(g0, axis=0)
    gc1 = tl.sum(g0, axis=0) + tl.cumsum(g1, axis=0)
    gc2 = tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.cumsum(g2, axis=0)
    gc3 = tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0) + tl.cumsum(g3, axis=0)
    o_r = tl.arange(0, 16)
    p_row = (start + c0 + o_r) * stride_gt + i_h
    tl.store(gc_ptr + p_row, gc0, mask=c0 + o_r < length)
    tl.store(gc_ptr + p_row + 16 * stride_gt, gc1, mask=c0 + 16 + o_r < length)
    tl.store(gc_ptr + p_row + 32 * stride_gt, gc2, mask=c0 + 32 + o_r < length)
    tl.store(gc_ptr + p_row + 48 * stride_gt, gc3, mask=c0 + 48 + o_r < length)
    tl.store(kinv_ptr + p_row, n0, mask=c0 + o_r < length)
    tl.store(kinv_ptr + p_row + 16 * stride_gt, n1, mask=c0 + 16 + o_r < length)
    tl.store(kinv_ptr + p_row + 32 * stride_gt, n2, mask=c0 + 32 + o_r < length)
    tl.store(kinv_ptr + p_row + 48 * stride_gt, n3, mask=c0 + 48 + o_r < length)
    chunk = tl.load(chunk_ptr + i_b).to(tl.int64) + i_c
    p_m = mats_ptr + (chunk * tl.num_programs(1) + i_h) * (10 * 256) + _mat_offsets()
    strict = _lower(True)
    tl.store(p_m, _inverse_unit_lower(_scaled(kk00, n0, n0, gc0, gc0, be0) * strict))
    tl.store(p_m + 256, _inverse_unit_lower(_scaled(kk11, n1, n1, gc1, gc1, be1) * strict))
    tl.store(p_m + 512, _inverse_unit_lower(_scaled(kk22, n2, n2, gc2, gc2, be2) * strict))
    tl.store(p_m + 768, _inverse_unit_lower(_scaled(kk33, n3, n3, gc3, gc3, be3) * strict))
    tl.store(p_m + 1024, _scaled(kk10, n1, n0, gc1, gc0, be1))
    tl.store(p_m + 1280, _scaled(kk20, n2, n0, gc2, gc0, be2))
    tl.store(p_m + 1536, _scaled(kk30, n3, n0, gc3, gc0, be3))
    tl.store(p_m + 1792, _scaled(kk21, n2, n1, gc2, gc1, be2))
    tl.store(p_m + 2048, _scaled(kk31, n3, n1, gc3, gc1, be3))
    tl.store(p_m + 2304, _scaled(kk32, n3, n2, gc3, gc2, be3))


@triton.jit
def _cols(k_seq, row0, length, col, stride_t, BK: tl.constexpr):
    """Raw k of rows row0..row0+16, columns col..col+BK (fp32)."""
    o_t = row0 + tl.arange(0, 16)
    o_c = col + tl.arange(0, BK)
    return tl.load(k_seq + o_t[:, None] * stride_t + o_c[None, :],
                   mask=(o_t < length)[:, None], other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def _rows16(ptr, row0, length, stride_t, i_h):
    o_t = row0 + tl.arange(0, 16)
    return tl.load(ptr + o_t * stride_t + i_h, mask=o_t < length, other=0.0)


@triton.jit
def _solve_kernel(
    k_ptr, v_ptr, b_ptr, mats_ptr, gc_ptr, kinv_ptr, w_ptr, u_ptr, cu_ptr, chunk_ptr,
    stride_kt, stride_vt, stride_gt, stride_wt, stride_ut,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Per (chunk, head): [W | U] by block forward substitution, BC columns at a time."""
    NCOL: tl.constexpr = (DK + DV) // BC
    i_c, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c0, start, length = i_c * 64, tl.load(cu_ptr + i_b), _length(cu_ptr, i_b)
    if c0 >= length:
        return
    i_k = i_h // RATIO
    k_seq, v_seq = k_ptr + start * stride_kt, v_ptr + start * stride_vt + i_h * DV
    g_seq, b_seq, n_seq = (
        gc_ptr + start * stride_gt,
        b_ptr + start * stride_gt,
        kinv_ptr + start * stride_gt,
    )
    sg = stride_gt
    gc0, gc1 = _rows16(g_seq, c0, length, sg, i_h), _rows16(g_seq, c0 + 16, length, sg, i_h)
    gc2, gc3 = _rows16(g_seq, c0 + 32, length, sg, i_h), _rows16(g_seq, c0 + 48, length, sg, i_h)
    be0, be1 = _rows16(b_seq, c0, length, sg, i_h), _rows16(b_seq, c0 + 16, length, sg, i_h)
    be2, be3 = _rows16(b_seq, c0 + 32, length, sg, i_h), _rows16(b_seq, c0 + 48, length, sg, i_h)
    n0, n1 = _rows16(n_seq, c0, length, sg, i_h), _rows16(n_seq, c0 + 16, length, sg, i_h)
    n2, n3 = _rows16(n_seq, c0 + 32, length, sg, i_h), _rows16(n_seq, c0 + 48, length, sg, i_h)
    chunk = tl.load(chunk_ptr + i_b).to(tl.int64) + i_c
    p_m = mats_ptr + (chunk * tl.num_programs(1) + i_h) * (10 * 256) + _mat_offsets()
    t0, t1, t2, t3 = tl.load(p_m), tl.load(p_m + 256), tl.load(p_m + 512), tl.load(p_m + 768)
    a10, a20, a30 = tl.load(p_m + 1024), tl.load(p_m + 1280), tl.load(p_m + 1536)
    a21, a31, a32 = tl.load(p_m + 1792), tl.load(p_m + 2048), tl.load(p_m + 2304)
    for cb in range(NCOL):
        col = cb * BC
        sk, sv = stride_kt, stride_vt
        r0 = _rhs(k_seq, v_seq, c0, length, i_k, n0, gc0, be0, col, sk, sv, DK, BC)
        r1 = _rhs(k_seq, v_seq, c0 + 16, length, i_k, n1, gc1, be1, col, sk, sv, DK, BC)
        r2 = _rhs(k_seq, v_seq, c0 + 32, length, i_k, n2, gc2, be2, col, sk, sv, DK, BC)
        r3 = _rhs(k_seq, v_seq, c0 + 48, length, i_k, n3, gc3, be3, col, sk, sv, DK, BC)
        x0 = _mm(t0, r0, PRECISION)
        x1 = _mm(t1, r1 - _mm(a10, x0, PRECISION), PRECISION)
        x2 = _mm(t2, r2 - _mm(a20, x0, PRECISION) - _mm(a21, x1, PRECISION), PRECISION)
        x3 = _mm(t3, r3 - _mm(a30, x0, PRECISION) - _mm(a31, x1, PRECISION)
                 - _mm(a32, x2, PRECISION), PRECISION)  # fmt: skip
        if col < DK:
            out, stride, out_col = w_ptr + start * stride_wt + i_h * DK, stride_wt, col
        else:
            out, stride, out_col = u_ptr + start * stride_ut + i_h * DV, stride_ut, col - DK
        _store_rows(out, c0, length, out_col, stride, x0)
        _store_rows(out, c0 + 16, length, out_col, stride, x1)
        _store_rows(out, c0 + 32, length, out_col, stride, x2)
        _store_rows(out, c0 + 48, length, out_col, stride, x3)


@triton.jit
def _norm_rows(ptr, rows, m_t, col, stride_t, scale, DK: tl.constexpr):
    """Rows of q or k [64, DK] at column offset col, L2-normalised, times scale."""
    o_dk = tl.arange(0, DK)
    b_x = tl.load(ptr + rows[:, None] * stride_t + col + o_dk[None, :], mask=m_t[:, None],
                  other=0.0).to(tl.float32)  # fmt: skip
    return b_x * (tl.rsqrt(tl.sum(b_x * b_x, axis=1) + 1e-6) * scale)[:, None]


@triton.jit
def _chunk_step(b_s, b_w, b_u, p_u, k_ptr, gc_ptr, start, c0, length, rows, m_t, i_h, i_k,
                stride_kt, stride_gt, DK: tl.constexpr, DT: tl.constexpr,
                STORE_U: tl.constexpr):  # fmt: skip
    """One chunk of the scan from its incoming state S [DK, BV] (fp32), its W rows [64, DK]
    and U columns [64, BV]: u = U - W S (STORE_U: stored at p_u), then
    S <- exp(G_last) S + (k exp(G_last - G))^T u. Returns the next S."""
    b_u -= _mm_as(b_w, b_s, DT)
    if STORE_U:
        tl.store(p_u, b_u.to(p_u.dtype.element_ty), mask=m_t[:, None])
    b_gc = tl.load(gc_ptr + rows * stride_gt + i_h, mask=m_t, other=0.0)
    g_last = tl.load(gc_ptr + (start + tl.minimum(c0 + 63, length - 1)) * stride_gt + i_h)
    b_k = _norm_rows(k_ptr, rows, m_t, i_k * DK, stride_kt, 1.0, DK)
    b_kd = b_k * tl.exp(g_last - b_gc)[:, None]
    return tl.exp(g_last) * b_s + _mm_as(tl.trans(b_kd), b_u, DT)


@triton.jit
def _segment(cu_ptr, i_b, i_seg, seg_tokens):
    """Sequence i_b's first row, its length, and the token range [begin, end) of its segment
    i_seg (segments of seg_tokens tokens, whole chunks)."""
    start = tl.load(cu_ptr + i_b)
    length = tl.load(cu_ptr + i_b + 1) - start
    begin = i_seg * seg_tokens
    return start, length, begin, tl.minimum(length, begin + seg_tokens)


@triton.jit
def _state_kernel(
    k_ptr, w_ptr, u_ptr, gc_ptr, h_ptr, state_ptr, slot_ptr, cu_ptr, chunk_ptr, x_ptr, seg_ptr,
    seg_tokens, stride_kt, stride_wt, stride_ut, stride_gt, stride_hc, stride_ss, stride_sh,
    stride_xs, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    SEGMENTED: tl.constexpr,
):  # fmt: skip
    """The sequential scan of one sequence's chunks (or, SEGMENTED, of one segment of them,
    from the incoming state `_carry_kernel` left at x[segment]). Program (segment x BV
    columns, v-head, sequence); the state S [DK, BV] stays in registers the whole way."""
    DT: tl.constexpr = u_ptr.dtype.element_ty  # dots in the stored dtype (`_mm_as`)
    NV: tl.constexpr = DV // BV
    i_sv, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_seg, i_v = i_sv // NV, i_sv % NV
    start, length, begin, end = _segment(cu_ptr, i_b, i_seg, seg_tokens)
    if SEGMENTED and begin >= length:
        return
    i_k = i_h // RATIO
    first_chunk = tl.load(chunk_ptr + i_b).to(tl.int64)
    o_dk = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, 64)
    o_s = i_h * stride_sh + o_dk[:, None] * DV + o_v[None, :]
    if SEGMENTED:
        seg = tl.load(seg_ptr + i_b).to(tl.int64) + i_seg
        b_s = tl.load(x_ptr + seg * stride_xs + o_s)
    else:
        p_s = state_ptr + tl.load(slot_ptr + i_b).to(tl.int64) * stride_ss + o_s
        b_s = tl.load(p_s)  # [DK, BV] fp32, carried in registers across all chunks
    p_h = h_ptr + first_chunk * stride_hc + i_h * DK * DV + o_dk[:, None] * DV + o_v[None, :]
    for c0 in tl.range(begin, end, 64, num_stages=2):
        tl.store(p_h + (c0 // 64) * stride_hc, b_s.to(h_ptr.dtype.element_ty))
        rows = start + c0 + o_t
        m_t = (c0 + o_t) < length
        b_w = tl.load(w_ptr + rows[:, None] * stride_wt + i_h * DK + o_dk[None, :],
                      mask=m_t[:, None], other=0.0)  # fmt: skip
        p_u = u_ptr + rows[:, None] * stride_ut + i_h * DV + o_v[None, :]
        b_u = tl.load(p_u, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_s = _chunk_step(b_s, b_w, b_u, p_u, k_ptr, gc_ptr, start, c0, length, rows, m_t, i_h,
                          i_k, stride_kt, stride_gt, DK, DT, True)  # fmt: skip
    if not SEGMENTED:
        tl.store(p_s, b_s)


@triton.jit
def _segment_kernel(
    k_ptr, w_ptr, u_ptr, gc_ptr, e_ptr, cu_ptr, seg_ptr, seg_tokens,
    stride_kt, stride_wt, stride_ut, stride_gt, stride_es,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """First pass of the segmented scan, all segments in parallel. Across a chunk the state
    maps as S -> A S + B (A = exp(G_last) I - K^T W [DK, DK], B = K^T U), so across a segment
    S_end = M S_begin + E with M the product of its A's. One program scans BV columns of
    [E | M] from [0 | I] over its segment (the M columns see U = 0, nothing is stored on
    the way) and writes them to e[segment]."""
    DT: tl.constexpr = u_ptr.dtype.element_ty
    NB: tl.constexpr = (DV + DK) // BV
    i_sb, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_seg, i_c = i_sb // NB, i_sb % NB
    start, length, begin, end = _segment(cu_ptr, i_b, i_seg, seg_tokens)
    if begin >= length:
        return
    i_k = i_h // RATIO
    o_dk = tl.arange(0, DK)
    o_c = i_c * BV + tl.arange(0, BV)  # columns of [E | M]
    o_t = tl.arange(0, 64)
    b_s = tl.where(o_dk[:, None] == o_c[None, :] - DV, 1.0, 0.0)  # [0 | I]
    for c0 in tl.range(begin, end, 64, num_stages=2):
        rows = start + c0 + o_t
        m_t = (c0 + o_t) < length
        b_w = tl.load(w_ptr + rows[:, None] * stride_wt + i_h * DK + o_dk[None, :],
                      mask=m_t[:, None], other=0.0)  # fmt: skip
        b_u = tl.load(u_ptr + rows[:, None] * stride_ut + i_h * DV + o_c[None, :],
                      mask=m_t[:, None] & (o_c < DV)[None, :], other=0.0).to(tl.float32)
        b_s = _chunk_step(b_s, b_w, b_u, None, k_ptr, gc_ptr, start, c0, length, rows, m_t,
                          i_h, i_k, stride_kt, stride_gt, DK, DT, False)  # fmt: skip
    seg = tl.load(seg_ptr + i_b).to(tl.int64) + i_seg
    tl.store(e_ptr + seg * stride_es + i_h * DK * (DV + DK) + o_dk[:, None] * (DV + DK)
             + o_c[None, :], b_s)  # fmt: skip


@triton.jit
def _carry_kernel(
    e_ptr, x_ptr, state_ptr, slot_ptr, cu_ptr, seg_ptr, seg_tokens,
    stride_es, stride_xs, stride_ss, stride_sh,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Second pass, sequential over a sequence's segments (few): x[segment] = the state
    entering it, S <- M S + E from the first segment's incoming state (the pool's) to the
    last one's outgoing state, written back to the pool. Program (BV columns, v-head,
    sequence)."""
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = _length(cu_ptr, i_b)
    first = tl.load(seg_ptr + i_b).to(tl.int64)
    o_dk = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_s = i_h * stride_sh + o_dk[:, None] * DV + o_v[None, :]
    p_s = state_ptr + tl.load(slot_ptr + i_b).to(tl.int64) * stride_ss + o_s
    b_s = tl.load(p_s)
    p_e = e_ptr + first * stride_es + i_h * DK * (DV + DK) + o_dk[:, None] * (DV + DK)
    for i in range(0, tl.cdiv(length, seg_tokens)):
        tl.store(x_ptr + (first + i) * stride_xs + o_s, b_s)
        b_m = tl.load(p_e + i * stride_es + DV + o_dk[None, :])
        b_s = _mm(b_m, b_s, PRECISION) + tl.load(p_e + i * stride_es + o_v[None, :])
    tl.store(p_s, b_s)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, u_ptr, gc_ptr, h_ptr, o_ptr, cu_ptr, chunk_ptr,
    stride_qt, stride_ut, stride_gt, stride_hc, stride_ot,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    DT: tl.constexpr = u_ptr.dtype.element_ty  # dots in the stored dtype (`_mm_as`)
    NV: tl.constexpr = DV // BV
    i_cv, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c0 = (i_cv // NV) * 64
    o_v = (i_cv % NV) * BV + tl.arange(0, BV)
    start = tl.load(cu_ptr + i_b)
    length = tl.load(cu_ptr + i_b + 1) - start
    if c0 >= length:
        return
    i_k = i_h // RATIO
    chunk = tl.load(chunk_ptr + i_b).to(tl.int64) + c0 // 64
    o_t = tl.arange(0, 64)
    o_dk = tl.arange(0, DK)
    rows = start + c0 + o_t
    m_t = (c0 + o_t) < length
    b_q = _norm_rows(q_ptr, rows, m_t, i_k * DK, stride_qt, 1.0 / tl.sqrt(DK * 1.0), DK)
    b_k = _norm_rows(k_ptr, rows, m_t, i_k * DK, stride_qt, 1.0, DK)  # k is laid out like q
    b_gc = tl.load(gc_ptr + rows * stride_gt + i_h, mask=m_t, other=0.0)
    b_h = tl.load(h_ptr + chunk * stride_hc + i_h * DK * DV + o_dk[:, None] * DV
                  + o_v[None, :]).to(tl.float32)  # fmt: skip
    b_u = tl.load(u_ptr + rows[:, None] * stride_ut + i_h * DV + o_v[None, :],
                  mask=m_t[:, None], other=0.0).to(tl.float32)  # fmt: skip
    causal = o_t[:, None] >= o_t[None, :]
    decay = tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], float("-inf")))
    b_qk = _mm_as(b_q, tl.trans(b_k), DT) * decay
    b_o = tl.exp(b_gc)[:, None] * _mm_as(b_q, b_h, DT) + _mm_as(b_qk, b_u, DT)
    tl.store(o_ptr + rows[:, None] * stride_ot + i_h * DV + o_v[None, :],
             b_o.to(o_ptr.dtype.element_ty), mask=m_t[:, None])  # fmt: skip


CHUNK = 64  # tokens per chunk


def first_chunks(seq_lens: list[int]) -> list[int]:
    """Where each sequence's chunks start in the per-chunk buffers (host side): the running
    sum of ceil(length / CHUNK)."""
    starts = [0]
    for n in seq_lens[:-1]:
        starts.append(starts[-1] + -(-n // CHUNK))
    return starts


def _first_blocks(cu_seqlens: torch.Tensor, block: int) -> torch.Tensor:
    """`first_chunks` on the device for blocks of `block` tokens (int32 [B], no sync): where
    each sequence's blocks start when every sequence's blocks are numbered back to back."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.zeros(lengths.numel(), dtype=torch.int32, device=cu_seqlens.device)
    starts[1:] = torch.cumsum(triton.cdiv(lengths, block), 0)[:-1].to(torch.int32)
    return starts


@dataclass(frozen=True)
class ChunkTiles:
    """Launch shapes of the four kernels: warps, [W | U] columns per solve step (solve_bc),
    state columns per program of the sequential kernel (state_bv), output columns per program
    (output_bv). Measured on the H200, the whole function for one layer at 8K / 32K tokens,
    one change at a time from state_bv 16 and an 8-warp output: 1.01 / 3.99 ms; state_bv 32
    0.93 / 3.65; output 4 warps 0.91 / 3.51; state_bv 8 1.16 / 4.68; blocks 8 warps 1.24 /
    4.88; the solve variants within noise. Both winners together: not yet measured.
    segment_chunks: chunks per segment of a scan parallel over segments for sequences
    longer than one segment (0: one sequential scan per sequence; not yet timed)."""

    blocks_warps: int = 4
    solve_bc: int = 32
    solve_warps: int = 4
    state_bv: int = 32
    state_warps: int = 8
    output_bv: int = 64
    output_warps: int = 4
    segment_chunks: int = 0


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    max_len: int | None = None,
    tiles: ChunkTiles = ChunkTiles(),
    chunk_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] (log-decay, write strength);
    sequences back to back (cu_seqlens [B + 1] int32); states: [S, Hv, Dk, Dv] fp32 pool, each
    sequence starts from states[slots[b]] and its final state is written back there.
    max_len bounds the longest sequence (default T; known on the host, no device read).
    chunk_starts: `first_chunks` of the sequence lengths as int32 [B] on the device (computed
    here from cu_seqlens if not given: six small kernels, per layer).
    Returns o: [T, Hv, Dv] in v's dtype. q/k are L2-normalised and q scaled by Dk^-0.5 here."""
    t, hk, dk = q.shape
    _, hv, dv = v.shape
    if k.shape != q.shape or g.shape != (t, hv) or beta.shape != (t, hv) or hv % hk:
        raise ValueError(
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, "
            f"beta {list(beta.shape)}: expected k like q, g and beta [T, Hv], Hv % Hk == 0"
        )
    if states.shape[1:] != (hv, dk, dv) or states.dtype != torch.float32:
        raise ValueError(f"states {list(states.shape)} must be fp32 [S, {hv}, {dk}, {dv}]")
    # q, k, v may be views of the conv output (rows of 2 Hk Dk + Hv Dv): the kernels take a
    # token stride (q and k share one) and need each row's heads packed
    rows_packed = all(x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] for x in (q, k, v))
    if not rows_packed or q.stride(0) != k.stride(0):
        q, k, v = (x.contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    bsz = cu_seqlens.numel() - 1
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # W and U in the activation dtype (bf16 in the model), the cumulative decay in fp32
    w = torch.empty(t, hv, dk, device=q.device, dtype=v.dtype)
    u = torch.empty(t, hv, dv, device=q.device, dtype=v.dtype)
    gc = torch.empty(t, hv, device=q.device, dtype=torch.float32)
    kinv = torch.empty(t, hv, device=q.device, dtype=torch.float32)
    first_chunk = chunk_starts if chunk_starts is not None else _first_blocks(cu_seqlens, CHUNK)
    chunk_slots, chunks = t // 64 + bsz, triton.cdiv(max_len or t, 64)
    mats = torch.empty(chunk_slots, hv, 10, 16, 16, device=q.device, dtype=torch.float32)
    _blocks_kernel[(chunks, hv, bsz)](
        k, g, beta, mats, gc, kinv, cu_seqlens, first_chunk, k.stride(0), g.stride(0),
        RATIO=hv // hk, DK=dk, num_warps=tiles.blocks_warps,
    )  # fmt: skip
    _solve_kernel[(chunks, hv, bsz)](
        k, v, beta, mats, gc, kinv, w, u, cu_seqlens, first_chunk,
        k.stride(0), v.stride(0), g.stride(0), w.stride(0), u.stride(0),
        RATIO=hv // hk, DK=dk, DV=dv, BC=min(tiles.solve_bc, dk, dv), PRECISION=precision,
        num_warps=tiles.solve_warps,
    )  # fmt: skip
    h = torch.empty(chunk_slots, hv, dk, dv, device=q.device, dtype=v.dtype)
    _scan(k, w, u, gc, h, states, slots, cu_seqlens, first_chunk, max_len or t, precision,
          tiles)  # fmt: skip
    o = torch.empty(t, hv, dv, device=q.device, dtype=v.dtype)
    out_v = min(tiles.output_bv, dv)
    _output_kernel[(chunks * (dv // out_v), hv, bsz)](
        q, k, u, gc, h, o, cu_seqlens, first_chunk,
        q.stride(0), u.stride(0), gc.stride(0), h.stride(0), o.stride(0),
        RATIO=hv // hk, DK=dk, DV=dv, BV=out_v, num_warps=tiles.output_warps,
    )  # fmt: skip
    return o


def _scan(k, w, u, gc, h, states, slots, cu_seqlens, first_chunk, max_len, precision,
          tiles: ChunkTiles):  # fmt: skip
    """The state scan (kernel 3): h[chunk] = each chunk's incoming state, u = U - W S in
    place of U, the final states back to the pool. One sequential pass per sequence, or with
    tiles.segment_chunks, segments of that many chunks scanned in parallel (`_segment_kernel`,
    `_carry_kernel`, then `_state_kernel` per segment)."""
    t, hv, dk = w.shape
    dv = u.shape[2]
    bsz = cu_seqlens.numel() - 1
    block_v = min(tiles.state_bv, dv)
    seg_tokens = tiles.segment_chunks * CHUNK
    segmented = 0 < seg_tokens < max_len
    strides = (k.stride(0), w.stride(0), u.stride(0), gc.stride(0))
    meta = {"RATIO": hv // k.shape[1], "DK": dk, "DV": dv}
    if not segmented:
        _state_kernel[(dv // block_v, hv, bsz)](
            k, w, u, gc, h, states, slots, cu_seqlens, first_chunk, None, first_chunk,
            max(t, 1), *strides, h.stride(0), states.stride(0), states.stride(1), 0,
            BV=block_v, SEGMENTED=False, num_warps=tiles.state_warps, **meta,
        )  # fmt: skip
        return
    first_seg = _first_blocks(cu_seqlens, seg_tokens)
    seg_slots, segs = t // seg_tokens + bsz, triton.cdiv(max_len, seg_tokens)
    e = torch.empty(seg_slots, hv, dk, dv + dk, device=k.device, dtype=torch.float32)
    x = torch.empty(seg_slots, hv, dk, dv, device=k.device, dtype=torch.float32)
    block_e = min(block_v, dk)  # divides both DV and DK
    _segment_kernel[(segs * (dv + dk) // block_e, hv, bsz)](
        k, w, u, gc, e, cu_seqlens, first_seg, seg_tokens, *strides, e.stride(0),
        BV=block_e, num_warps=tiles.state_warps, **meta,
    )  # fmt: skip
    _carry_kernel[(dv // block_v, hv, bsz)](
        e, x, states, slots, cu_seqlens, first_seg, seg_tokens, e.stride(0), x.stride(0),
        states.stride(0), states.stride(1), DK=dk, DV=dv, BV=block_v, PRECISION=precision,
        num_warps=tiles.state_warps, num_stages=1,  # M is 64 KB: one copy in shared memory
    )  # fmt: skip
    _state_kernel[(segs * (dv // block_v), hv, bsz)](
        k, w, u, gc, h, states, slots, cu_seqlens, first_chunk, x, first_seg, seg_tokens,
        *strides, h.stride(0), states.stride(0), states.stride(1), x.stride(0),
        BV=block_v, SEGMENTED=True, num_warps=tiles.state_warps, **meta,
    )  # fmt: skip
