"""Fused-dequant GEMV for a few activation rows (decode): y[M, N] = x[M, K] @ W[N, K]^T,
W group-affine 4- or 8-bit (MLX layout), never materialised in memory.

Row-parallel: each program owns BLOCK_N output rows and walks K. Per group of G inputs,
    sum_k (s q_k + b) x_k = s * sum_k q_k x_k + b * sum_k x_k,
so the codes meet x in one multiply-add each and scale/bias are applied once per group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.quant.affine import QuantSpec


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    M: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_w = tl.arange(0, WORDS)
    o_g = tl.arange(0, GROUPS)
    o_k = tl.arange(0, BLOCK_K)
    shifts = tl.arange(0, PER_WORD) * BITS
    for i_m in tl.static_range(M):
        b_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m_k = (k0 + o_k) < K
            b_x = tl.load(x_ptr + i_m * stride_xm + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)
            p_w = w_ptr + o_n[:, None] * stride_wn + (k0 // PER_WORD + o_w)[None, :]
            m_w = m_n[:, None] & ((k0 // PER_WORD + o_w) < K // PER_WORD)[None, :]
            b_w = tl.load(p_w, mask=m_w, other=0)  # [BLOCK_N, WORDS] int32
            b_q = (b_w[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
            b_q = tl.reshape(b_q, [BLOCK_N, BLOCK_K]).to(tl.float32)
            b_qx = tl.sum(tl.reshape(b_q * b_x[None, :], [BLOCK_N, GROUPS, GROUP]), axis=2)
            b_xs = tl.sum(tl.reshape(b_x, [GROUPS, GROUP]), axis=1)  # [GROUPS]
            m_g = m_n[:, None] & ((k0 // GROUP + o_g) < K // GROUP)[None, :]
            o_s = o_n[:, None] * stride_sn + (k0 // GROUP + o_g)[None, :]
            b_s = tl.load(s_ptr + o_s, mask=m_g, other=0.0).to(tl.float32)
            b_b = tl.load(b_ptr + o_s, mask=m_g, other=0.0).to(tl.float32)
            b_acc += tl.sum(b_s * b_qx + b_b * b_xs[None, :], axis=1)
        tl.store(y_ptr + i_m * stride_ym + o_n, b_acc.to(y_ptr.dtype.element_ty), mask=m_n)


MAX_ROWS = 8  # beyond this, prefill paths (dequantising GEMM) take over


def _launch(x, packed, scales, biases, spec: QuantSpec, block_n, block_k, num_warps):
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
    x, packed, scales, biases = (t.contiguous() for t in (x, packed, scales, biases))
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_k = max(block_k, spec.group_size)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, packed.view(torch.int32), scales, biases, y,
        n, k, x.stride(0), packed.stride(0), scales.stride(0), y.stride(0),
        M=m, BITS=spec.bits, GROUP=spec.group_size, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps,
    )  # fmt: skip
    return y


def quant_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    block_n: int = 16,
    block_k: int = 256,
    num_warps: int = 4,
) -> torch.Tensor:
    """x: [M <= 8, K]; packed: [N, K * bits / 32] int32 (MLX uint32 bits); scales, biases:
    [N, K / group]. Returns y [M, N] in x's dtype (fp32 accumulation)."""
    return _launch(x, packed, scales, biases, spec, block_n, block_k, num_warps)
