"""Chunked gated delta rule for prefill (chunks of 64), varlen batches, states in a pool.

Per chunk (see naive.py for the algebra), with G the cumulative log-decay from the chunk
start and S0 the incoming state, the delta rule's writes u solve

    (I + A) u = beta * (v - exp(G) k S0),  A[t, s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)

so u = U - W S0 with U = (I + A)^-1 (beta v) and W = (I + A)^-1 (beta exp(G) k), which do not
depend on the state. Three kernels, only the middle one sequential:

1. `_wy_kernel`, parallel over every chunk of every sequence and head: U and W, by block
   forward substitution over four 16-row sub-blocks (the diagonal 16x16 blocks inverted
   exactly by forward substitution), 64 columns of [W | U] at a time. One program per
   (chunk, head).
2. `_state_kernel`, sequential over a sequence's chunks, one program per (sequence, v-head,
   BV columns of the state), the state S [Dk, BV] in registers the whole way: it stores each
   chunk's incoming state, then  u = U - W S  (in place of U)  and
   S = exp(G_last) S + (k * exp(G_last - G))^T u.  Two small dots per chunk.
3. `_output_kernel`, parallel again:  o = exp(G) q S_c + ((q k^T) * exp(G_t - G_s), s <= t) u.

L2-norm and scale of q/k are fused in. W, U, u and the per-chunk states are stored in the
activation dtype (bf16 in the model: half the traffic; fp32 in the exactness tests). Dots use
tensor cores (tf32) for 16-bit inputs and exact fp32 (`ieee`) for fp32 inputs; the carried
state and the decay math are fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _pair(k_i, k_j, gc_i, gc_j, beta_i, PRECISION: tl.constexpr):
    """Block [16, 16] of A between sub-blocks i and j: beta_i exp(G_i - G_j) k_i.k_j (for
    i == j, the caller keeps the strictly lower part)."""
    kk = _mm(k_i, tl.trans(k_j), PRECISION)
    return kk * tl.exp(tl.minimum(gc_i[:, None] - gc_j[None, :], 0.0)) * beta_i[:, None]


@triton.jit
def _lower(strict: tl.constexpr):
    o = tl.arange(0, 16)
    return tl.where((o[:, None] > o[None, :]) if strict else (o[:, None] >= o[None, :]), 1.0, 0.0)


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
def _load_rows(k_ptr, g_ptr, b_ptr, row0, length, i_k, i_h, stride_kt, stride_gt,
               DK: tl.constexpr):  # fmt: skip
    """Rows row0..row0+16: L2-normalised k [16, DK], its inverse norms, g and beta [16]."""
    o_t = row0 + tl.arange(0, 16)
    m_t = o_t < length
    o_dk = tl.arange(0, DK)
    b_k = tl.load(k_ptr + o_t[:, None] * stride_kt + i_k * DK + o_dk[None, :],
                  mask=m_t[:, None], other=0.0).to(tl.float32)  # fmt: skip
    inv = tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)
    b_g = tl.load(g_ptr + o_t * stride_gt + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(b_ptr + o_t * stride_gt + i_h, mask=m_t, other=0.0).to(tl.float32)
    return b_k * inv[:, None], inv, b_g, b_beta


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
def _wy_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, u_ptr, gc_ptr, cu_ptr,
    stride_kt, stride_vt, stride_gt, stride_wt, stride_ut,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    NCOL: tl.constexpr = (DK + DV) // BC
    i_c, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c0 = i_c * 64
    start = tl.load(cu_ptr + i_b)
    length = tl.load(cu_ptr + i_b + 1) - start
    if c0 >= length:
        return
    i_k = i_h // RATIO
    k_seq, v_seq = k_ptr + start * stride_kt, v_ptr + start * stride_vt + i_h * DV
    g_seq, b_seq = g_ptr + start * stride_gt, b_ptr + start * stride_gt
    sk, sg = stride_kt, stride_gt
    k0, n0, g0, be0 = _load_rows(k_seq, g_seq, b_seq, c0, length, i_k, i_h, sk, sg, DK)
    k1, n1, g1, be1 = _load_rows(k_seq, g_seq, b_seq, c0 + 16, length, i_k, i_h, sk, sg, DK)
    k2, n2, g2, be2 = _load_rows(k_seq, g_seq, b_seq, c0 + 32, length, i_k, i_h, sk, sg, DK)
    k3, n3, g3, be3 = _load_rows(k_seq, g_seq, b_seq, c0 + 48, length, i_k, i_h, sk, sg, DK)
    gc0 = tl.cumsum(g0, axis=0)
    gc1 = tl.sum(g0, axis=0) + tl.cumsum(g1, axis=0)
    gc2 = tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.cumsum(g2, axis=0)
    gc3 = tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0) + tl.cumsum(g3, axis=0)
    o_r = tl.arange(0, 16)  # G, for the later kernels
    p_gc = gc_ptr + (start + c0 + o_r) * stride_gt + i_h
    tl.store(p_gc, gc0, mask=c0 + o_r < length)
    tl.store(p_gc + 16 * stride_gt, gc1, mask=c0 + 16 + o_r < length)
    tl.store(p_gc + 32 * stride_gt, gc2, mask=c0 + 32 + o_r < length)
    tl.store(p_gc + 48 * stride_gt, gc3, mask=c0 + 48 + o_r < length)
    a10 = _pair(k1, k0, gc1, gc0, be1, PRECISION)
    a20 = _pair(k2, k0, gc2, gc0, be2, PRECISION)
    a30 = _pair(k3, k0, gc3, gc0, be3, PRECISION)
    a21 = _pair(k2, k1, gc2, gc1, be2, PRECISION)
    a31 = _pair(k3, k1, gc3, gc1, be3, PRECISION)
    a32 = _pair(k3, k2, gc3, gc2, be3, PRECISION)
    t0 = _inverse_unit_lower(_pair(k0, k0, gc0, gc0, be0, PRECISION) * _lower(True))
    t1 = _inverse_unit_lower(_pair(k1, k1, gc1, gc1, be1, PRECISION) * _lower(True))
    t2 = _inverse_unit_lower(_pair(k2, k2, gc2, gc2, be2, PRECISION) * _lower(True))
    t3 = _inverse_unit_lower(_pair(k3, k3, gc3, gc3, be3, PRECISION) * _lower(True))
    for cb in tl.static_range(NCOL):  # the block solve, BC columns of [W | U] at a time
        col = cb * BC
        sv = stride_vt
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
def _state_kernel(
    k_ptr, w_ptr, u_ptr, gc_ptr, h_ptr, state_ptr, slot_ptr, cu_ptr, chunk_ptr,
    stride_kt, stride_wt, stride_ut, stride_gt, stride_hc, stride_ss, stride_sh,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k = i_h // RATIO
    start = tl.load(cu_ptr + i_b)
    length = tl.load(cu_ptr + i_b + 1) - start
    first_chunk = tl.load(chunk_ptr + i_b).to(tl.int64)
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    o_dk = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, 64)
    p_s = state_ptr + slot * stride_ss + i_h * stride_sh + o_dk[:, None] * DV + o_v[None, :]
    b_s = tl.load(p_s)  # [DK, BV] fp32, carried in registers across all chunks
    p_h = h_ptr + first_chunk * stride_hc + i_h * DK * DV + o_dk[:, None] * DV + o_v[None, :]
    for c0 in tl.range(0, length, 64, num_stages=2):
        tl.store(p_h + (c0 // 64) * stride_hc, b_s.to(h_ptr.dtype.element_ty))
        rows = start + c0 + o_t
        m_t = (c0 + o_t) < length
        b_w = tl.load(w_ptr + rows[:, None] * stride_wt + i_h * DK + o_dk[None, :],
                      mask=m_t[:, None], other=0.0)  # fmt: skip
        p_u = u_ptr + rows[:, None] * stride_ut + i_h * DV + o_v[None, :]
        b_u = tl.load(p_u, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_u -= _mm(b_w.to(tl.float32), b_s, PRECISION)
        tl.store(p_u, b_u.to(u_ptr.dtype.element_ty), mask=m_t[:, None])
        b_gc = tl.load(gc_ptr + rows * stride_gt + i_h, mask=m_t, other=0.0)
        g_last = tl.load(gc_ptr + (start + tl.minimum(c0 + 63, length - 1)) * stride_gt + i_h)
        b_k = _norm_rows(k_ptr, rows, m_t, i_k * DK, stride_kt, 1.0, DK)
        b_kd = b_k * tl.exp(g_last - b_gc)[:, None]
        b_s = tl.exp(g_last) * b_s + _mm(tl.trans(b_kd), b_u, PRECISION)
    tl.store(p_s, b_s)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, u_ptr, gc_ptr, h_ptr, o_ptr, cu_ptr, chunk_ptr,
    stride_qt, stride_ut, stride_gt, stride_hc, stride_ot,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
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
    b_qk = _mm(b_q, tl.trans(b_k), PRECISION) * decay
    b_o = tl.exp(b_gc)[:, None] * _mm(b_q, b_h, PRECISION) + _mm(b_qk, b_u, PRECISION)
    tl.store(o_ptr + rows[:, None] * stride_ot + i_h * DV + o_v[None, :], b_o,
             mask=m_t[:, None])  # fmt: skip


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
    max_len: int | None = None,
) -> torch.Tensor:
    """q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] (log-decay, write strength);
    sequences back to back (cu_seqlens [B + 1] int32); states: [S, Hv, Dk, Dv] fp32 pool, each
    sequence starts from states[slots[b]] and its final state is written back there.
    max_len bounds the longest sequence (default T; known on the host, no device read).
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
    g, beta = g.float(), beta.float()
    bsz = cu_seqlens.numel() - 1
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # W and U in the activation dtype (bf16 in the model), the cumulative decay in fp32
    w = torch.empty(t, hv, dk, device=q.device, dtype=v.dtype)
    u = torch.empty(t, hv, dv, device=q.device, dtype=v.dtype)
    gc = torch.empty(t, hv, device=q.device, dtype=torch.float32)
    block_c = min(64, dk, dv)
    chunks = triton.cdiv(max_len or t, 64)
    _wy_kernel[(chunks, hv, bsz)](
        k, v, g, beta, w, u, gc, cu_seqlens,
        k.stride(0), v.stride(0), g.stride(0), w.stride(0), u.stride(0),
        RATIO=hv // hk, DK=dk, DV=dv, BC=block_c, PRECISION=precision, num_warps=4,
    )  # fmt: skip
    # first chunk of each sequence in the per-chunk state buffer (device-side: no sync)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    first_chunk = torch.zeros(bsz, dtype=torch.int32, device=q.device)
    first_chunk[1:] = torch.cumsum(triton.cdiv(lengths, 64), 0)[:-1].to(torch.int32)
    h = torch.empty(t // 64 + bsz, hv, dk, dv, device=q.device, dtype=v.dtype)
    block_v = min(block_v, dv)
    _state_kernel[(dv // block_v, hv, bsz)](
        k, w, u, gc, h, states, slots, cu_seqlens, first_chunk,
        k.stride(0), w.stride(0), u.stride(0), gc.stride(0), h.stride(0), states.stride(0),
        states.stride(1),
        RATIO=hv // hk, DK=dk, DV=dv, BV=block_v, PRECISION=precision, num_warps=4,
    )  # fmt: skip
    o = torch.empty(t, hv, dv, device=q.device, dtype=torch.float32)
    out_v = min(64, dv)
    _output_kernel[(chunks * (dv // out_v), hv, bsz)](
        q, k, u, gc, h, o, cu_seqlens, first_chunk,
        q.stride(0), u.stride(0), gc.stride(0), h.stride(0), o.stride(0),
        RATIO=hv // hk, DK=dk, DV=dv, BV=out_v, PRECISION=precision, num_warps=4,
    )  # fmt: skip
    return o
