"""Fused-dequant GEMV for one activation row (decode at batch 1): y[M, N] = x[M, K] @ W[N, K]^T,
W group-affine 4- or 8-bit (MLX layout), never materialised in memory. 2-64 rows go to the
tensor-core kernel in `mma.py` (it unpacks each code once for all rows).

Row-parallel: each program owns BLOCK_N output rows and walks K (`rows.gemv_rows`). This file
holds the dense kernel (plain, or gated: a fused gate_up with silu(gate) * up in its
epilogue), the row GEMV's tiles (`GemvTiles`) and the launch constexprs every row-GEMV kernel
shares (`row_meta`). The GDN layer's fused GEMVs are in `gdn.py`, the expert GEMVs in
`moe/expert_gemv.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sparrow.kernels.dequant.unpack import fit_block_k
from sparrow.kernels.launch import fast
from sparrow.kernels.pdl import launch_args
from sparrow.kernels.quant_gemv.mma import MMA_MAX_ROWS, MMA_ROWS, quant_mma
from sparrow.kernels.quant_gemv.rows import gated_rows, gemv_rows, start_gemv
from sparrow.quant.affine import QuantSpec


# x's and W's row strides each sit before a pointer, alone in 8 bytes of the constant bank:
# ptxas loads two 32-bit parameters that share 8 bytes with one LDC.64, which changes the
# registers and the order of the whole kernel (sm_90 SASS of the lm_head GEMV); so placed,
# every launched configuration compiles to the SASS of the measured kernels.
@triton.jit
def _gemv_kernel(
    x_ptr,
    stride_xm,
    w_ptr,
    stride_wn,
    s_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_sn,
    stride_ym,
    GATED: tl.constexpr,
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
):
    """One program: BLOCK_N outputs of output row i_m. y[i_m] = x[i_m] @ W^T, or GATED (W's
    rows N..2N the up projection of rows 0..N, a fused gate_up) silu(x W[:N]^T) *
    (x W[N:]^T). PREFETCH: see `gemv_rows`."""
    start_gemv(PREFETCH, False, USE_PDL)
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_x = x_ptr + i_m * stride_xm
    if GATED:
        # the activation's arguments are passed: Triton 3.6 compiles a nested call's
        # constexpr defaults as plain Python values, which fails
        b_y = gated_rows(
            p_x,
            w_ptr,
            s_ptr,
            b_ptr,
            i_n,
            N,
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
            X_IN_PLACE,
            ONE_STEP,
            "silu",
            0.0,
            0.0,
        )
    else:
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
    tl.store(y_ptr + i_m * stride_ym + o_n, b_y.to(y_ptr.dtype.element_ty), mask=m_n)


@dataclass(frozen=True)
class GemvTiles:
    """Launch shape and variant of a row GEMV: BLOCK_N output rows per program, K in steps of
    block_k (fit to K by `fit_block_k`), num_warps, num_stages (3 stages never beat 2 in the
    H200 sweeps of `bench.gemv`)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 2
    # the 4-bit products in packed fp16 pairs (`products.codes_dot_x_f16`), for 16-bit x on
    # the GPU (fp32 x keeps fp32 products: the precision it asks for). Error against the
    # dequantised reference (max-normalised) 3-6e-3 against 1e-6..2e-3 in fp32, below a bf16
    # output's rounding. The MoE layer on the H200 at 1 / 8 / 32 tokens (`bench.moe`): 16.9 /
    # 55.8 / 155.6 us against 18.9 / 64.5 / 192 with fp32 products; dense shapes in
    # `for_shape`
    f16_dot: bool = False
    # the weight prefetch of `gemv_rows` (dense GEMVs; None: with programmatic dependent
    # launch). The expert GEMVs prefetch when chained (`moe.expert_gemv.ExpertGemvTiles`)
    prefetch: bool | None = None
    # x loaded straight into the fp16-pair products' layout (None: where `x_in_place_pays`)
    x_in_place: bool | None = None

    @classmethod
    def for_shape(cls, n: int, k: int) -> GemvTiles:
        """Tiles for one row of n outputs over K = k, from the H200, each in a CUDA graph over
        weights beyond L2, in two runs of `bench.gemv`: A (fp16 pairs against fp32 products,
        alternating) and B (with x loaded in place and one K step).
        lm_head 2048 -> 248320: 32 x 1024, 4 warps, fp16 pairs, 76.0 us = 87% of bandwidth
        (A; fp32 products, 16 x 1024 with 1 warp: 87.0-93.0).
        2048 -> 12352: 32 x 1024, 4 warps, fp16 pairs: 5.45 us in B (16 x 2048 5.58, 32 x
        2048 5.53); 6.20 in A against 6.48 for fp32 products (8 x 1024, 1 warp).
        2048 -> 9216: 16 x 2048, 2 warps, fp16 pairs: 4.05 us in B (32 x 1024 with 4 warps
        5.43); in A 32 x 1024 5.95 against 6.09 for fp32 products (8 x 1024, 1 warp).
        2048 -> 8192: 16 x 2048, 2 warps, fp16 pairs: 3.79 us in B (32 x 2048 with 4 warps
        3.76, 8 x 2048 3.93); 4.89 in A against 6.16 for fp32 products.
        2048 -> 1024: 16 x 2048, 2 warps, fp16 pairs: 2.91 us in A against 3.88 for fp32.
        fp32 products: K >= 4096 (4096 -> 2048) 8 x 4096, 2 warps (3.61 us; fp16 pairs
        3.95); the 8-bit router 2048 -> 257 4 x 2048, 4 warps (3.0 us); smaller matrices
        4 x 1024, 2 warps. The fp16 pairs need many rows per thread to pay for converting x
        (1-warp 8-row blocks are slower)."""
        if n >= 65536:
            return cls(32, 1024, 4, f16_dot=True)
        if k >= 4096:
            return cls(8, 4096, 2)
        if n > 9216:
            return cls(32, 1024, 4, f16_dot=True)
        if n > 4096:
            return cls(16, 2048, 2, f16_dot=True)
        if k >= 2048:
            return cls(16, 2048, 2, f16_dot=True) if n >= 1024 else cls(4, 2048, 4)
        return cls(4, 1024, 2)


