"""Group-affine 4/8-bit weights -> a float matrix in one pass (read the packed words, scales
and biases once, write the result once). Serves the dense projections on more rows than the
GEMV takes (prefill, large decode batches): dequantise, then one cuBLAS GEMM. The PyTorch
version of the same (`naive.py`) goes through int64 and fp32 temporaries of the full matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparrow.kernels.dequant.unpack import fit_block_k, packed_unpack, unpack_codes
from sparrow.kernels.launch import fast
from sparrow.quant.affine import QuantSpec


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    N,
    stride_wn,
    stride_sn,
    stride_yn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
):
    """Rows BLOCK_N x columns BLOCK_K (a power-of-two number of groups) of the float matrix.
    Words are loaded [BLOCK_N, GROUPS, words per group] with scales [BLOCK_N, GROUPS, 1]."""
    WPG: tl.constexpr = GROUP * BITS // 32
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = (o_n < N)[:, None, None]
    o_g = i_k * GROUPS + tl.arange(0, GROUPS)
    o_w = o_g[:, None] * WPG + tl.arange(0, WPG)[None, :]
    p_w = w_ptr + o_n[:, None, None].to(tl.int64) * stride_wn + o_w[None, :, :]
    b_w = tl.load(p_w, mask=m_n, other=0)
    o_s = o_n[:, None, None].to(tl.int64) * stride_sn + o_g[None, :, None]
    b_s = tl.load(s_ptr + o_s, mask=m_n, other=0.0)
    b_b = tl.load(b_ptr + o_s, mask=m_n, other=0.0)
    b_v = tl.reshape(unpack_codes(b_w, b_s, b_b, BITS, PACKED), [BLOCK_N, BLOCK_K])
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    p_y = y_ptr + o_n[:, None].to(tl.int64) * stride_yn + o_k[None, :]
    tl.store(p_y, b_v.to(y_ptr.dtype.element_ty), mask=(o_n < N)[:, None])


@dataclass(frozen=True)
class DequantTiles:
    """Weight rows (block_n) and columns (block_k, fit to K by `fit_block_k`) per program."""

    block_n: int = 16
    block_k: int = 256


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    dtype: torch.dtype = torch.float32,
    tiles: DequantTiles = DequantTiles(),
) -> torch.Tensor:
    """Same contract as `naive.dequantize` for a 2-D weight: packed [N, K * bits / 32] int32
    (MLX uint32 bits), scales and biases [N, K / group]. Returns [N, K] in `dtype`."""
    n, words = packed.shape
    k = words * spec.per_word
    if scales.shape != (n, k // spec.group_size) or biases.shape != scales.shape:
        raise ValueError(
            f"packed {list(packed.shape)} does not fit scales "
            f"{list(scales.shape)} / biases {list(biases.shape)}"
        )
    packed, scales, biases = (t.contiguous() for t in (packed.view(torch.int32), scales, biases))
    y = torch.empty(n, k, device=packed.device, dtype=dtype)
    block_n, block_k = tiles.block_n, fit_block_k(k, tiles.block_k, spec.group_size)
    fast(_dequant_kernel)[(triton.cdiv(n, block_n), k // block_k)](
        packed,
        scales,
        biases,
        y,
        n,
        packed.stride(0),
        scales.stride(0),
        y.stride(0),
        BITS=spec.bits,
        GROUP=spec.group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PACKED=packed_unpack(scales.dtype, spec.bits, packed.device) and scales.dtype == dtype,
    )
    return y
