"""The row GEMV with a GDN layer's batch-1 decode fused in (4-bit projections, one token):
the in-projection with the conv's one-token step in its epilogue (`quant_gemv_conv`) and the
out-projection finishing the gated RMSNorm, each head of x scaled by its 1 / rms
(`quant_gemv_rms_scaled`). With the recurrent step between them a GDN mixer's decode is
three kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.activations import silu
from sparrow.kernels.launch import fast
from sparrow.kernels.quant_gemv.gemv import check_weights, row_args, row_meta
from sparrow.kernels.quant_gemv.rows import gemv_rows, start_gemv
from sparrow.quant.affine import QuantSpec


@triton.jit
def _gemv_conv_kernel(
    x_ptr,
    stride_xm,
    w_ptr,
    stride_wn,
    s_ptr,
    b_ptr,
    y_ptr,
    cw_ptr,
    conv_rows,
    cs_ptr,
    slot_ptr,
    N,
    K,
    stride_sn,
    stride_ym,
    stride_cs,
    stride_cp,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    F16_DOT: tl.constexpr,
    CONV_KW: tl.constexpr,
    X_IN_PLACE: tl.constexpr,
    ONE_STEP: tl.constexpr,
):
    """One program: BLOCK_N outputs of y[i_m] = x[i_m] @ W^T. The outputs below conv_rows are
    the GDN conv's channels: each gets its causal conv (weights cw [C, CONV_KW]) with the
    sequence's window in the conv-state pool cs (slot slot[i_m], channels contiguous,
    positions stride_cp apart) and SiLU, and the window moves by one. (Parameter order: see
    `gemv._gemv_kernel`; conv_rows too is alone in its 8 bytes.)"""
    start_gemv(PREFETCH, False, USE_PDL)
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_x = x_ptr + i_m * stride_xm
    # the window's older inputs, before any wait: only this kernel writes them
    m_c = o_n < conv_rows
    p_cs = cs_ptr + tl.load(slot_ptr + i_m).to(tl.int64) * stride_cs + o_n
    b_conv = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(CONV_KW - 1):
        b_old = tl.load(p_cs + j * stride_cp, mask=m_c, other=0.0)
        b_conv += b_old.to(tl.float32) * tl.load(
            cw_ptr + o_n * CONV_KW + j, mask=m_c, other=0.0
        ).to(tl.float32)
        if j > 0:  # position j of the old window is j - 1 of the new
            tl.store(p_cs + (j - 1) * stride_cp, b_old, mask=m_c)
    b_cw = tl.load(cw_ptr + o_n * CONV_KW + CONV_KW - 1, mask=m_c, other=0.0)
    b_y = gemv_rows(
        p_x,
        w_ptr,
        s_ptr,
        b_ptr,
        o_n,
        m_n,
        K,
        stride_wn,
        stride_sn,
        BITS,
        GROUP,
        BLOCK_N,
        BLOCK_K,
        PACKED,
        PREFETCH,
        USE_PDL,
        F16_DOT,
        X_IN_PLACE=X_IN_PLACE,
        ONE_STEP=ONE_STEP,
    )
    # the new input, rounded like the projection's output, ends the window
    b_in = b_y.to(y_ptr.dtype.element_ty)
    tl.store(p_cs + (CONV_KW - 2) * stride_cp, b_in.to(cs_ptr.dtype.element_ty), mask=m_c)
    b_conv += b_in.to(tl.float32) * b_cw.to(tl.float32)
    # the conv's output rounded before the SiLU, as the layer's (torch's) conv1d + silu
    b_conv = b_conv.to(y_ptr.dtype.element_ty).to(tl.float32)
    b_y = tl.where(m_c, silu(b_conv), b_y)
    tl.store(y_ptr + i_m * stride_ym + o_n, b_y.to(y_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _gemv_rms_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    sq_ptr,
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    F16_DOT: tl.constexpr,
    HEAD: tl.constexpr,
    PARTS: tl.constexpr,
    X_IN_PLACE: tl.constexpr,
    ONE_STEP: tl.constexpr,
):
    """One program: BLOCK_N outputs of y[i_m] = (x[i_m] * inv_rms) @ W^T, x's heads of HEAD
    values scaled by rsqrt(sum of their PARTS partial sums of squares at sq / HEAD + eps)
    (see `gemv_rows`)."""
    start_gemv(PREFETCH, False, USE_PDL)
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_x = x_ptr + i_m * stride_xm
    b_y = gemv_rows(
        p_x,
        w_ptr,
        s_ptr,
        b_ptr,
        o_n,
        m_n,
        K,
        stride_wn,
        stride_sn,
        BITS,
        GROUP,
        BLOCK_N,
        BLOCK_K,
        PACKED,
        PREFETCH,
        USE_PDL,
        F16_DOT,
        sq_ptr,
        eps,
        HEAD,
        PARTS,
        X_IN_PLACE,
        ONE_STEP,
    )
    tl.store(y_ptr + i_m * stride_ym + o_n, b_y.to(y_ptr.dtype.element_ty), mask=m_n)


def _one_row(x, packed, scales, biases, spec: QuantSpec, what: str):
    """The (x, weights, default tiles) of a one-row GEMV with a GDN fusion."""
    check_weights(x, packed, scales, biases, spec)
    if x.shape[0] != 1:
        raise ValueError(f"the GEMV with the {what} takes one row, got {x.shape[0]}")
    return row_args(x, packed, scales, biases, packed.shape[0])


def quant_gemv_conv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    conv_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """A GDN layer's in-projection at one decode token with its conv step in the epilogue:
    y = x @ W^T [1, N], the first C outputs (the conv's channels: conv_weight [C, KW],
    conv_pool [S, C, KW - 1] from `causal_conv1d.conv.state_pool`, updated in place at
    slots [1]) replaced by silu(causal conv) of the window they end. One kernel for the
    projection and the `causal_conv1d` decode step."""
    x, (packed, scales, biases), tiles = _one_row(x, packed, scales, biases, spec, "conv step")
    c, kw = conv_weight.shape
    if c > packed.shape[0] or conv_pool.shape[1:] != (c, kw - 1) or slots.shape != (1,):
        raise ValueError(
            f"conv weight {list(conv_weight.shape)}, pool "
            f"{list(conv_pool.shape)}, slots {list(slots.shape)} do not fit "
            f"{packed.shape[0]} outputs and one row"
        )
    if conv_pool.stride(1) != 1:
        raise ValueError("the conv-state pool's channels must be contiguous (`state_pool`)")
    y = torch.empty(1, packed.shape[0], device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(y.shape[1], tiles.block_n), 1)
    fast(_gemv_conv_kernel)[grid](
        x,
        x.stride(0),
        packed.view(torch.int32),
        packed.stride(0),
        scales,
        biases,
        y,
        conv_weight.contiguous(),
        c,
        conv_pool,
        slots,
        y.shape[1],
        x.shape[1],
        scales.stride(0),
        y.stride(0),
        conv_pool.stride(0),
        conv_pool.stride(2),
        CONV_KW=kw,
        **row_meta(x, y, spec, tiles, grid, tiles.prefetch),
    )
    return y


def quant_gemv_rms_scaled(
    x: torch.Tensor,
    sq_sums: torch.Tensor,
    eps: float,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    dtype: torch.dtype | None = None,
):
    """A GDN layer's out-projection at one decode token, finishing the layer's gated RMSNorm:
    y = (x * inv_rms) @ W^T [1, N] in dtype (default: the scales'), x [1, H, D] (the decode
    step's o * w * silu(z)), each head scaled by rsqrt(sum of sq_sums [1, H, P] / D +
    eps), the head's sum of o^2 in P parts (the step's column blocks; P a power of two). The
    factor multiplies each quantisation group's partial sum, so it waits for no reduction
    over x: on the H200 the norm computed whole from o and z in this GEMV's prologue costs
    2.7 us a layer more (graphs of 30 layers)."""
    heads = x.shape[1]
    if x.dim() != 3 or sq_sums.shape[:2] != (1, heads) or sq_sums.dtype != torch.float32:
        raise ValueError(
            f"x {list(x.shape)}, sums of squares {list(sq_sums.shape)} "
            f"{sq_sums.dtype}: expected [1, H, D] and [1, H, P] fp32"
        )
    x, (packed, scales, biases), tiles = _one_row(
        x.flatten(1), packed, scales, biases, spec, "norm"
    )
    k, parts = x.shape[1], sq_sums.shape[2]
    head = k // heads
    if head * heads != k or head % spec.group_size or parts & (parts - 1):
        raise ValueError(
            f"{heads} heads in {parts} parts do not split K = {k} into whole "
            f"groups of {spec.group_size} (parts: a power of two)"
        )
    y = torch.empty(1, packed.shape[0], device=x.device, dtype=dtype or scales.dtype)
    grid = (triton.cdiv(y.shape[1], tiles.block_n), 1)
    fast(_gemv_rms_kernel)[grid](
        x,
        packed.view(torch.int32),
        scales,
        biases,
        y,
        sq_sums[0].contiguous(),
        y.shape[1],
        k,
        eps,
        x.stride(0),
        packed.stride(0),
        scales.stride(0),
        y.stride(0),
        HEAD=head,
        PARTS=parts,
        **row_meta(x, y, spec, tiles, grid, tiles.prefetch),
    )
    return y
