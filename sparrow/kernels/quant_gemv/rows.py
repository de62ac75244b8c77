"""The row GEMV's K loop as `@triton.jit` device functions, shared by the kernels of its
uses (`gemv._gemv_kernel`: dense and gated; `gdn`: with the GDN conv step or the per-head
1 / rms; `moe.expert_gemv`: routed experts). Each kernel owns BLOCK_N output rows of one
activation row and calls `gemv_rows` (or `gated_rows`) for sum_k W[n, k] x[k] in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparrow.kernels.activations import glu
from sparrow.kernels.pdl import after_wait, let_next_launch, wait_for_previous, wait_previous
from sparrow.kernels.quant_gemv.products import (
    codes_dot_x,
    codes_dot_x_f16,
    codes_dot_x_f16_loaded,
)


@triton.jit
def _words(w_ptr, o_n, m_n, g0, o_gw, stride_wn, WPG: tl.constexpr):
    """Words [GROUPS, BLOCK_N, WPG] of groups g0.."""
    return tl.load(
        w_ptr + o_n[None, :, None] * stride_wn + g0 * WPG + o_gw[:, None, :],
        mask=m_n[None, :, None],
        other=0,
    )


@triton.jit
def _scales(s_ptr, b_ptr, o_n, m_n, g0, o_g, stride_sn):
    """Scales and biases [GROUPS, BLOCK_N] (fp32) of groups g0.."""
    o_s = o_n[None, :] * stride_sn + g0 + o_g[:, None]
    b_s = tl.load(s_ptr + o_s, mask=m_n[None, :], other=0.0).to(tl.float32)
    b_b = tl.load(b_ptr + o_s, mask=m_n[None, :], other=0.0).to(tl.float32)
    return b_s, b_b


@triton.jit
def _block_dot(
    x_ptr,
    b_w,
    g0,
    o_gw,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PACKED: tl.constexpr,
    F16_DOT: tl.constexpr,
    X_IN_PLACE: tl.constexpr,
):
    """The codes of one block (words b_w [GROUPS, BLOCK_N, WPG] of groups g0..) against x:
    F16_DOT (sum_k q_k x_k [GROUPS, BLOCK_N], sum_k x_k [GROUPS, 1]), else (sum_j v_j x
    per word [GROUPS, BLOCK_N, WPG], sum_j x [GROUPS, WPG]) (`codes_dot_x`)."""
    PER_WORD: tl.constexpr = 32 // BITS
    GROUPS: tl.constexpr = b_w.shape[0]
    WPG: tl.constexpr = GROUP // PER_WORD
    p_x = x_ptr + (g0 * WPG + o_gw) * PER_WORD
    if F16_DOT:
        if X_IN_PLACE:
            b_d, b_xs = codes_dot_x_f16(b_w, after_wait(x_ptr + g0 * GROUP), GROUPS, WPG)
        else:
            b_d, b_xs = codes_dot_x_f16_loaded(b_w, p_x)
    else:
        b_d, b_xs = codes_dot_x(b_w, p_x, BITS, PACKED)
    return b_d, b_xs


@triton.jit
def _block_sum(
    b_d,
    b_xs,
    b_s,
    b_b,
    g0,
    o_g,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    F16_DOT: tl.constexpr,
    sq_ptr,
    eps,
    HEAD: tl.constexpr,
    PARTS: tl.constexpr,
):
    """Each group's sum_k W x [GROUPS, BLOCK_N] from `_block_dot`'s sums and the groups'
    scales and biases b_s, b_b (HEAD > 0: times its head's 1 / rms, see `gemv_rows`)."""
    if F16_DOT:  # per group: sum (s q + b) x = s sum q x + b sum x
        b_g = b_s * b_d + b_b * b_xs
    else:
        # per group: sum (s q + b) x = s 2^BITS (sum v x - sum x) + b sum x; summing the
        # words of a group first keeps the [GROUPS, BLOCK_N, WPG] tile in one layout
        b_sf = b_s * (1 << BITS)
        b_g = b_sf * tl.sum(b_d, axis=2) + (b_b - b_sf) * tl.sum(b_xs, axis=1)[:, None]
    if HEAD > 0:
        o_sq = ((g0 + o_g) * GROUP // HEAD)[:, None] * PARTS + tl.arange(0, PARTS)[None, :]
        b_g *= tl.rsqrt(tl.sum(tl.load(sq_ptr + o_sq), axis=1) / HEAD + eps)[:, None]
    return b_g


@triton.jit
def gemv_rows(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    o_n,
    m_n,
    K,
    stride_wn,
    stride_sn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    F16_DOT: tl.constexpr = False,
    sq_ptr=None,
    eps=0.0,
    HEAD: tl.constexpr = 0,
    PARTS: tl.constexpr = 1,
    X_IN_PLACE: tl.constexpr = False,
    ONE_STEP: tl.constexpr = False,
):
    """sum_k W[o_n, k] x[k] for one activation row x (K contiguous values): fp32 [BLOCK_N].
    K % BLOCK_K == 0. HEAD > 0: x's heads of HEAD values (whole groups) are scaled by their
    1 / rms, from the PARTS partial sums of squares per head at sq (`quant_gemv_rms_scaled`):
    each group's sum is multiplied by its head's factor.

    Works on whole 32-bit words, as a [GROUPS, BLOCK_N, WPG] tile (WPG words per group);
    scale and bias apply per group after the words of a group are summed. The dim order
    decides Triton's thread layout: with groups first, a warp's threads spread over groups
    and the warps over rows, so a thread holds the same words of several rows and converts
    each x once for all of them (rows first put one row per thread: 5.74 SASS instructions
    per code at 16 x 1024 with 4 warps, 4.71 this way). Code slot j of
    every word meets x[word * PER_WORD + j]. Codes become floats v = 1 + q / 2^BITS (shift,
    LOP3; FFMA with x) and the 1 is taken off once per word with sum x. PACKED: the 4-bit
    unpacking in PTX (the GPU path).

    PREFETCH (with programmatic dependent launch): the first weight tile is loaded before
    waiting for the previous kernel (weights never depend on it; x does), and each tile
    while the one before is consumed. ONE_STEP: K == BLOCK_K. Then with PREFETCH and
    X_IN_PLACE there is no prefetch inside the loop, where a masked-off tile costs registers
    (168 instead of 246 at 16 x 2048 with 2 warps; with fp32 products ptxas spills 3 KB
    without that prefetch, hence only with x in place), and without PREFETCH and PDL no
    loop (straight-line code). On the H200 the MoE layer's down GEMV (K 512) as straight
    line, 8 layers from HBM, alternating 5 rounds:
    8 tokens 47.66 against 49.58 us with the loop, 32 tokens 130.7 against 138.2, outputs
    identical; under PDL it is slower (2 tokens 26.45 against 25.04), and so with prefetch
    (2048 -> 9216 5.03 against 4.29 us: the loads before the wait have no loop to keep them
    there).
    X_IN_PLACE (F16_DOT): `codes_dot_x_f16`, else `codes_dot_x_f16_loaded`."""
    PER_WORD: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GROUP // PER_WORD
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    o_g = tl.arange(0, GROUPS)
    o_v = tl.arange(0, WPG)
    o_gw = o_g[:, None] * WPG + o_v[None, :]  # word within the block, [GROUPS, WPG]
    if ONE_STEP and not PREFETCH and not USE_PDL:  # one block, no loop
        b_w = _words(w_ptr, o_n, m_n, 0, o_gw, stride_wn, WPG)
        b_d, b_xs = _block_dot(x_ptr, b_w, 0, o_gw, BITS, GROUP, PACKED, F16_DOT, X_IN_PLACE)
        b_s, b_b = _scales(s_ptr, b_ptr, o_n, m_n, 0, o_g, stride_sn)
        b_acc = _block_sum(
            b_d, b_xs, b_s, b_b, 0, o_g, BITS, GROUP, F16_DOT, sq_ptr, eps, HEAD, PARTS
        )
        return tl.sum(b_acc, axis=0)
    b_acc = tl.zeros([GROUPS, BLOCK_N], dtype=tl.float32)
    num_groups = K // GROUP
    if PREFETCH:
        b_w = _words(w_ptr, o_n, m_n, 0, o_gw, stride_wn, WPG)
        b_s, b_b = _scales(s_ptr, b_ptr, o_n, m_n, 0, o_g, stride_sn)
        wait_previous(USE_PDL)
    for g0 in range(0, num_groups, GROUPS):
        if not PREFETCH:
            b_w = _words(w_ptr, o_n, m_n, g0, o_gw, stride_wn, WPG)
        b_d, b_xs = _block_dot(x_ptr, b_w, g0, o_gw, BITS, GROUP, PACKED, F16_DOT, X_IN_PLACE)
        if not PREFETCH:  # loaded after the codes' use: fewer layout changes (SASS)
            b_s, b_b = _scales(s_ptr, b_ptr, o_n, m_n, g0, o_g, stride_sn)
        b_acc += _block_sum(
            b_d, b_xs, b_s, b_b, g0, o_g, BITS, GROUP, F16_DOT, sq_ptr, eps, HEAD, PARTS
        )
        if PREFETCH and not (ONE_STEP and X_IN_PLACE):  # the next tile (none past the end)
            m_next = m_n & (o_n * 0 + g0 + GROUPS < num_groups)
            b_w = _words(w_ptr, o_n, m_next, g0 + GROUPS, o_gw, stride_wn, WPG)
            b_s, b_b = _scales(s_ptr, b_ptr, o_n, m_next, g0 + GROUPS, o_g, stride_sn)
    return tl.sum(b_acc, axis=0)


@triton.jit
def gated_rows(
    p_x,
    w_ptr,
    s_ptr,
    b_ptr,
    i_n,
    N,
    K,
    stride_wn,
    stride_sn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    F16_DOT: tl.constexpr,
    X_IN_PLACE: tl.constexpr,
    ONE_STEP: tl.constexpr,
    ACT: tl.constexpr = "silu",
    ALPHA: tl.constexpr = 0.0,
    LIMIT: tl.constexpr = 0.0,
):
    """glu(x W[n]^T, x W[N + n]^T) (`activations.glu`: silu(gate) * up by default) for the
    BLOCK_N outputs n of block i_n of a fused gate_up W [2N, K]: the gate rows and the up
    rows N below them in one walk over K, as one tile of 2 BLOCK_N rows (`gemv_rows`). fp32
    [BLOCK_N]."""
    o_gu = tl.arange(0, 2 * BLOCK_N)
    o_rows = i_n * BLOCK_N + o_gu % BLOCK_N + (o_gu // BLOCK_N) * N
    m_rows = i_n * BLOCK_N + o_gu % BLOCK_N < N
    b_gu = gemv_rows(
        p_x,
        w_ptr,
        s_ptr,
        b_ptr,
        o_rows,
        m_rows,
        K,
        stride_wn,
        stride_sn,
        BITS,
        GROUP,
        2 * BLOCK_N,
        BLOCK_K,
        PACKED,
        PREFETCH,
        USE_PDL,
        F16_DOT,
        X_IN_PLACE=X_IN_PLACE,
        ONE_STEP=ONE_STEP,
    )
    b_y, b_u = tl.split(tl.permute(tl.reshape(b_gu, [2, BLOCK_N]), [1, 0]))
    return glu(b_y, b_u, ACT, ALPHA, LIMIT)


@triton.jit
def start_gemv(PREFETCH: tl.constexpr, LATE_TRIGGER: tl.constexpr, USE_PDL: tl.constexpr):
    """A GEMV kernel's first statement under programmatic dependent launch. PREFETCH: let
    the next kernel launch now; `gemv_rows` waits after its first weight loads. LATE_TRIGGER:
    wait first, then let the next kernel launch (`gemv_rows` then prefetches within its loop
    only), so the next kernel may read what the kernel before this one wrote before its own
    wait. Otherwise `wait_for_previous`."""
    if LATE_TRIGGER:
        wait_previous(USE_PDL)
        let_next_launch(USE_PDL)
    elif PREFETCH:
        let_next_launch(USE_PDL)
    else:
        wait_for_previous(USE_PDL)