def x_in_place_pays(block_k: int, spec: QuantSpec, num_warps: int) -> bool:
    """Whether x goes straight into the fp16-pair products' layout (`codes_dot_x_f16`):
    where a block has as many even-odd word pairs per row as the program has threads, so no
    two threads load and convert the same x. Where more threads share a pair, the x is
    converted once and passed through shared memory (`codes_dot_x_f16_loaded`). On the
    H200, graphs over weights beyond L2, alternating 5 rounds:
    2048 -> 8192 at 16 x 2048 with 2 warps 4.08 us against 4.66 through shared memory (with
    ONE_STEP 3.79), 2048 -> 9216 4.23 against 5.94 (4.05), 2048 -> 1024 2.08 against 2.57
    (1.90), outputs equal to the bit; with two threads a pair, 32 x 1024 with 4 warps, 2048
    -> 12352 5.46 against 5.56 but the MoE layer at 8 tokens (gate_up 16 x 1024, 4 warps)
    58.9 against 49.3 us."""
    return spec.bits == 4 and block_k // spec.group_size * (spec.group_size // 16) >= 32 * num_warps


def row_meta(
    x: torch.Tensor,
    y: torch.Tensor,
    spec: QuantSpec,
    tiles: GemvTiles,
    grid: tuple[int, int],
    prefetch: bool | None,
) -> dict:
    """The constexprs and launch options every row-GEMV kernel takes, for x [R, K] and y on
    this grid: K steps fit to K (ONE_STEP: one step), the packed PTX paths on the GPU for
    4-bit codes, fp16-pair products and x in place as `GemvTiles` says (x in place only for
    a 16-byte aligned x with rows a multiple of 8 values apart), prefetch (None: with PDL)."""
    k = x.shape[1]
    pdl = launch_args(y, grid)
    bk = fit_block_k(k, tiles.block_k, spec.group_size)
    x_in_place = tiles.x_in_place
    if x_in_place is None:
        x_in_place = x_in_place_pays(bk, spec, tiles.num_warps)
    x_in_place = x_in_place and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0
    ptx = x.is_cuda and spec.bits == 4  # the packed PTX paths
    f16_dot = ptx and x.dtype != torch.float32 and tiles.f16_dot
    return dict(
        BITS=spec.bits,
        GROUP=spec.group_size,
        BLOCK_N=tiles.block_n,
        BLOCK_K=bk,
        PACKED=ptx,
        F16_DOT=f16_dot,
        PREFETCH=pdl["USE_PDL"] if prefetch is None else prefetch,
        X_IN_PLACE=f16_dot and x_in_place,
        ONE_STEP=bk == k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **pdl,
    )


