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
inputs; the carried state and the decay math are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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
    t0, t1, t2, t3 = _split4(tl.permute(_inverse_unit_lower(_diagonal_blocks(a), INV_PRECISION),
                                        (1, 2, 0)))  # fmt: skip
    a10, a20, a30, a21, a31, a32 = _blocks_below(a)
    x0 = _mm(t0, _eye_rows(0), PRECISION)
    x1 = _mm(t1, _eye_rows(1) - _mm(a10, x0, PRECISION), PRECISION)
    x2 = _mm(t2, _eye_rows(2) - _mm(a20, x0, PRECISION) - _mm(a21, x1, PRECISION), PRECISION)
    x3 = _mm(t3, _eye_rows(3) - _mm(a30, x0, PRECISION) - _mm(a31, x1, PRECISION)
             - _mm(a32, x2, PRECISION), PRECISION)  # fmt: skip
    return _stack4(x0, x1, x2, x3)


@triton.jit
def _times_rows(t, x_ptr, stride_xt, y_ptr, stride_yt, rows, m_t, D: tl.constexpr,
                BC: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """y[rows] = t x[rows] for one chunk's 64 rows of D columns, BC columns at a time, the
    dot in DT (`_mm_as`)."""
    o_c = tl.arange(0, BC)
    for col in range(0, D, BC):
        b_x = tl.load(x_ptr + rows[:, None] * stride_xt + col + o_c[None, :],
                      mask=m_t[:, None], other=0.0)  # fmt: skip
        b_y = _mm_as(t, b_x, DT)
        tl.store(y_ptr + rows[:, None] * stride_yt + col + o_c[None, :],
                 b_y.to(y_ptr.dtype.element_ty), mask=m_t[:, None])  # fmt: skip


@triton.jit
def _wy_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, gc_ptr, kinv_ptr, w_ptr, u_ptr, cu_ptr,
    stride_kt, stride_vt, stride_gt, stride_nt, stride_wt, stride_ut,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr,
    INV_PRECISION: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
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
    b_k = tl.load(k_ptr + rows[:, None] * stride_kt + i_k * DK + tl.arange(0, DK)[None, :],
                  mask=m_t[:, None], other=0.0)  # fmt: skip
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
    a = tl.where(o_t[:, None] > o_t[None, :],
                 kk * (b_beta * n_row)[:, None] * n_col[None, :] * decay, 0.0)  # fmt: skip
    t = _chunk_inverse(a, INV_PRECISION, PRECISION)
    _times_rows(t * (b_beta * tl.exp(b_gc) * n_row)[None, :], k_ptr + i_k * DK, stride_kt,
                w_ptr + i_h * DK, stride_wt, rows, m_t, DK, BC, DT)  # W  # fmt: skip
    _times_rows(t * b_beta[None, :], v_ptr + i_h * DV, stride_vt, u_ptr + i_h * DV, stride_ut,
                rows, m_t, DV, BC, DT)  # U  # fmt: skip


@triton.jit
def _norm_rows(ptr, rows, m_t, col, stride_t, scale, DK: tl.constexpr):
    """Rows of q or k [64, DK] at column offset col, L2-normalised, times scale."""
    o_dk = tl.arange(0, DK)
    b_x = tl.load(ptr + rows[:, None] * stride_t + col + o_dk[None, :], mask=m_t[:, None],
                  other=0.0).to(tl.float32)  # fmt: skip
    return b_x * (tl.rsqrt(tl.sum(b_x * b_x, axis=1) + 1e-6) * scale)[:, None]


@triton.jit
def _state_kernel(
    k_ptr, w_ptr, u_ptr, gc_ptr, kinv_ptr, h_ptr, state_ptr, slot_ptr, cu_ptr,
    stride_kt, stride_wt, stride_ut, stride_gt, stride_nt, stride_hc, stride_ss, stride_sh,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """The sequential scan of one sequence's chunks. Program (BV columns, v-head, sequence);
    the state S [DK, BV] stays in registers the whole way."""
    DT: tl.constexpr = u_ptr.dtype.element_ty  # dots in the stored dtype (`_mm_as`)
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, length = tl.load(cu_ptr + i_b), _length(cu_ptr, i_b)
    i_k = i_h // RATIO
    o_dk = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, 64)
    p_s = (state_ptr + tl.load(slot_ptr + i_b).to(tl.int64) * stride_ss + i_h * stride_sh
           + o_dk[:, None] * DV + o_v[None, :])  # fmt: skip
    b_s = tl.load(p_s)  # [DK, BV] fp32, carried in registers across all chunks
    p_h = (h_ptr + _first_chunk(cu_ptr, i_b) * stride_hc + i_h * DK * DV + o_dk[:, None] * DV
           + o_v[None, :])  # fmt: skip
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
        b_s = tl.exp(g_last) * b_s + _mm_as(tl.trans(b_k), b_u * b_f[:, None], DT)
    tl.store(p_s, b_s)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, u_ptr, gc_ptr, kinv_ptr, h_ptr, o_ptr, cu_ptr,
    stride_qt, stride_ut, stride_gt, stride_nt, stride_hc, stride_ot,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
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
    b_k = tl.load(k_ptr + rows[:, None] * stride_qt + i_k * DK + o_dk[None, :],
                  mask=m_t[:, None], other=0.0).to(tl.float32)  # k is laid out like q
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
    """Launch shapes of the three kernels: warps, [W | U] columns per product step of the
    first (wy_bc), state columns per program of the sequential kernel (state_bv) and its
    loads in flight (state_stages: the chunks ahead whose W, U and k are being fetched, plus
    the one in use), output columns per step of the output kernel's loop (output_bv), and
    the dot precision of the 16x16 diagonal inverses for 16-bit inputs (inverse; fp32
    inputs always take exact fp32).

    The history below names the kernels of then: the "blocks" kernel (k k^T, A and the ten
    16x16 blocks into memory) and the "solve" kernel (W and U from them), one `_wy_kernel`
    since the eighteenth session.

    Measured on the H200, the whole function for one layer, bf16, 2K / 8K / 32K tokens
    (`scratch`-style A/B in one run, ninth session): the defaults with an 8-warp state scan
    0.181 / 0.645 / 2.51 ms, with 4 warps (now) 0.170 / 0.608 / 2.36 in a second run (8
    warps 0.180 / 0.644 / 2.50 there);
    state_stages 2 (before: each chunk's loads were waited on at the start of the step
    that used them, nothing in flight across a step) 0.20 / 0.74 / 2.87; inverse "ieee"
    0.188 / 0.683 / 2.66 (output differs from it by 4e-3 of its largest value, the final
    state by 2.6e-3: the level of the bf16 rounding of W, U and the chunk states),
    "tf32x3" 0.216 / 0.766 / 2.93; state_bv 16 with 4 warps 0.20 / 0.74 / 2.92, state_bv
    64 0.21 / 0.76 / 2.95; output 128 columns with 8 warps 0.20 / 0.71 / 2.79, 64 with 8
    warps 0.21 / 0.76 / 2.98. Before the blocks and output kernels took a q/k head per
    program (the RATIO v-heads that read it share k k^T and q k^T) and the stages change:
    0.218 / 0.792 / 3.11. The output computed inside the scan (q S and P u per step, P =
    decayed q k^T from a parallel kernel; no per-chunk states in memory) measured the same
    as the separate output kernel: 0.608 / 2.33 ms at 8K / 32K with 4 warps (not kept). So
    did one sequence in 2-8 pieces with piece i + 1's blocks and solve on one stream beside
    piece i's scan and output on a second (32K: 2.37 ms in one pass, 2.36-2.45 in pieces; the
    kernels slow each other down: the scan 755 -> 1,035 us in 4 pieces; 2K and 8K slower).
    Swept again after those changes (same harness, one change at a time from the defaults of
    then, blocks 4 warps and solve_bc 32; 2K / 8K / 32K: 0.170 / 0.608 / 2.36 ms): blocks 2
    warps 0.155 / 0.554 / 2.14 (16 bytes spilled at sm_90), 8 warps 0.206 / 0.756 / 2.93;
    solve_bc 64 0.161 / 0.575 / 2.23, 16 0.213 / 0.776 / 3.00; solve 2 warps 0.161 / 0.578 /
    2.27, 8 warps 0.199 / 0.721 / 2.82; output 32 / 128 columns 0.706 / 0.621 ms at 8K, 2 / 8
    warps 0.605 / 0.688; state_bv 16 / 64 0.706 / 0.712; state_stages 4 0.624. Now blocks 2
    warps and solve_bc 64.
    A scan parallel over segments of 4-32 chunks (each segment's affine map S -> M S + E in
    parallel, a carry across segments, then the scan per segment) measured 1.5-1.7x slower
    than the sequential scan at 512 to 32K tokens (1.30 vs 0.83 ms at 8K, 4.94 vs 3.18 at
    32K): the M products cost more than the sequential steps they save. The scan on the
    transposed state (S^T [BV, DK] carried, so both products take the state-dependent
    operand from registers: Triton emits mma.sync, 9 barriers per step instead of 20)
    measured slower (eleventh session, scan kernel alone at 2K / 8K / 32K: 72.9 / 285 /
    1,124 us against 54.9 / 206 / 794; 16 columns or 8 warps slower still). A step of all
    programs moves about 2.8 MB through HBM (W, U, k in; h, u out: 1.8 TB/s at 1.55 us a
    step) and 6 MB between L2 and the SMs: memory traffic, not only the chain of two
    products, sets the step's time. The scan two chunks a step (three dependent products a
    pair instead of four: W0 S and W1 S; then S1 = d0 S + K0^T u0 beside u1 = U1 - d0 W1 S
    - (W1 K0^T) u0; then S2) matched the recurrence in fp32 on the H200 and under the
    interpreter, but Triton 3.6 compiled its bf16 form wrong (outputs off by 0.58 from the
    second chunk at one stage, an illegal address at two; even two plain steps per loop
    iteration were off by 0.068 at one stage, right at two): not timed, not kept
    (fourteenth session). The scan with k read as stored and its row factors on u (before:
    k scaled and decayed in fp32, then staged transposed through shared memory between the
    two products; sm_90 loop body 810 -> 515 instructions, 173 -> 128 registers): scan
    kernel 54.9 / 207.8 / 797.8 -> 44.3 / 163.5 / 659.7 us at 2K / 8K / 32K, the whole
    function 142.6 / 521.5 / 2,011 -> 131.9 / 479.9 / 1,862 us (graphs, alternating;
    docs/bench/scan-k-stored-ab-*-s15.json), error against the fp32 recurrence unchanged
    on random inputs, 0.023 / 0.041 -> 0.021 / 0.018 (output / state) for a repeated key.
    The blocks kernel per v-head with k k^T as one 64x64 dot and the four diagonal inverses
    as one batch of [16, 16] products (before: per q/k head, the ten k k^T blocks as 40
    16x16x32 dots, four inverses one after another, 2 warps): 76.4 / 295.1 -> 53.5 / 205.9
    us at 8K / 32K, the whole function 481.6 / 1,864 -> 456.6 / 1,766 us, outputs identical
    (docs/bench/wy-ab-*-s15.json; 2 warps 460.8 / 1,767, 8 warps 502.0 / 1,950). Not kept
    from the same run: blocks and solve as one kernel inverting the whole 64x64 I + A (two
    more doublings on 64x64 products) and [W | U] = T [k | v] as 64x64 dots: 184.7 / 731.7
    us for both kernels' work with tf32 products (179.9 / 692.4 split), 145.6 / 596.5 with
    the last product in bf16 (errors up to 1.5x larger); and the output inside the scan (q S
    and the decayed q k^T u per step): 399.7 us at 8K against 166.0 + 137.8 apart.
    Sixteenth session, not kept (docs/bench/gdn-*-s16.json): the scan in pieces on a second
    stream beside each piece's output 3% faster at 32K at best (the output's traffic slows
    the scan beside it); states of every other chunk only (the output kernel deriving the
    rest) 1.769 -> 1.902 ms at 32K; the ten blocks in fp16 or bf16 1.778 -> 1.787 ms.
    Eighteenth session (graphs, alternating 5 rounds, docs/bench/gdn-*-ab-*-s18.json): the
    output kernel per (chunk, q/k head) looping over both v-heads and their column blocks
    (before: a program per 64 columns, each loading q and k and computing q k^T and the
    decayed causal parts again) 541 -> 401 us at 32K, 138 -> 103 at 8K, outputs identical
    (32-column steps 1,742 us for the function against 1,644, 8 warps 1,883); the scan's
    loads unmasked (rows past the end repeat the last row, with a zero factor) 652 -> 647 us,
    with 4 stages in flight 608 (3 stages 1,654 us for the function against 1,605, 5 stages
    1,652; 16 columns with 4 stages 1,993; 8 warps 1,754). The solve as T = (I + A)^-1
    (forward substitution on the identity's rows) times k and v in bf16 (before: the
    forward substitution on every 64 columns of [k | v], 40 tf32 16x16 dots) 399 -> 364 us
    at 32K, 103 -> 85 at 8K, errors against an fp32 run at fla's level (32K: output 0.0075,
    state 0.0070; fla 0.0075 / 0.0076; before 0.0067 / 0.0045); T k and T v in tf32 instead
    680 us (fp32 operands through shared memory); bf16 with 32 or 128 columns, 2 or 8 warps,
    or 1-2 stages 1,620-1,682 us for the function against 1,574. Blocks and solve as one
    kernel (the ten blocks taken from registers by reshapes and splits, none in memory: 168
    MB less written and read at 32K; docs/bench/gdn-wy-fused-ab-2026-12-01-s18.json): 209 +
    365 -> 492 us at 32K, the function 1,569 -> 1,489 us (8K 394 -> 375), outputs identical;
    8 warps 1,722; 32 columns a step 1,552; capped at 128 registers (60 bytes spilled)
    1,483 against 1,486 (gdn-wy-regs-ab-*-s18.json)."""

    wy_warps: int = 4
    wy_bc: int = 64
    inverse: str = "tf32"
    state_bv: int = 32
    state_warps: int = 4
    state_stages: int = 4
    output_bv: int = 64
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
) -> torch.Tensor:
    """q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] (log-decay, write strength);
    sequences back to back (cu_seqlens [B + 1] int32); states: [S, Hv, Dk, Dv] fp32 pool, each
    sequence starts from states[slots[b]] and its final state is written back there.
    max_len bounds the longest sequence (default T; known on the host, no device read).
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
    kinv = torch.empty(t, hk, device=q.device, dtype=torch.float32)  # inverse k norms
    chunk_slots, chunks = t // 64 + bsz, triton.cdiv(max_len or t, 64)  # see `_first_chunk`
    fast(_wy_kernel)[(chunks, hv, bsz)](
        k, v, g, beta, gc, kinv, w, u, cu_seqlens,
        k.stride(0), v.stride(0), g.stride(0), kinv.stride(0), w.stride(0), u.stride(0),
        RATIO=hv // hk, DK=dk, DV=dv, BC=min(tiles.wy_bc, dk, dv),
        INV_PRECISION="ieee" if q.dtype == torch.float32 else tiles.inverse, PRECISION=precision,
        num_warps=tiles.wy_warps,
    )  # fmt: skip
    h = torch.empty(chunk_slots, hv, dk, dv, device=q.device, dtype=v.dtype)
    block_v = min(tiles.state_bv, dv)
    fast(_state_kernel)[(dv // block_v, hv, bsz)](
        k, w, u, gc, kinv, h, states, slots, cu_seqlens,
        k.stride(0), w.stride(0), u.stride(0), gc.stride(0), kinv.stride(0), h.stride(0),
        states.stride(0), states.stride(1), RATIO=hv // hk, DK=dk, DV=dv, BV=block_v,
        STAGES=tiles.state_stages, num_warps=tiles.state_warps,
    )  # fmt: skip
    o = torch.empty(t, hv, dv, device=q.device, dtype=v.dtype)
    out_v = min(tiles.output_bv, dv)
    fast(_output_kernel)[(chunks, hk, bsz)](
        q, k, u, gc, kinv, h, o, cu_seqlens,
        q.stride(0), u.stride(0), gc.stride(0), kinv.stride(0), h.stride(0), o.stride(0),
        RATIO=hv // hk, DK=dk, DV=dv, BV=out_v, num_warps=tiles.output_warps,
    )  # fmt: skip
    return o
