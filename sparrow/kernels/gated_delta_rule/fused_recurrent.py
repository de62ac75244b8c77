"""One decode step of a GDN layer's mixer for a batch of sequences whose recurrent states
live in a pool indexed by slot (continuous batching). Fused: L2-norm and scale of q/k, the
decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the state update, the
output and the layer's gated RMSNorm of it (with z). The state is updated in place. The
conv update before it is its own kernel (`causal_conv1d`'s one-token step) or, at batch 1
with 4-bit projections, the in-projection GEMV's epilogue (`quant_gemv_conv`); prefill's
output norm is `gated_rms_norm`.

Two ways to split the work. With the norm, a program owns a whole head (sequence, v-head),
as the norm needs: the state [Dk, Dv] as a tile [Dv // BV, Dk, BV]. Measured on the H200
(graphs of 30 layers, conv included, one run, batch 1 / 2 / 8 / 64): 4.97 / 5.98 / 12.57 /
78.5 us against 4.95 / 6.41 / 13.41 / 79.1 for the step split over column blocks plus a norm
kernel; with 8 warps 6.8 / 7.7 / 17.0 / 130. Without it (`normed=False`, batch-1 decode with
4-bit projections), a program owns 16 columns and the norm's 1 / rms is applied by the
out-projection GEMV (`quant_gemv_rms_scaled`): at batch 1 the head-per-program step has only
32 programs, each storing 64 KB of state. Slower: the conv inside the step too (the q/k
windows written by one of a q/k head's two programs; timing only) 5.41 / 6.61 / 12.93 /
94.5: a layer's decode is a chain of dependent kernels, and at batch 1 the conv kernel's
time hides behind the step's state loads (issued before the wait). Against the step split
over column blocks plus a norm kernel: the conv inside the step, its windows moved by extra
programs of the norm kernel, 4.85 vs 4.96 us at batch 1; the norm kernel waiting on
per-(sequence, head) arrival counters instead of the whole step kernel, 7.24 vs 4.75; the
whole decode as one kernel with conv and norm done by the last of a head's programs, 7.70
vs 6.40; the whole norm (from o and z) in the out-projection GEMV's prologue, 2.7 us a
layer more than the GEMV alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparrow.kernels.activations import silu
from sparrow.kernels.launch import fast
from sparrow.kernels.pdl import launch_args, let_next_launch, wait_for_previous, wait_previous


@triton.jit
def decay_and_beta(a, b, a_log, dt_bias):
    """Log-decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b),
    fp32 (softplus linear above 20, as torch's); beta rounded to b's dtype first, as the
    layer computes it (`b.sigmoid()`)."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
    return -tl.exp(a_log.to(tl.float32)) * softplus, beta


@triton.jit
def _delta_step(b_q, b_k, b_v, b_s, g, beta, DK: tl.constexpr):
    """One token's update of a head's state b_s [NB, DK, BV] (fp32; NB blocks of BV columns)
    from its q, k [1, DK, 1] (fp32, before the L2-norm), v [NB, BV], decay g and strength
    beta. Returns (the new state, the output q . S [NB, BV]).
    All five reductions (|q|^2, |k|^2, q.k and the columns' products with the raw q and k)
    read only the inputs, so they run side by side instead of one after another:
    with q^, k^ the normed q, k, d = e^g and delta = beta (v - d k^.S),
    S' = d S + k^ delta^T and q^.S' = d q^.S + (q^.k^) delta."""
    r_q = tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    r_k = tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    qk = tl.sum(b_q * b_k) * r_q * r_k
    q_s = tl.sum(b_s * b_q, axis=1) * r_q
    k_s = tl.sum(b_s * b_k, axis=1) * r_k
    decay = tl.exp(g)
    b_delta = (b_v - decay * k_s) * beta
    b_s = b_s * decay + (b_k * r_k) * b_delta[:, None, :]
    return b_s, decay * q_s + qk * b_delta


@triton.jit
def _gated_norm(b_o, b_z, b_w, eps, D: tl.constexpr, DT: tl.constexpr, AXIS: tl.constexpr):
    """w * rms_norm(o) * silu(z) over AXIS (None: the whole tile is one head), rounding like
    the layer (o and the normed o in DT, the activation dtype)."""
    b_o = b_o.to(DT).to(tl.float32)
    b_o = b_o * tl.rsqrt(tl.sum(b_o * b_o, axis=AXIS, keep_dims=True) / D + eps)
    b_o = (b_o.to(DT) * b_w).to(tl.float32)
    b_z = b_z.to(tl.float32)
    return (b_o * silu(b_z)).to(DT)


@triton.jit
def _recurrent_step_kernel(
    qkv_ptr,
    a_ptr,
    b_ptr,
    alog_ptr,
    dtb_ptr,
    state_ptr,
    slot_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    sq_ptr,
    stride_qkv,
    stride_ab,
    stride_ss,
    stride_sh,
    stride_zt,
    stride_y,
    eps,
    KEY_DIM,
    RATIO: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    COLS: tl.constexpr,
    BV: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (column block, v-head, sequence): COLS columns of the state [DK, DV], held as
    a tile [COLS // BV, DK, BV] in fp32 (the pool fp32 or bf16, rounded when stored): stored
    rows are read whole by a warp's threads (BV columns each). NORM (COLS = DV, a whole
    head): the output gets the layer's gated norm. Else the columns' o * w * silu(z) and
    their sum of o^2 (fp32, sq [B, Hv, DV // COLS]) are stored: the norm's parts, finished
    by the reader that scales each head by its 1 / rms.
    With PDL the state (and the layer's A_log, dt_bias, norm weight) is loaded before
    waiting for the previous kernel: a state pool is written only by this kernel, once per
    layer and step, and by PyTorch and prefill kernels launched without PDL, and between two
    steps there is always a graph boundary or such a kernel, so every earlier write is
    complete."""
    let_next_launch(USE_PDL)
    i_c, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k = i_h // RATIO  # the q/k head this v-head reads
    o_dk = tl.arange(0, DK)
    o_col = (
        i_c * COLS + tl.arange(0, COLS // BV)[:, None] * BV + tl.arange(0, BV)[None, :]
    )  # [COLS // BV, BV]
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    p_s = (
        state_ptr
        + slot * stride_ss
        + i_h * stride_sh
        + o_dk[None, :, None] * DV
        + o_col[:, None, :]
    )
    b_s = tl.load(p_s).to(tl.float32)
    a_log, dt_bias = tl.load(alog_ptr + i_h), tl.load(dtb_ptr + i_h)
    b_w = tl.load(w_ptr + o_col)
    wait_previous(USE_PDL)  # q, k, v, z, a, b come from the kernels just before
    p_row = qkv_ptr + i_b * stride_qkv
    b_q = tl.load(p_row + i_k * DK + o_dk).to(tl.float32)
    b_k = tl.load(p_row + KEY_DIM + i_k * DK + o_dk).to(tl.float32)
    b_v = tl.load(p_row + 2 * KEY_DIM + i_h * DV + o_col).to(tl.float32)
    g, beta = decay_and_beta(
        tl.load(a_ptr + i_b * stride_ab + i_h),
        tl.load(b_ptr + i_b * stride_ab + i_h),
        a_log,
        dt_bias,
    )
    b_z = tl.load(z_ptr + i_b * stride_zt + i_h * DV + o_col)
    b_s, b_o = _delta_step(b_q[None, :, None], b_k[None, :, None], b_v, b_s, g, beta, DK)
    tl.store(p_s, b_s.to(state_ptr.dtype.element_ty))
    if NORM:
        b_y = _gated_norm(b_o, b_z, b_w, eps, DV, y_ptr.dtype.element_ty, None)
    else:
        b_y = b_o * b_w.to(tl.float32) * silu(b_z.to(tl.float32))
        tl.store(sq_ptr + (i_b * tl.num_programs(1) + i_h) * (DV // COLS) + i_c, tl.sum(b_o * b_o))
    tl.store(y_ptr + i_b * stride_y + i_h * DV + o_col, b_y.to(y_ptr.dtype.element_ty))


@dataclass(frozen=True)
class RecurrentTiles:
    """The decode step's state columns per thread group (normed: a head per program) or per
    program (not normed), block_v (at most Dv), and num_warps."""

    block_v: int
    num_warps: int

    @classmethod
    def for_shape(cls, normed: bool) -> RecurrentTiles:
        """normed: 32 columns (16 and 32 within 1% at every batch), 4 warps (8: see the
        module docstring). Not normed: 16 columns on 1 warp, 8x the programs, for batch 1's
        32 heads."""
        return cls(32, 4) if normed else cls(16, 1)


def fused_recurrent_step(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    states: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    normed: bool = True,
    tiles: RecurrentTiles | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """qkv: [B, 2 * Hk * Dk + Hv * Dv] (after the conv); a, b: [B, Hv] (projections);
    z: [B, Hv, Dv] (heads packed, any row stride); a_log, dt_bias: [Hv]; norm_weight: [Dv];
    states: [S, Hv, Dk, Dv] fp32 or bf16 pool, updated in place at slots [B] (in fp32, the
    output from the fp32 state, rounded to the pool's dtype only when stored).
    Returns the gated-normed output [B, Hv, Dv] in z's dtype: a program per (head,
    sequence), block_v state columns per thread group (tiles: `RecurrentTiles.for_shape`).
    normed=False: a program owns block_v columns, so no program sees a whole head; returns
    the norm's parts
    (p = o * w * silu(z) [B, Hv, Dv] in z's dtype, and the sums of o^2 of each head's
    column blocks [B, Hv, Dv / block_v] fp32) for the reader that scales each head of p by
    1 / rms (`quant_gemv_rms_scaled`). Measured on the H200 (graphs of 30 layers at batch 1,
    from the in-projection GEMV to the out-projection's, less the bare GEMVs): 2.80 us, 3.33
    with p in fp32, 3.95 for the step with the norm (a head per program)."""
    bsz = qkv.shape[0]
    _, hv, dk, dv = states.shape
    key_dim = num_k_heads * dk
    if (
        qkv.shape[1] != 2 * key_dim + hv * dv
        or a.shape != (bsz, hv)
        or b.shape != (bsz, hv)
        or z.shape != (bsz, hv, dv)
    ):
        raise ValueError(
            f"qkv {list(qkv.shape)}, a {list(a.shape)}, b {list(b.shape)}, z {list(z.shape)} "
            f"do not fit states {list(states.shape)} with {num_k_heads} q/k heads"
        )
    if states.dtype not in (torch.float32, torch.bfloat16) or not states.is_contiguous():
        raise ValueError(f"the state pool must be contiguous fp32 or bf16, got {states.dtype}")
    qkv = qkv.contiguous()
    a, b = _one_row_stride(a, b)
    z = _heads_packed(z)
    y = torch.empty(bsz, hv, dv, device=qkv.device, dtype=z.dtype)
    tiles = tiles or RecurrentTiles.for_shape(normed)
    block_v = min(tiles.block_v, dv)
    cols = dv if normed else block_v
    sq = None if normed else torch.empty(bsz, hv, dv // cols, device=y.device, dtype=torch.float32)
    grid = (dv // cols, hv, bsz)
    fast(_recurrent_step_kernel)[grid](
        qkv,
        a,
        b,
        a_log,
        dt_bias,
        states,
        slots,
        z,
        norm_weight,
        y,
        sq,
        qkv.stride(0),
        a.stride(0),
        states.stride(0),
        states.stride(1),
        z.stride(0),
        y.stride(0),
        eps,
        key_dim,
        RATIO=hv // num_k_heads,
        DK=dk,
        DV=dv,
        COLS=cols,
        BV=block_v,
        NORM=normed,
        num_warps=tiles.num_warps,
        **launch_args(y, grid),
    )
    return y if normed else (y, sq)


def _heads_packed(z: torch.Tensor) -> torch.Tensor:
    """z [T, H, D] with its heads packed (any token stride), as the norm kernels read it."""
    if z.stride(2) != 1 or z.stride(1) != z.shape[2]:
        return z.contiguous()
    return z


def _one_row_stride(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, H] as the kernels read them: one row stride for both, heads packed. Views of
    one projection pass as they are; anything else is copied."""
    if b.shape == a.shape and b.stride() == a.stride() and a.stride(1) == 1:
        return a, b
    return a.contiguous(), b.contiguous()


@triton.jit(do_not_specialize=["T"])  # see kernels/launch.py
def _gates_kernel(
    a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, T, H, stride_ab, BLOCK: tl.constexpr
):
    """g and beta [T, H] fp32 for a prefill chunk (the decode step computes its own)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < T * H
    i_t, i_h = o // H, o % H
    g, beta = decay_and_beta(
        tl.load(a_ptr + i_t * stride_ab + i_h, mask=m, other=0.0),
        tl.load(b_ptr + i_t * stride_ab + i_h, mask=m, other=0.0),
        tl.load(alog_ptr + i_h, mask=m, other=0.0),
        tl.load(dtb_ptr + i_h, mask=m, other=0.0),
    )
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
        fast(_gates_kernel)[(triton.cdiv(t * h, 1024),)](
            a, b, a_log, dt_bias, g, beta, t, h, a.stride(0), BLOCK=1024
        )
    return g, beta


@triton.jit
def _gated_norm_kernel(
    o_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    eps,
    H,
    N,
    stride_zt,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """ROWS of the N rows (row i: token i // H, head i % H) of D values: y = w * rms_norm(o)
    * silu(z), rounding like the layer. z's heads are packed, its tokens stride_zt apart."""
    wait_for_previous(USE_PDL)
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m = (i < N)[:, None]
    o_d = tl.arange(0, D)[None, :]
    b_o = tl.load(o_ptr + i[:, None] * D + o_d, mask=m, other=0.0)
    b_z = tl.load(
        z_ptr + (i // H)[:, None] * stride_zt + (i % H)[:, None] * D + o_d, mask=m, other=0.0
    )
    b_w = tl.load(w_ptr + tl.arange(0, D))[None, :]  # 1-D, then broadcast: no shared memory
    b_y = _gated_norm(b_o, b_z, b_w, eps, D, y_ptr.dtype.element_ty, 1)
    tl.store(y_ptr + i[:, None] * D + o_d, b_y, mask=m)


GATED_NORM_ROWS = 8  # rows per program: one row per program is 131K programs at 4K tokens


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float):
    """The GDN output norm as one kernel: o [T, H, D] (fp32), z [T, H, D] (a view of the
    in-projection: heads packed, any token stride) -> [T, H, D] in z's dtype."""
    t, h, d = o.shape
    o, z = o.contiguous(), _heads_packed(z)
    y = torch.empty(z.shape, device=z.device, dtype=z.dtype)
    grid = (triton.cdiv(t * h, GATED_NORM_ROWS),)
    fast(_gated_norm_kernel)[grid](
        o,
        z,
        weight,
        y,
        eps,
        h,
        t * h,
        z.stride(0),
        D=d,
        ROWS=GATED_NORM_ROWS,
        num_warps=4,
        **launch_args(y, grid),
    )
    return y
