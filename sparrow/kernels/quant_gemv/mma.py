"""Fused-dequant matmul for 2-16 activation rows (decode batches): y[M, N] = x[M, K] @ W[N, K]^T
with W group-affine 4/8-bit, on tensor cores.

A program takes BLOCK_N weight rows. Each K step unpacks a [BLOCK_N, BLOCK_K] tile to the
activation dtype in registers (`unpack_codes`: two codes per instruction for 4-bit bf16) and
multiplies it with the activation rows padded to 16 (`tl.dot`, fp32 accumulation): the codes
are expanded once for all rows, and the multiply-adds leave the ALUs for the tensor cores.
The split variant gives each of SPLIT warps its own K range (independent accumulators,
summed at the end) for matrices with few rows, where row blocks alone leave SMs idle. It is
a second kernel, not SPLIT = 1 of one: with a batch axis of 1 Triton still spreads the warps
over it (sm_90 SASS: 9.9 instructions per code against 4.7 for the 2-D kernel).

Measured on the H200 at 8 rows (`python -m sparrow.bench.gemv --rows 8`, 2026-11-30):
2048 -> 12352 19.7 us (the row GEMV, unpacking per row: 58 us), lm_head 320 us (1,083),
4096 -> 2048 13.2 us with SPLIT 4 (39.5). At one row the row GEMV is faster (2048 -> 12352:
24.6 us here against 14.7 for the row GEMV in the same run): each K step waits on the
tile's round trip through shared memory and a chain of dependent MMAs that one row cannot
hide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparrow.kernels.dequant.unpack import fit_block_k, group_scales, packed_unpack, unpack_codes
from sparrow.kernels.launch import fast
from sparrow.kernels.pdl import launch_args, wait_for_previous
from sparrow.quant.affine import QuantSpec

MMA_ROWS = 16  # activation rows padded to the MMA's minimum N
MMA_MAX_ROWS = 64  # more rows: a dequantising GEMM


@triton.jit
def _tile(
    w_ptr,
    b_s,
    b_b,
    o_n,
    m_n,
    o_g,
    stride_wn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PACKED: tl.constexpr,
):
    """Groups o_g of rows o_n as values [..., BLOCK_N, GROUPS, words per group, codes per
    word]. o_n, m_n: [..., BLOCK_N, 1, 1]; o_g: [..., 1, GROUPS, 1]. Words are loaded
    [..., BLOCK_N, GROUPS, words per group] and the scales b_s, b_b come as
    [..., BLOCK_N, GROUPS, 1] (`group_scales`), so a word's scale is a broadcast, not a
    gather. The kernels load the scales one K step ahead: the compiler's pipelining moves
    the codes through shared memory but loads these where they are used, so without the
    prefetch each K step waited for them."""
    WPG: tl.constexpr = GROUP * BITS // 32
    o_w = o_g * WPG + tl.arange(0, WPG)
    b_w = tl.load(w_ptr + o_n * stride_wn + o_w, mask=m_n, other=0)
    return unpack_codes(b_w, b_s, b_b, BITS, PACKED)


@triton.jit
def _mma_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
    PRECISION: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: BLOCK_N outputs of all M <= ROWS rows. K % BLOCK_K == 0."""
    wait_for_previous(USE_PDL)
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_g = tl.arange(0, GROUPS)
    o_m = tl.arange(0, ROWS)
    o_k = tl.arange(0, BLOCK_K)
    b_acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    n3, m3, last = o_n[:, None, None], m_n[:, None, None], K // GROUP - GROUPS
    b_s, b_b = group_scales(s_ptr, b_ptr, n3, m3, o_g[None, :, None], stride_sn)
    for g0 in range(0, K // GROUP, GROUPS):
        g_next = tl.minimum(g0 + GROUPS, last)  # the last step reloads its own
        b_s_next, b_b_next = group_scales(
            s_ptr, b_ptr, n3, m3, (g_next + o_g)[None, :, None], stride_sn
        )
        b_a = _tile(
            w_ptr, b_s, b_b, n3, m3, (g0 + o_g)[None, :, None], stride_wn, BITS, GROUP, PACKED
        )
        b_s, b_b = b_s_next, b_b_next
        b_a = tl.reshape(b_a, [BLOCK_N, BLOCK_K])
        p_x = x_ptr + o_m[:, None] * stride_xm + g0 * GROUP + o_k[None, :]
        b_x = tl.load(p_x, mask=(o_m < M)[:, None], other=0.0)
        b_acc = tl.dot(b_a.to(b_x.dtype), tl.trans(b_x), b_acc, input_precision=PRECISION)
    p_y = y_ptr + o_m[None, :] * stride_ym + o_n[:, None]
    tl.store(p_y, b_acc.to(y_ptr.dtype.element_ty), mask=m_n[:, None] & (o_m < M)[None, :])


@triton.jit
def _mma_split_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PACKED: tl.constexpr,
    PRECISION: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """`_mma_kernel` with K cut into SPLIT ranges, one batched-dot slice each
    (K % (SPLIT * BLOCK_K) == 0)."""
    wait_for_previous(USE_PDL)
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_p = tl.arange(0, SPLIT)
    o_g = tl.arange(0, GROUPS)
    o_m = tl.arange(0, ROWS)
    o_k = tl.arange(0, BLOCK_K)
    groups_split = K // GROUP // SPLIT
    b_acc = tl.zeros([SPLIT, BLOCK_N, ROWS], dtype=tl.float32)
    o_gs = (o_p[:, None] * groups_split + o_g[None, :])[:, None, :, None]  # [SPLIT, 1, G, 1]
    p_x = (
        x_ptr
        + o_m[None, :, None] * stride_xm
        + (o_p * groups_split * GROUP)[:, None, None]
        + o_k[None, None, :]
    )
    m_x = (o_m < M)[None, :, None]
    n4, m4, last = o_n[None, :, None, None], m_n[None, :, None, None], groups_split - GROUPS
    b_s, b_b = group_scales(s_ptr, b_ptr, n4, m4, o_gs, stride_sn)
    for g0 in range(0, groups_split, GROUPS):
        g_next = tl.minimum(g0 + GROUPS, last)  # the last step reloads its own
        b_s_next, b_b_next = group_scales(s_ptr, b_ptr, n4, m4, g_next + o_gs, stride_sn)
        b_a = _tile(w_ptr, b_s, b_b, n4, m4, g0 + o_gs, stride_wn, BITS, GROUP, PACKED)
        b_s, b_b = b_s_next, b_b_next
        b_a = tl.reshape(b_a, [SPLIT, BLOCK_N, BLOCK_K])
        b_x = tl.load(p_x + g0 * GROUP, mask=m_x, other=0.0)
        b_acc = tl.dot(
            b_a.to(b_x.dtype), tl.permute(b_x, (0, 2, 1)), b_acc, input_precision=PRECISION
        )
    b_y = tl.sum(b_acc, axis=0)
    p_y = y_ptr + o_m[None, :] * stride_ym + o_n[:, None]
    tl.store(p_y, b_y.to(y_ptr.dtype.element_ty), mask=m_n[:, None] & (o_m < M)[None, :])


@dataclass(frozen=True)
class MmaTiles:
    """Weight rows per program (block_n), K per step (block_k, fit to each K range), K ranges
    over warps (split: 1 for the 2-D kernel, halved until it divides the groups), num_warps,
    num_stages."""

    block_n: int
    block_k: int
    split: int
    num_warps: int
    num_stages: int = 3

    @classmethod
    def for_shape(cls, n: int, k: int, rows: int = MMA_ROWS) -> MmaTiles:
        """From the H200 (`bench.batch --kernels`, graphs over weights beyond L2): matrices
        of more than 4096 rows take 64 x 128 tiles on one K range at every row count: 2048
        -> 12352 19.2 / 22.9 / 21.4 us at 8 / 32 / 64 rows against 28.7 / 22.6 / 32.9 with
        32 x 256, 2048 -> 9216 18.2 against 25.0 at 8 rows, the lm_head 2048 -> 248320
        168 / 187 / 245 against 322 / 397 / 576. Smaller matrices up to 16 rows split K
        over 4 warps (2 for K = 512: an earlier sweep at 8 rows); past 16 rows the split
        kernel's accumulators no longer fit in shared memory at K = 4096, so 64 x 128 on
        one range there too."""
        if n > 4096 or rows > MMA_ROWS:
            return cls(block_n=64, block_k=128, split=1, num_warps=4)
        if k <= 512:
            return cls(block_n=16, block_k=256, split=2, num_warps=2)
        return cls(block_n=16, block_k=256, split=4, num_warps=4)


def quant_mma(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    tiles: MmaTiles | None = None,
) -> torch.Tensor:
    """x: [M <= MMA_MAX_ROWS, K] (fp16/bf16 on the GPU; fp16/fp32 under the interpreter);
    packed [N, K * bits / 32] int32; scales, biases [N, K / group]. Returns y [M, N] in x's
    dtype. The rows are padded to 16, 32 or 64 (the MMA's N). tiles: default
    `MmaTiles.for_shape`."""
    m, k = x.shape
    n = packed.shape[0]
    if m > MMA_MAX_ROWS:
        raise ValueError(f"quant_mma takes at most {MMA_MAX_ROWS} rows, got {m}")
    if k % spec.group_size:
        raise ValueError(f"K = {k} is not a multiple of the group size {spec.group_size}")
    tiles = tiles or MmaTiles.for_shape(n, k, m)
    groups, split = k // spec.group_size, tiles.split
    while groups % split:
        split //= 2
    x, packed, scales, biases = (t.contiguous() for t in (x, packed, scales, biases))
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    args = (
        x,
        packed.view(torch.int32),
        scales,
        biases,
        y,
        m,
        n,
        k,
        x.stride(0),
        packed.stride(0),
        scales.stride(0),
        y.stride(0),
    )
    meta = dict(
        BITS=spec.bits,
        GROUP=spec.group_size,
        BLOCK_N=tiles.block_n,
        BLOCK_K=fit_block_k(k // split, tiles.block_k, spec.group_size),
        PACKED=packed_unpack(scales.dtype, spec.bits, x.device),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 means fp32
        ROWS=max(MMA_ROWS, triton.next_power_of_2(m)),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    grid = (triton.cdiv(n, tiles.block_n),)
    if split == 1:
        fast(_mma_kernel)[grid](*args, **meta, **launch_args(y, grid))
    else:
        fast(_mma_split_kernel)[grid](*args, SPLIT=split, **meta, **launch_args(y, grid))
    return y
