"""Group-affine 4/8-bit weights -> a float matrix in one pass (read the packed words, scales
and biases once, write the result once). Serves the dense projections on more rows than the
GEMV takes (prefill, large decode batches): dequantise, then one cuBLAS GEMM. The PyTorch
version of the same (`naive.py`) goes through int64 and fp32 temporaries of the full matrix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.quant.affine import QuantSpec


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, b_ptr, y_ptr, N, stride_wn, stride_sn, stride_yn,
                    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):  # fmt: skip
    """Rows BLOCK_N x columns BLOCK_K (a whole number of groups) of the float matrix."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = (o_n < N)[:, None]
    o_w = i_k * WORDS + tl.arange(0, WORDS)
    b_w = tl.load(w_ptr + o_n[:, None].to(tl.int64) * stride_wn + o_w[None, :], mask=m_n,
                  other=0)  # fmt: skip
    shifts = tl.arange(0, PER_WORD) * BITS
    b_q = (b_w[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    b_q = tl.reshape(b_q, [BLOCK_N, BLOCK_K]).to(tl.float32)  # column = word * PER_WORD + j
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    o_s = o_n[:, None].to(tl.int64) * stride_sn + (o_k // GROUP)[None, :]
    b_s = tl.load(s_ptr + o_s, mask=m_n, other=0.0).to(tl.float32)
    b_b = tl.load(b_ptr + o_s, mask=m_n, other=0.0).to(tl.float32)
    p_y = y_ptr + o_n[:, None].to(tl.int64) * stride_yn + o_k[None, :]
    tl.store(p_y, (b_q * b_s + b_b).to(y_ptr.dtype.element_ty), mask=m_n)


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    dtype: torch.dtype = torch.float32,
    block_n: int = 16,
) -> torch.Tensor:
    """Same contract as `naive.dequantize` for a 2-D weight: packed [N, K * bits / 32] int32
    (MLX uint32 bits), scales and biases [N, K / group]. Returns [N, K] in `dtype`."""
    n, words = packed.shape
    k = words * spec.per_word
    if scales.shape != (n, k // spec.group_size) or biases.shape != scales.shape:
        raise ValueError(f"packed {list(packed.shape)} does not fit scales "
                         f"{list(scales.shape)} / biases {list(biases.shape)}")  # fmt: skip
    packed, scales, biases = (t.contiguous() for t in (packed.view(torch.int32), scales, biases))
    y = torch.empty(n, k, device=packed.device, dtype=dtype)
    block_k = spec.group_size * max(1, 256 // spec.group_size)  # whole groups
    while k % block_k:
        block_k //= 2
    _dequant_kernel[(triton.cdiv(n, block_n), k // block_k)](
        packed, scales, biases, y, n, packed.stride(0), scales.stride(0), y.stride(0),
        BITS=spec.bits, GROUP=spec.group_size, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y
