"""One decode step of the gated delta rule for a batch of sequences whose recurrent states
live in a pool indexed by slot (continuous batching). Fused: L2-norm and scale of q/k, the
decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the state update and the
output. The state is updated in place. The layer's gated RMSNorm of the output is a second
small kernel (`gated_rms_norm`).

A program owns (sequence, v-head, BV columns of the state): the columns of S evolve
independently (delta_j needs only column j), so splitting Dv gives B * Hv * Dv / BV programs
with no communication. (Fusing the norm needs a whole head per program; that variant was
slower on the H200: 11.9 vs 10.0 us per layer with the separate norm at batch 1. So was the
whole layer's decode as one kernel, conv and norm done by the last of a head's programs:
7.70 vs 6.40 us per layer at batch 1, 87.1 vs 78.6 at 64, with programmatic dependent
launch. So was the conv applied inside the step, the conv windows moved by extra programs
of the norm kernel, two kernels instead of three: 4.85 vs 4.96 us per layer at batch 1,
13.87 vs 13.39 at 8, 76.4 vs 79.0 at 64, graphs of 30 layers in one run; with the step's
other block widths and warps within 0.3 us of that at batch 1. So was the norm kernel
waiting, instead of for the whole step kernel, on per-(sequence, head) arrival counters
that the step's programs count themselves in at (release atomic; the norm polls with
acquire loads, then zeroes them): 7.24 vs 4.75 us per layer at batch 1, 15.69 vs 13.41 at
8, 82.8 vs 78.6 at 64, one run. A layer's decode is a chain of dependent kernels whose
per-kernel latency, not bytes, sets its time.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.pdl import launch_args, let_next_launch, wait_for_previous, wait_previous


@triton.jit
def decay_and_beta(a, b, a_log, dt_bias):
    """Log-decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b),
    fp32 (softplus linear above 20, as torch's)."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    return -tl.exp(a_log.to(tl.float32)) * softplus, tl.sigmoid(b.to(tl.float32))


@triton.jit
def _delta_step(b_q, b_k, b_v, b_s, g, beta, DK: tl.constexpr):
    """One token's update of BV state columns b_s [DK, BV] (fp32) from its q, k [DK] and v
    [BV] (fp32, before the L2-norm), decay g and strength beta. Returns (the new columns,
    the output columns q . S [BV]).
    All five reductions (|q|^2, |k|^2, q.k and the columns' products with the raw q and k)
    read only the inputs, so they run side by side instead of one after another:
    with q^, k^ the normed q, k, d = e^g and delta = beta (v - d k^.S),
    S' = d S + k^ delta^T and q^.S' = d q^.S + (q^.k^) delta."""
    r_q = tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    r_k = tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    qk = tl.sum(b_q * b_k) * r_q * r_k
    q_s = tl.sum(b_s * b_q[:, None], axis=0) * r_q
    k_s = tl.sum(b_s * b_k[:, None], axis=0) * r_k
    decay = tl.exp(g)
    b_delta = (b_v - decay * k_s) * beta
    b_s = b_s * decay + (b_k * r_k)[:, None] * b_delta[None, :]
    return b_s, decay * q_s + qk * b_delta


@triton.jit
def _gated_norm(b_o, b_z, w_ptr, eps, D: tl.constexpr, DT: tl.constexpr):
    """w * rms_norm(o) * silu(z) for rows [R, D] of one head each, rounding like the layer
    (o and the normed o in DT, the activation dtype)."""
    o_d = tl.arange(0, D)
    b_o = b_o.to(DT).to(tl.float32)
    b_o = b_o * tl.rsqrt(tl.sum(b_o * b_o, axis=1) / D + eps)[:, None]
    b_o = (b_o.to(DT) * tl.load(w_ptr + o_d)[None, :]).to(tl.float32)
    b_z = b_z.to(tl.float32)
    return (b_o * (b_z / (1.0 + tl.exp(-b_z)))).to(DT)


@triton.jit
def _recurrent_step_kernel(
    qkv_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, o_ptr,
    stride_qkv, stride_ab, stride_ss, stride_sh, stride_o,
    KEY_DIM, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """With PDL the state columns (and the layer's A_log, dt_bias) are loaded before waiting
    for the previous kernel: a state pool is written only by this kernel, once per layer and
    step, and by PyTorch and prefill kernels launched without PDL, and between two steps
    there is always a graph boundary or such a kernel, so every earlier write is complete."""
    let_next_launch(USE_PDL)
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k = i_h // RATIO  # the q/k head this v-head reads
    o_dk = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    p_s = state_ptr + slot * stride_ss + i_h * stride_sh + o_dk[:, None] * DV + o_v[None, :]
    b_s = tl.load(p_s)
    a_log, dt_bias = tl.load(alog_ptr + i_h), tl.load(dtb_ptr + i_h)
    wait_previous(USE_PDL)  # q, k, v, a, b come from the kernels just before
    p_row = qkv_ptr + i_b * stride_qkv
    b_q = tl.load(p_row + i_k * DK + o_dk).to(tl.float32)
    b_k = tl.load(p_row + KEY_DIM + i_k * DK + o_dk).to(tl.float32)
    b_v = tl.load(p_row + 2 * KEY_DIM + i_h * DV + o_v).to(tl.float32)
    g, beta = decay_and_beta(tl.load(a_ptr + i_b * stride_ab + i_h),
                             tl.load(b_ptr + i_b * stride_ab + i_h), a_log, dt_bias)  # fmt: skip
    b_s, b_o = _delta_step(b_q, b_k, b_v, b_s, g, beta, DK)
    tl.store(p_s, b_s)
    tl.store(o_ptr + i_b * stride_o + i_h * DV + o_v, b_o)


def _block_v(dv: int, hv: int, bsz: int) -> int:
    """State columns per program of the decode step: the widest of 64, 32 that still makes
    256 programs, else 16 (see `fused_recurrent_step`)."""
    return next((w for w in (64, 32) if dv // w * hv * bsz >= 256), 16)


def _one_row_stride(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, H] as the kernels read them: one row stride for both, heads packed. Views of
    one projection pass as they are; anything else is copied."""
    if b.shape == a.shape and b.stride() == a.stride() and a.stride(1) == 1:
        return a, b
    return a.contiguous(), b.contiguous()


def fused_recurrent_step(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """qkv: [B, 2 * Hk * Dk + Hv * Dv] (after the conv); a, b: [B, Hv] (projections);
    a_log, dt_bias: [Hv]; states: [S, Hv, Dk, Dv] fp32 pool, updated in place at slots [B].
    block_v: state columns per program; by default the widest of 64, 32, 16 that still
    makes 256 programs (measured in graphs of 30 layers on the H200: at batch 1 16 columns
    4.2 us, 32 4.7, 64 5.0; at batch 8 64 columns 11.8 us, 32 12.8; at 64 71.3 vs 72.5).
    num_warps: by default 1 for 16 columns per program, 2 for 32, else 4 (`bench.gdn`, graphs
    of 30 steps on the H200, 4 / 2 / 1 warps: batch 1 (16 columns) 3.27 / 3.04 / 2.83 us,
    batch 8 (64) 11.13 / 11.19 / 60.0, batch 64 70.7 / 71.7 / 371; the whole decode path at
    batch 1 with 1 warp 4.77 us against 4.95 with 2 in another run).
    Returns o: [B, Hv, Dv] fp32 (before the gated norm)."""
    bsz = qkv.shape[0]
    _, hv, dk, dv = states.shape
    key_dim = num_k_heads * dk
    if qkv.shape[1] != 2 * key_dim + hv * dv or a.shape != (bsz, hv) or b.shape != (bsz, hv):
        raise ValueError(
            f"qkv {list(qkv.shape)}, a {list(a.shape)}, b {list(b.shape)} do not fit states "
            f"{list(states.shape)} with {num_k_heads} q/k heads"
        )
    if states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError("the state pool must be contiguous fp32")
    qkv = qkv.contiguous()
    a, b = _one_row_stride(a, b)
    o = torch.empty(bsz, hv, dv, device=qkv.device, dtype=torch.float32)
    block_v = min(block_v or _block_v(dv, hv, bsz), dv)
    num_warps = num_warps or (1 if block_v <= 16 else 2 if block_v <= 32 else 4)
    grid = (dv // block_v, hv, bsz)
    _recurrent_step_kernel[grid](
        qkv, a, b, a_log, dt_bias, states, slots, o,
        qkv.stride(0), a.stride(0), states.stride(0), states.stride(1), o.stride(0),
        key_dim, RATIO=hv // num_k_heads, DK=dk, DV=dv, BV=block_v, num_warps=num_warps,
        **launch_args(o, grid),
    )  # fmt: skip
    return o


@triton.jit
def _gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, T, H, stride_ab,
                  BLOCK: tl.constexpr):  # fmt: skip
    """g and beta [T, H] fp32 for a prefill chunk (the decode step computes its own)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < T * H
    i_t, i_h = o // H, o % H
    g, beta = decay_and_beta(tl.load(a_ptr + i_t * stride_ab + i_h, mask=m, other=0.0),
                             tl.load(b_ptr + i_t * stride_ab + i_h, mask=m, other=0.0),
                             tl.load(alog_ptr + i_h, mask=m, other=0.0),
                             tl.load(dtb_ptr + i_h, mask=m, other=0.0))  # fmt: skip
    tl.store(g_ptr + o, g, mask=m)
    tl.store(beta_ptr + o, beta, mask=m)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """a, b: [T, Hv] (projections, same strides); a_log, dt_bias: [Hv] -> (g, beta) [T, Hv]
    fp32 in one kernel (the PyTorch expression is six)."""
    t, h = a.shape
    a, b = _one_row_stride(a, b)
    g = torch.empty(t, h, device=a.device, dtype=torch.float32)
    beta = torch.empty_like(g)
    if t:
        _gates_kernel[(triton.cdiv(t * h, 1024),)](a, b, a_log, dt_bias, g, beta, t, h,
                                                   a.stride(0), BLOCK=1024)  # fmt: skip
    return g, beta


@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, eps, H, N, stride_zt, D: tl.constexpr,
                       ROWS: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """ROWS of the N rows (row i: token i // H, head i % H) of D values: y = w * rms_norm(o)
    * silu(z), rounding like the layer. z's heads are packed, its tokens stride_zt apart."""
    wait_for_previous(USE_PDL)
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m = (i < N)[:, None]
    o_d = tl.arange(0, D)[None, :]
    b_o = tl.load(o_ptr + i[:, None] * D + o_d, mask=m, other=0.0)
    b_z = tl.load(z_ptr + (i // H)[:, None] * stride_zt + (i % H)[:, None] * D + o_d, mask=m,
                  other=0.0)  # fmt: skip
    b_y = _gated_norm(b_o, b_z, w_ptr, eps, D, y_ptr.dtype.element_ty)
    tl.store(y_ptr + i[:, None] * D + o_d, b_y, mask=m)


GATED_NORM_ROWS = 8  # rows per program: one row per program was 131K programs at 4K tokens


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float):
    """The GDN output norm as one kernel: o [T, H, D] (fp32), z [T, H, D] (a view of the
    in-projection: heads packed, any token stride) -> [T, H, D] in z's dtype."""
    t, h, d = o.shape
    o = o.contiguous()
    if z.stride(2) != 1 or z.stride(1) != d:
        z = z.contiguous()
    y = torch.empty(z.shape, device=z.device, dtype=z.dtype)
    grid = (triton.cdiv(t * h, GATED_NORM_ROWS),)
    _gated_norm_kernel[grid](o, z, weight, y, eps, h, t * h, z.stride(0), D=d,
                             ROWS=GATED_NORM_ROWS, num_warps=4,
                             **launch_args(y, grid))  # fmt: skip
    return y