def launch_gemv(
    x: torch.Tensor,
    w: tuple,
    y: torch.Tensor,
    spec: QuantSpec,
    tiles: GemvTiles,
    gated: bool = False,
) -> torch.Tensor:
    """Rows of y [R, N] from x [R, K] and w = (packed [N (2N if gated), K * bits / 32],
    scales, biases [N (2N), K / group]), as `tiles` say; gated: y = silu(gate) * up."""
    packed, scales, biases = w
    grid = (triton.cdiv(y.shape[1], tiles.block_n), y.shape[0])
    fast(_gemv_kernel)[grid](
        x,
        x.stride(0),
        packed.view(torch.int32),
        packed.stride(0),
        scales,
        biases,
        y,
        y.shape[1],
        x.shape[1],
        scales.stride(0),
        y.stride(0),
        GATED=gated,
        **row_meta(x, y, spec, tiles, grid, tiles.prefetch),
    )
    return y


MAX_ROWS = MMA_MAX_ROWS  # beyond this, prefill paths (dequantising GEMM) take over


def fused_pays(rows: int, n: int, k: int) -> bool:
    """Whether x [rows, k] @ W[n, k]^T is faster fused (`quant_gemv`) than dequantised, then
    one cuBLAS GEMM. From the H200 (`bench.batch --kernels`, graphs over weights beyond
    L2): matrices of more than 4096 rows fused up to MAX_ROWS rows (2048 -> 12352 at 64
    rows 21.4 against 34.1 us, the lm_head 245 against 673; 2048 -> 9216 23.1 against
    22.4); 4096 -> 2048 dequantised from 8 rows (13.6 against 18.6 us at 8 rows, 14.7
    against 29.1 at 64); other matrices fused up to MMA_ROWS rows."""
    if rows == 1 or n > 4096:
        return rows <= MAX_ROWS
    return rows <= MMA_ROWS and not (rows >= 8 and k >= 4096)


def check_weights(x, packed, scales, biases, spec: QuantSpec) -> None:
    """x [M <= MAX_ROWS, K] against packed [N, K * bits / 32] int32 and scales, biases
    [N, K / group]."""
    m, k = x.shape
    n = packed.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"GEMV takes at most {MAX_ROWS} rows, got {m}")
    if packed.shape != (n, k // spec.per_word) or scales.shape != (n, k // spec.group_size):
        raise ValueError(
            f"x {list(x.shape)} does not fit packed {list(packed.shape)} / scales "
            f"{list(scales.shape)} for {spec}"
        )
    if biases.shape != scales.shape or packed.dtype not in (torch.int32, torch.uint32):
        raise ValueError("biases must match scales; packed words must be int32/uint32")


def row_args(x, packed, scales, biases, outputs: int):
    """(x, weights, `GemvTiles.for_shape`) of a checked one-row GEMV with `outputs` outputs."""
    w = (packed.contiguous(), scales.contiguous(), biases.contiguous())
    return x.contiguous(), w, GemvTiles.for_shape(outputs, x.shape[1])


def quant_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    gated: bool = False,
    tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """x: [M <= MAX_ROWS, K]; packed: [N, K * bits / 32] int32 (MLX uint32 bits); scales,
    biases: [N, K / group]. Returns y [M, N] in x's dtype (fp32 accumulation). One row runs
    the row GEMV (tiles: default `GemvTiles.for_shape`), 2-64 rows the tensor-core kernel. gated:
    the rows are a fused gate_up [2I, K]; returns silu(gate) * up [M, I] (in the kernel at
    one row)."""
    check_weights(x, packed, scales, biases, spec)
    n = packed.shape[0]
    if x.shape[0] > 1:
        y = quant_mma(x, packed, scales, biases, spec)
        return F.silu(y[:, : n // 2]) * y[:, n // 2 :] if gated else y
    outputs = n // 2 if gated else n
    x, w, default = row_args(x, packed, scales, biases, outputs)
    y = torch.empty(1, outputs, device=x.device, dtype=x.dtype)
    return launch_gemv(x, w, y, spec, tiles or default, gated=gated)
