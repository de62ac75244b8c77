"""Chunked gated delta rule for prefill (chunks of 64), varlen batches, states in a pool.

Per chunk (see naive.py for the algebra), with G the cumulative log-decay from the chunk
start and S0 the incoming state, the delta rule's writes u solve

    (I + A) u = beta * (v - exp(G) k S0),  A[t, s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)

so u = U - W S0 with U = (I + A)^-1 (beta v) and W = (I + A)^-1 (beta exp(G) k), which do not
depend on the state. Three kernels, only the second sequential:

1. `_wy_kernel`, one program per (chunk, v-head), all in parallel: k k^T as one 64x64 dot,
   the inverse k row norms ([T, Hk]) from its diagonal, G and A; T = (I + A)^-1 as one
   64x64 (the four 16x16 diagonal blocks inverted by doubling as one batch,
   `_inverse_unit_lower`, then block forward substitution on the identity's row blocks, the
   blocks taken from registers by reshapes and splits); then W and U as T times the chunk's
   k and v rows (their row factors folded into T's columns), `ChunkTiles.wy_bc` columns at
   a time.
2. `_state_kernel`, sequential over a sequence's chunks, one program per (sequence, v-head,
   BV columns of the state), the state S [Dk, BV] in registers the whole way: it stores each
   chunk's incoming state, then  u = U - W S  (in place of U)  and
   S = exp(G_last) S + k^T (u * exp(G_last - G) / |k|).  Two small dots per chunk; the k
   row norms come from the first kernel, and k enters the second dot as loaded (its row factors
   scale u's rows), so nothing but the dots and the decay sits on the sequential path.
   A state inside a sequence that prefix caching keeps (`save_rows`, `save_at`) is the same
   update cut off after its token, one more dot in the chunk that holds it, stored from the
   fp32 state in registers.
3. `_output_kernel`, parallel again, one program per (chunk, q/k head):
   o = exp(G) q S_c + ((q k^T) * exp(G_t - G_s), s <= t) u, q k^T once for its v-heads and
   their decayed causal parts once for all of a v-head's column blocks.

L2-norm and scale of q/k are fused in. Sequence b's chunks use the per-chunk buffer slots
from cu_seqlens[b] // 64 + b on (`_first_chunk`): unique without a prefix sum over the
lengths, and below T // 64 + B. W, U, u and the per-chunk states are stored in the
activation dtype (bf16 in the model: half the traffic; fp32 in the exactness tests). Dots use
tensor cores for 16-bit inputs (tf32 in the inverses and for T; T k, T v and the state and
output dots round their operands to the stored dtype, as W, U and the chunk states already
are, and as flash-linear-attention rounds its (I + A)^-1) and exact fp32 (`ieee`) for fp32
inputs; the carried state and the decay math are fp32 (the state pool fp32 or bf16: loaded
once per sequence, stored once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparrow.kernels.causal_conv1d.conv import saves_per_sequence
from sparrow.kernels.launch import fast


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
def _diagonal_blocks(a):
    """The four 16x16 diagonal blocks of a [64, 64] as a batch [4, 16, 16]."""
    i4 = tl.arange(0, 4)
    same = (i4[:, None] == i4[None, :])[:, None, :, None]
    return tl.sum(tl.where(same, tl.reshape(a, [4, 16, 4, 16]), 0.0), axis=2)


@triton.jit
def _inverse_unit_lower(a, PRECISION: tl.constexpr):
    """(I + a)^-1 for a batch of strictly lower triangular blocks a [N, 16, 16], by doubling
    inverted diagonal blocks: with D the inverse of the block diagonal of I + a in blocks of
    size b and F the part of a below the diagonal blocks inside each block of size 2b, those
    2b-blocks are D^-1 + F, and (D^-1 + F)^-1 = D - D F D (F D F vanishes). b = 1 gives
    I - F, then b = 2, 4, 8 two batched products each at PRECISION. Every factor is a block
    of a or of the inverse, so nothing cancels. (The nilpotent series (I - a)(I + a^2)
    (I + a^4)(I + a^8), the same six products, builds powers of a whose entries reach
    C(15, 7) = 6435 times a's for keys that repeat within the block, and cancels them: in
    tf32 it returned inverses off by 0.58 of their largest entry, in fp32 by 5e-4; the
    prefill of a repeating key in bf16 on the H200 came out 1e21 times too large. Same time:
    2,019 vs 2,012 us at 32K tokens.)"""
    o = tl.arange(0, 16)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)[None, :, :]
    d = eye - tl.where((o[:, None] // 2 == o[None, :] // 2)[None, :, :], a, 0.0)
    d = _double_inverse(d, a, 2, PRECISION)
    d = _double_inverse(d, a, 4, PRECISION)
    return _double_inverse(d, a, 8, PRECISION)


@triton.jit
def _double_inverse(d, a, B: tl.constexpr, PRECISION: tl.constexpr):
    """The inverse of I + a in diagonal blocks of 2B from d, its inverse in blocks of B
    (batches [N, 16, 16])."""
    o = tl.arange(0, 16)
    inside = o[:, None] // (2 * B) == o[None, :] // (2 * B)
    f = tl.where((inside & (o[:, None] // B != o[None, :] // B))[None, :, :], a, 0.0)
    df = tl.dot(d, f, input_precision=PRECISION)
    return d - tl.dot(df, d, input_precision=PRECISION)


@triton.jit
def _length(cu_ptr, i_b):
    return tl.load(cu_ptr + i_b + 1) - tl.load(cu_ptr + i_b)


@triton.jit
def _first_chunk(cu_ptr, i_b):
    """Sequence i_b's first slot in the per-chunk buffers: cu_seqlens[b] // 64 + b. Sequence
    b needs ceil(L_b / 64) slots and cu[b] // 64 + ceil(L_b / 64) <= cu[b + 1] // 64 + 1, so
    no two sequences share one; all lie below T // 64 + B."""
    return (tl.load(cu_ptr + i_b) // 64 + i_b).to(tl.int64)


@triton.jit
def _split4(x):
    """x [16, 16, 4] -> its four [16, 16] slices x[..., 0], .., x[..., 3]."""
    lo, hi = tl.split(tl.reshape(x, [16, 16, 2, 2]))  # lo: slices 0 and 2; hi: 1 and 3
    x0, x2 = tl.split(lo)
    x1, x3 = tl.split(hi)
    return x0, x1, x2, x3


@triton.jit
def _blocks_below(a):
    """The six 16x16 blocks (i, j), i > j, of a [64, 64]: a10, a20, a30, a21, a31, a32."""
    b = tl.permute(tl.reshape(a, [4, 16, 4, 16]), (1, 3, 0, 2))  # [r, c, i, j]
    lo, hi = tl.split(tl.reshape(b, [16, 16, 4, 2, 2]))  # lo: j = 0 and 2; hi: j = 1 and 3
    col0, col2 = tl.split(lo)
    col1, _ = tl.split(hi)
    _, a10, a20, a30 = _split4(col0)
    _, _, a21, a31 = _split4(col1)
    _, _, _, a32 = _split4(col2)
    return a10, a20, a30, a21, a31, a32


@triton.jit
def _eye_rows(j: tl.constexpr):
    """Rows 16 j .. 16 j + 15 of the 64x64 identity."""
    o_r, o_c = tl.arange(0, 16), tl.arange(0, 64)
    return tl.where(o_r[:, None] + 16 * j == o_c[None, :], 1.0, 0.0)


@triton.jit
def _stack4(x0, x1, x2, x3):
    """Four [16, N] row blocks as one [64, N]."""
    x = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [16, N, 2, 2]: x[r, c, b, a] = x_{2a + b}
    return tl.reshape(tl.permute(x, (3, 2, 0, 1)), (64, x0.shape[1]))


@triton.jit
def _chunk_inverse(a, INV_PRECISION: tl.constexpr, PRECISION: tl.constexpr):
    """(I + a)^-1 for a strictly lower triangular [64, 64]: the four 16x16 diagonal blocks
    inverted as one batch (`_inverse_unit_lower`, INV_PRECISION), then block forward
    substitution on the identity's row blocks (PRECISION)."""
    t0, t1, t2, t3 = _split4(
        tl.permute(_inverse_unit_lower(_diagonal_blocks(a), INV_PRECISION), (1, 2, 0))
    )
    a10, a20, a30, a21, a31, a32 = _blocks_below(a)
    x0 = _mm(t0, _eye_rows(0), PRECISION)
    x1 = _mm(t1, _eye_rows(1) - _mm(a10, x0, PRECISION), PRECISION)
    x2 = _mm(t2, _eye_rows(2) - _mm(a20, x0, PRECISION) - _mm(a21, x1, PRECISION), PRECISION)
    x3 = _mm(
        t3,
        _eye_rows(3) - _mm(a30, x0, PRECISION) - _mm(a31, x1, PRECISION) - _mm(a32, x2, PRECISION),
        PRECISION,
    )
    return _stack4(x0, x1, x2, x3)


@triton.jit
def _times_rows(
    t,
    x_ptr,
    stride_xt,
    y_ptr,
    stride_yt,
    rows,
    m_t,
    D: tl.constexpr,
    BC: tl.constexpr,
    DT: tl.constexpr,
):
    """y[rows] = t x[rows] for one chunk's 64 rows of D columns, BC columns at a time, the
    dot in DT (`_mm_as`)."""
    o_c = tl.arange(0, BC)
    for col in range(0, D, BC):
        b_x = tl.load(
            x_ptr + rows[:, None] * stride_xt + col + o_c[None, :], mask=m_t[:, None], other=0.0
        )
        b_y = _mm_as(t, b_x, DT)
        tl.store(
            y_ptr + rows[:, None] * stride_yt + col + o_c[None, :],
            b_y.to(y_ptr.dtype.element_ty),
            mask=m_t[:, None],
        )


@triton.jit
def _wy_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    gc_ptr,
    kinv_ptr,
    w_ptr,
    u_ptr,
    cu_ptr,
    stride_kt,
    stride_vt,
    stride_gt,
    stride_nt,
    stride_wt,
    stride_ut,
    RATIO: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BC: tl.constexpr,
    INV_PRECISION: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per (chunk, v-head): k k^T as one dot, the inverse k row norms from its diagonal
    (stored by the first of the RATIO v-heads that read them), G, A, T = (I + A)^-1, then
    W = T diag(beta exp(G) / |k|) k and U = T diag(beta) v, BC columns at a time, as dots in
    the stored dtype (`_mm_as`)."""
    i_c, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c0, start, length = i_c * 64, tl.load(cu_ptr + i_b), _length(cu_ptr, i_b)
    if c0 >= length:
        return
    DT: tl.constexpr = k_ptr.dtype.element_ty
    i_k = i_h // RATIO
    o_t = tl.arange(0, 64)
    rows = start + c0 + o_t
    m_t = (c0 + o_t) < length
    b_k = tl.load(
        k_ptr + rows[:, None] * stride_kt + i_k * DK + tl.arange(0, DK)[None, :],
        mask=m_t[:, None],
        other=0.0,
    )
    kk = _mm_as(b_k, tl.trans(b_k), DT)
    squares = tl.where(o_t[:, None] == o_t[None, :], kk, 0.0)
    n_row = tl.rsqrt(tl.sum(squares, axis=1) + 1e-6)
    n_col = tl.rsqrt(tl.sum(squares, axis=0) + 1e-6)
    if i_h % RATIO == 0:
        tl.store(kinv_ptr + rows * stride_nt + i_k, n_row, mask=m_t)
    b_beta = tl.load(b_ptr + rows * stride_gt + i_h, mask=m_t, other=0.0)
    b_gc = tl.cumsum(tl.load(g_ptr + rows * stride_gt + i_h, mask=m_t, other=0.0), axis=0)
    tl.store(gc_ptr + rows * stride_gt + i_h, b_gc, mask=m_t)
    decay = tl.exp(tl.minimum(b_gc[:, None] - b_gc[None, :], 0.0))
    a = tl.where(
        o_t[:, None] > o_t[None, :], kk * (b_beta * n_row)[:, None] * n_col[None, :] * decay, 0.0
    )
    t = _chunk_inverse(a, INV_PRECISION, PRECISION)
    _times_rows(
        t * (b_beta * tl.exp(b_gc) * n_row)[None, :],
        k_ptr + i_k * DK,
        stride_kt,
        w_ptr + i_h * DK,
        stride_wt,
        rows,
        m_t,
        DK,
        BC,
        DT,
    )  # W
    _times_rows(
        t * b_beta[None, :],
        v_ptr + i_h * DV,
        stride_vt,
        u_ptr + i_h * DV,
        stride_ut,
        rows,
        m_t,
        DV,
        BC,
        DT,
    )  # U


@triton.jit
def _norm_rows(ptr, rows, m_t, col, stride_t, scale, DK: tl.constexpr):
    """Rows of q or k [64, DK] at column offset col, L2-normalised, times scale."""
    o_dk = tl.arange(0, DK)
    b_x = tl.load(
        ptr + rows[:, None] * stride_t + col + o_dk[None, :], mask=m_t[:, None], other=0.0
    ).to(tl.float32)
    return b_x * (tl.rsqrt(tl.sum(b_x * b_x, axis=1) + 1e-6) * scale)[:, None]


@triton.jit
def _save_inside(p_row, b_s, p_k, b_u, b_n, b_gc, gc_seq, stride_gt, c0, at, DT: tl.constexpr):
    """If the state after the sequence's first `at` tokens falls in the chunk from c0
    (m = at - c0 in (0, 64]), store it at p_row: the chunk's update with the decay to row
    m - 1 and rows m on left out (their u does not enter rows before them). k is loaded here
    again (p_k, the chunk's rows): with the scan's own k tile (a pipelined, asynchronous
    load) this branch stored states without their k^T u term on an H100, the likely cause
    a read of the tile before its copy had landed."""
    m = at - c0
    if (m > 0) & (m <= 64):
        b_k = tl.load(p_k)
        g_m = tl.load(gc_seq + (c0 + m - 1) * stride_gt)
        # rows from m on decay by more than row m - 1: their exponent is cut at 0
        b_f = tl.where(tl.arange(0, 64) < m, b_n * tl.exp(tl.minimum(g_m - b_gc, 0.0)), 0.0)
        b_m = tl.exp(g_m) * b_s + _mm_as(tl.trans(b_k), b_u * b_f[:, None], DT)
        tl.store(p_row, b_m.to(p_row.dtype.element_ty))


@triton.jit
def _state_kernel(
    k_ptr,
    w_ptr,
    u_ptr,
    gc_ptr,
    kinv_ptr,
    h_ptr,
    state_ptr,
    slot_ptr,
    save_row_ptr,
    save_at_ptr,
    cu_ptr,
    stride_kt,
    stride_wt,
    stride_ut,
    stride_gt,
    stride_nt,
    stride_hc,
    stride_ss,
    stride_sh,
    RATIO: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    STAGES: tl.constexpr,
    SAVES: tl.constexpr,
):
    """The sequential scan of one sequence's chunks. Program (BV columns, v-head, sequence);
    the state S [DK, BV] stays in registers in fp32 the whole way (loaded from and stored to
    an fp32 or bf16 pool). SAVES states inside the sequence go to other rows of the pool
    (`_save_inside`, in the chunk that holds each)."""
    DT: tl.constexpr = u_ptr.dtype.element_ty  # dots in the stored dtype (`_mm_as`)
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, length = tl.load(cu_ptr + i_b), _length(cu_ptr, i_b)
    i_k = i_h // RATIO
    o_dk = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, 64)
    o_s = i_h * stride_sh + o_dk[:, None] * DV + o_v[None, :]  # in a row of the pool
    p_s = state_ptr + tl.load(slot_ptr + i_b).to(tl.int64) * stride_ss + o_s
    b_s = tl.load(p_s).to(tl.float32)  # [DK, BV], carried in registers across all chunks
    p_h = (
        h_ptr
        + _first_chunk(cu_ptr, i_b) * stride_hc
        + i_h * DK * DV
        + o_dk[:, None] * DV
        + o_v[None, :]
    )
    w_seq = w_ptr + start * stride_wt + i_h * DK + o_dk[None, :]
    k_seq = k_ptr + start * stride_kt + i_k * DK + o_dk[None, :]
    u_seq = u_ptr + start * stride_ut + i_h * DV + o_v[None, :]
    for c0 in tl.range(0, length, 64, num_stages=STAGES):
        tl.store(p_h + (c0 // 64) * stride_hc, b_s.to(h_ptr.dtype.element_ty))
        # rows past the sequence's end repeat its last row: unmasked loads, and their u rows
        # (stored to the last row again, the same values) get a zero factor below
        t = tl.minimum(c0 + o_t, length - 1)
        b_w = tl.load(w_seq + t[:, None] * stride_wt)
        b_u = tl.load(u_seq + t[:, None] * stride_ut).to(tl.float32)
        # k rows as stored (the MMA reads them transposed where they were loaded); their
        # factors (1 / |k| and the decay to the chunk's end) scale the rows of u instead
        b_gc = tl.load(gc_ptr + (start + t) * stride_gt + i_h)
        b_n = tl.load(kinv_ptr + (start + t) * stride_nt + i_k)
        g_last = tl.load(gc_ptr + (start + tl.minimum(c0 + 63, length - 1)) * stride_gt + i_h)
        b_k = tl.load(k_seq + t[:, None] * stride_kt)
        b_f = tl.where(c0 + o_t < length, b_n * tl.exp(g_last - b_gc), 0.0)
        b_u -= _mm_as(b_w, b_s, DT)  # u = U - W S
        tl.store(u_seq + t[:, None] * stride_ut, b_u.to(u_ptr.dtype.element_ty))
        for i_s in tl.static_range(SAVES):
            row = tl.load(save_row_ptr + i_b * SAVES + i_s).to(tl.int64)
            if row >= 0:
                _save_inside(
                    state_ptr + row * stride_ss + o_s,
                    b_s,
                    k_seq + t[:, None] * stride_kt,
                    b_u,
                    b_n,
                    b_gc,
                    gc_ptr + start * stride_gt + i_h,
                    stride_gt,
                    c0,
                    tl.load(save_at_ptr + i_b * SAVES + i_s),
                    DT,
                )
        b_s = tl.exp(g_last) * b_s + _mm_as(tl.trans(b_k), b_u * b_f[:, None], DT)
    tl.store(p_s, b_s.to(state_ptr.dtype.element_ty))


@triton.jit
def _output_kernel(
    q_ptr,
    k_ptr,
    u_ptr,
    gc_ptr,
    kinv_ptr,
    h_ptr,
    o_ptr,
    cu_ptr,
    stride_qt,
    stride_ut,
    stride_gt,
    stride_nt,
    stride_hc,
    stride_ot,
    RATIO: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
):
    """Per (chunk, q/k head): q k^T once, then for each of the RATIO v-heads that read them
    its decayed causal part once and the output BV columns at a time."""
    DT: tl.constexpr = u_ptr.dtype.element_ty  # dots in the stored dtype (`_mm_as`)
    i_c, i_k, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c0 = i_c * 64
    start = tl.load(cu_ptr + i_b)
    length = tl.load(cu_ptr + i_b + 1) - start
    if c0 >= length:
        return
    chunk = _first_chunk(cu_ptr, i_b) + i_c
    o_t = tl.arange(0, 64)
    o_dk = tl.arange(0, DK)
    o_bv = tl.arange(0, BV)
    rows = start + c0 + o_t
    m_t = (c0 + o_t) < length
    b_q = _norm_rows(q_ptr, rows, m_t, i_k * DK, stride_qt, 1.0 / tl.sqrt(DK * 1.0), DK)
    b_k = tl.load(
        k_ptr + rows[:, None] * stride_qt + i_k * DK + o_dk[None, :], mask=m_t[:, None], other=0.0
    ).to(tl.float32)  # k is laid out like q
    b_k *= tl.load(kinv_ptr + rows * stride_nt + i_k, mask=m_t, other=0.0)[:, None]
    b_qk = _mm_as(b_q, tl.trans(b_k), DT)
    b_q = b_q.to(DT)
    causal = o_t[:, None] >= o_t[None, :]
    for r in range(RATIO):
        i_h = i_k * RATIO + r
        b_gc = tl.load(gc_ptr + rows * stride_gt + i_h, mask=m_t, other=0.0)
        decay = tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], float("-inf")))
        b_p = (b_qk * decay).to(DT)
        b_e = tl.exp(b_gc)[:, None]
        p_h = h_ptr + chunk * stride_hc + i_h * DK * DV + o_dk[:, None] * DV + o_bv[None, :]
        p_u = u_ptr + rows[:, None] * stride_ut + i_h * DV + o_bv[None, :]
        p_o = o_ptr + rows[:, None] * stride_ot + i_h * DV + o_bv[None, :]
        for v0 in range(0, DV, BV):
            b_h = tl.load(p_h + v0)
            b_u = tl.load(p_u + v0, mask=m_t[:, None], other=0.0)
            b_o = b_e * _mm_as(b_q, b_h, DT) + _mm_as(b_p, b_u, DT)
            tl.store(p_o + v0, b_o.to(o_ptr.dtype.element_ty), mask=m_t[:, None])


@dataclass(frozen=True)
class ChunkTiles:
    """Launch shapes of the three kernels. Measured on the H200: the whole function for one
    layer, bf16, one sequence of 2K / 8K / 32K tokens, in graphs, variants alternating in one
    run (`bench.gdn`; the function 375 / 1,489 us at 8K / 32K).

    Slower, each against the same run's defaults: a scan parallel over segments of 4-32
    chunks (each segment's affine map S -> M S + E in parallel, a carry across segments, then
    the scan per segment) 1.5-1.7x at 512 to 32K tokens (1.30 against 0.83 ms at 8K, 4.94
    against 3.18 at 32K: the M products cost more than the sequential steps they save); the
    scan on the transposed state (S^T [BV, DK] carried, both products with the
    state-dependent operand from registers: mma.sync, 9 barriers a step instead of 20), scan
    kernel 72.9 / 285 / 1,124 against 54.9 / 206 / 794 us; the output computed inside the
    scan (q S and the decayed q k^T u per step) 399.7 us at 8K against 166.0 + 137.8 apart;
    one sequence in 2-8 pieces on two streams, 2.36-2.45 ms against 2.37 at 32K and slower
    at 2K and 8K (the kernels slow each other down: the scan 755 -> 1,035 us in 4 pieces),
    the scan in pieces beside each piece's output at best 3% faster at 32K; states of every other
    chunk only (the output kernel deriving the rest) 1.902 against 1.769 ms at 32K; the ten
    16x16 blocks of A in fp16 or bf16 1.787 against 1.778 ms; T k and T v in tf32 680
    against 364 us for that step at 32K (fp32 operands through shared memory); the whole
    64x64 I + A inverted by doubling (two more doublings on 64x64 products) with [W | U] =
    T [k | v] as 64x64 dots, 184.7 / 731.7 us at 8K / 32K against 179.9 / 692.4 for the
    blocks and the solve in two kernels (145.6 / 596.5 with the last product in bf16, errors
    up to 1.5x larger). A step of the
    scan moves about 2.8 MB through HBM (W, U, k in; h, u out: 1.8 TB/s at 1.55 us a step)
    and 6 MB between L2 and the SMs: memory traffic, not only the chain of two products, sets
    the step's time. The scan two chunks a step (three dependent products a pair instead of
    four) matches the recurrence in fp32, but Triton 3.6 compiles its bf16 form wrong
    (outputs off by 0.58 from the second chunk at one stage, an illegal address at two).

    What the kernels do, against their alternatives: the scan reads k as stored with its row
    factors on u (k scaled and decayed in fp32 and staged transposed through shared memory
    instead: sm_90 loop body 810 against 515 instructions, 173 against 128 registers; scan
    kernel 54.9 / 207.8 / 797.8 against 44.3 / 163.5 / 659.7 us; errors against the fp32
    recurrence the same on random inputs, 0.023 / 0.041 against 0.021 / 0.018 (output /
    state) for a repeated key) and loads unmasked (rows past the end repeat the last row,
    with a zero factor: 647 against 652 us at 32K); the first kernel takes a (chunk, v-head)
    with k k^T as one 64x64 dot and the four diagonal inverses as one batch (a q/k head per
    program with 40 16x16x32 dots and the inverses one after another: 76.4 / 295.1 against
    53.5 / 205.9 us at 8K / 32K), T = (I + A)^-1 by forward substitution on the identity's
    rows times k and v in bf16 (forward substitution on every 64 columns of [k | v], 40 tf32
    16x16 dots: 399 against 364 us at 32K, 103 against 85 at 8K; errors against an fp32 run
    at flash-linear-attention's level: 32K output 0.0075, state 0.0070; fla 0.0075 /
    0.0076), and the blocks of A from registers, none in memory (168 MB less written and read
    at 32K; as two kernels 209 + 365 against 492 us at 32K, the function 1,569 against 1,489
    us, 8K 394 against 375, outputs identical); the output kernel takes a (chunk, q/k head)
    and loops over both v-heads and their column blocks (a program per 64 columns, each
    loading q and k and computing q k^T and the decayed causal parts again: 541 against 401
    us at 32K, 138 against 103 at 8K, outputs identical)."""

    # the first kernel: 8 warps 1,722 us for the function at 32K against 1,489; capped at
    # 128 registers (60 bytes spilled) 1,483 against 1,486
    wy_warps: int = 4
    # [W | U] columns per product step: 32 a step 1,552 us against 1,489 at 32K; 32 or 128
    # columns, 2 or 8 warps, 1-2 stages for the product in bf16: 1,620-1,682 against 1,574
    wy_bc: int = 64
    # dot precision of the 16x16 diagonal inverses for 16-bit inputs (fp32 inputs take
    # exact fp32): "ieee" 0.188 / 0.683 / 2.66 ms against 0.170 / 0.608 / 2.36 (output off by
    # 4e-3 of its largest value, final state by 2.6e-3: the level of the bf16 rounding of W,
    # U and the chunk states), "tf32x3" 0.216 / 0.766 / 2.93
    inverse: str = "tf32"
    # state columns per program of the sequential kernel: 16 0.706 ms at 8K against 0.608,
    # 64 0.712; with 4 stages 16 columns 1,993 us at 32K against 1,605
    state_bv: int = 32
    # 8 warps 0.180 / 0.644 / 2.50 ms against 0.170 / 0.608 / 2.36; with 4 stages 1,754 us
    # at 32K against 1,605
    state_warps: int = 4
    # the chunks ahead whose W, U and k are in flight, plus the one in use: 608 us for the
    # scan at 32K against 647 with 3; the function with 3 stages 1,654 us against 1,605, 5
    # stages 1,652; 2 (each chunk's loads waited on at the start of the step that uses
    # them) 0.20 / 0.74 / 2.87 ms against 0.170 / 0.608 / 2.36 with 3
    state_stages: int = 4
    # output columns per step of the output kernel's loop: 32 1,742 us for the function at
    # 32K against 1,644; 128 0.621 ms at 8K against 0.608
    output_bv: int = 64
    # 8 warps 1,883 us at 32K against 1,644; 2 warps 0.605 ms at 8K against 0.608
    output_warps: int = 4


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
    save_rows: torch.Tensor | None = None,
    save_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] (log-decay, write strength);
    sequences back to back (cu_seqlens [B + 1] int32); states: [S, Hv, Dk, Dv] fp32 or bf16
    pool, each sequence starts from states[slots[b]] and its final state (carried in fp32) is
    written back there in the pool's dtype.
    save_rows, save_at: [B, N] int32: sequence b's state after its first save_at[b, j]
    tokens (0 < save_at <= its length) is also stored at states[save_rows[b, j]] (-1: none;
    rows apart from every slot), taken inside the scan.
    max_len bounds the longest sequence (default T; known on the host, no device read).
    Returns o: [T, Hv, Dv] in v's dtype. q/k are L2-normalised and q scaled by Dk^-0.5 here."""
    t, hk, dk = q.shape
    _, hv, dv = v.shape
    if k.shape != q.shape or g.shape != (t, hv) or beta.shape != (t, hv) or hv % hk:
        raise ValueError(
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, "
            f"beta {list(beta.shape)}: expected k like q, g and beta [T, Hv], Hv % Hk == 0"
        )
    if states.shape[1:] != (hv, dk, dv) or states.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"states {list(states.shape)} {states.dtype} must be fp32 or bf16 [S, {hv}, {dk}, {dv}]"
        )
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
    kinv = torch.empty(t, hk, device=q.device, dtype=torch.float32)  # inverse k norms
    chunk_slots, chunks = t // 64 + bsz, triton.cdiv(max_len or t, 64)  # see `_first_chunk`
    fast(_wy_kernel)[(chunks, hv, bsz)](
        k,
        v,
        g,
        beta,
        gc,
        kinv,
        w,
        u,
        cu_seqlens,
        k.stride(0),
        v.stride(0),
        g.stride(0),
        kinv.stride(0),
        w.stride(0),
        u.stride(0),
        RATIO=hv // hk,
        DK=dk,
        DV=dv,
        BC=min(tiles.wy_bc, dk, dv),
        INV_PRECISION="ieee" if q.dtype == torch.float32 else tiles.inverse,
        PRECISION=precision,
        num_warps=tiles.wy_warps,
    )
    h = torch.empty(chunk_slots, hv, dk, dv, device=q.device, dtype=v.dtype)
    block_v = min(tiles.state_bv, dv)
    saves = saves_per_sequence(save_rows, save_at, bsz)
    fast(_state_kernel)[(dv // block_v, hv, bsz)](
        k,
        w,
        u,
        gc,
        kinv,
        h,
        states,
        slots,
        save_rows if saves else slots,
        save_at if saves else slots,
        cu_seqlens,
        k.stride(0),
        w.stride(0),
        u.stride(0),
        gc.stride(0),
        kinv.stride(0),
        h.stride(0),
        states.stride(0),
        states.stride(1),
        RATIO=hv // hk,
        DK=dk,
        DV=dv,
        BV=block_v,
        STAGES=tiles.state_stages,
        SAVES=saves,
        num_warps=tiles.state_warps,
    )
    o = torch.empty(t, hv, dv, device=q.device, dtype=v.dtype)
    out_v = min(tiles.output_bv, dv)
    fast(_output_kernel)[(chunks, hk, bsz)](
        q,
        k,
        u,
        gc,
        kinv,
        h,
        o,
        cu_seqlens,
        q.stride(0),
        u.stride(0),
        gc.stride(0),
        kinv.stride(0),
        h.stride(0),
        o.stride(0),
        RATIO=hv // hk,
        DK=dk,
        DV=dv,
        BV=out_v,
        num_warps=tiles.output_warps,
    )
    return o
