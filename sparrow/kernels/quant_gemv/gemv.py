"""Fused-dequant GEMV for a few activation rows (decode): y[M, N] = x[M, K] @ W[N, K]^T,
W group-affine 4- or 8-bit (MLX layout), never materialised in memory.

Row-parallel: each program owns BLOCK_N output rows and walks K, for one activation row
(decode at batch 1) or for all of them (2..8 rows: each word of codes is unpacked once for
every row instead of once per row). Per word of codes (all in one group),
    sum_k (s q_k + b) x_k = s * sum_k q_k x_k + b * sum_k x_k,
so the codes meet x in one multiply-add each and scale/bias are applied once per word.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.quant.affine import QuantSpec


@triton.jit
def _words(w_ptr, s_ptr, b_ptr, o_n, m_n, o_w, n_words, stride_wn, stride_sn,
           WORDS_PER_GROUP: tl.constexpr):  # fmt: skip
    """Words o_w of rows o_n and each word's group scale and bias (fp32)."""
    m_w = o_w < n_words
    m_nw = m_n[:, None] & m_w[None, :]
    b_w = tl.load(w_ptr + o_n[:, None] * stride_wn + o_w[None, :], mask=m_nw, other=0)
    o_s = o_n[:, None] * stride_sn + (o_w // WORDS_PER_GROUP)[None, :]
    b_s = tl.load(s_ptr + o_s, mask=m_nw, other=0.0).to(tl.float32)
    b_b = tl.load(b_ptr + o_s, mask=m_nw, other=0.0).to(tl.float32)
    return m_w, b_w, b_s, b_b


@triton.jit
def gemv_rows(x_ptr, w_ptr, s_ptr, b_ptr, o_n, m_n, K, stride_wn, stride_sn,
              BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, MANTISSA: tl.constexpr = False):  # fmt: skip
    """sum_k W[o_n, k] x[k] for one activation row x (K contiguous values): fp32 [BLOCK_N].

    Works on whole 32-bit words: for code slot j of every word, the codes are
    (w >> BITS*j) & mask and meet x[word * PER_WORD + j]; the scale and bias of a word's
    group are loaded per word (cached), so there are no reshapes.

    Code to float without an int->float convert, two ways: `magic` (default) ORs q into the
    mantissa of 2^23 and subtracts 2^23 (shift, LOP3, FADD, FFMA per code); MANTISSA moves q
    to the top mantissa bits of 1.0, v = 1 + q / 2^BITS, and corrects once per word with
    sum x (shift, LOP3, FFMA per code). The second saves the FADD (sm_90 SASS: 90 -> 26
    FADD in the kernel) but not yet measured on the GPU: `python -m sparrow.bench.gemv`
    times both."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    WORDS_PER_GROUP: tl.constexpr = GROUP // PER_WORD
    o_w = tl.arange(0, WORDS)
    n_words = K // PER_WORD
    b_acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    for w0 in range(0, n_words, WORDS):
        m_w, b_w, b_s, b_b = _words(w_ptr, s_ptr, b_ptr, o_n, m_n, w0 + o_w, n_words, stride_wn,
                                    stride_sn, WORDS_PER_GROUP)  # fmt: skip
        b_qx = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        b_xs = tl.zeros([WORDS], dtype=tl.float32)
        p_x = x_ptr + (w0 + o_w) * PER_WORD
        for j in tl.static_range(PER_WORD):
            b_x = tl.load(p_x + j, mask=m_w, other=0.0).to(tl.float32)
            if MANTISSA:
                shift = (23 - BITS) - BITS * j  # code j to bits 23 - BITS .. 22
                if shift >= 0:
                    b_q = b_w << shift
                else:
                    b_q = b_w >> -shift
                b_q = (b_q & (((1 << BITS) - 1) << (23 - BITS))) | 0x3F800000
                b_qx += b_q.to(tl.float32, bitcast=True) * b_x[None, :]
            else:
                b_q = ((b_w >> (BITS * j)) & ((1 << BITS) - 1)) | 0x4B000000
                b_qx += (b_q.to(tl.float32, bitcast=True) - 8388608.0) * b_x[None, :]
            b_xs += b_x
        if MANTISSA:  # sum (s q + b) x = s 2^BITS (sum v x - sum x) + b sum x
            b_sf = b_s * (1 << BITS)
            b_acc += b_sf * b_qx + (b_b - b_sf) * b_xs[None, :]
        else:
            b_acc += b_s * b_qx + b_b * b_xs[None, :]
    return tl.sum(b_acc, axis=1)


@triton.jit
def gemv_multi_rows(x_ptr, stride_xm, M, w_ptr, s_ptr, b_ptr, o_n, m_n, K, stride_wn,
                    stride_sn, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """`gemv_rows` for M <= ROWS activation rows at once: each word of codes is unpacked
    once and meets every row (a program per row would unpack it M times). Returns fp32
    [ROWS, BLOCK_N]."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    WORDS_PER_GROUP: tl.constexpr = GROUP // PER_WORD
    o_w = tl.arange(0, WORDS)
    o_m = tl.arange(0, ROWS)
    n_words = K // PER_WORD
    b_acc = tl.zeros([ROWS, BLOCK_N, WORDS], dtype=tl.float32)
    for w0 in range(0, n_words, WORDS):
        m_w, b_w, b_s, b_b = _words(w_ptr, s_ptr, b_ptr, o_n, m_n, w0 + o_w, n_words, stride_wn,
                                    stride_sn, WORDS_PER_GROUP)  # fmt: skip
        b_qx = tl.zeros([ROWS, BLOCK_N, WORDS], dtype=tl.float32)
        b_xs = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        p_x = x_ptr + o_m[:, None] * stride_xm + ((w0 + o_w) * PER_WORD)[None, :]
        m_x = (o_m < M)[:, None] & m_w[None, :]
        for j in tl.static_range(PER_WORD):
            b_x = tl.load(p_x + j, mask=m_x, other=0.0).to(tl.float32)  # [ROWS, WORDS]
            b_q = ((b_w >> (BITS * j)) & ((1 << BITS) - 1)) | 0x4B000000
            b_q = b_q.to(tl.float32, bitcast=True) - 8388608.0  # [BLOCK_N, WORDS]
            b_qx += b_q[None, :, :] * b_x[:, None, :]
            b_xs += b_x
        b_acc += b_s[None, :, :] * b_qx + b_b[None, :, :] * b_xs[:, None, :]
    return tl.sum(b_acc, axis=2)


@triton.jit
def _gemv_multi_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N outputs of all M activation rows."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_y = gemv_multi_rows(x_ptr, stride_xm, M, w_ptr, s_ptr, b_ptr, o_n, m_n, K, stride_wn,
                          stride_sn, BITS, GROUP, BLOCK_N, BLOCK_K, ROWS)  # fmt: skip
    o_m = tl.arange(0, ROWS)
    p_y = y_ptr + o_m[:, None] * stride_ym + o_n[None, :]
    tl.store(p_y, b_y.to(y_ptr.dtype.element_ty), mask=(o_m < M)[:, None] & m_n[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MANTISSA: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N outputs of activation row i_m."""
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_y = gemv_rows(x_ptr + i_m * stride_xm, w_ptr, s_ptr, b_ptr, o_n, m_n, K, stride_wn,
                    stride_sn, BITS, GROUP, BLOCK_N, BLOCK_K, MANTISSA)  # fmt: skip
    tl.store(y_ptr + i_m * stride_ym + o_n, b_y.to(y_ptr.dtype.element_ty), mask=m_n)


MAX_ROWS = 8  # beyond this, prefill paths (dequantising GEMM) take over


def default_blocks(n: int, k: int) -> tuple[int, int]:
    """(block_n, block_k) from the sweep in `python -m sparrow.bench.gemv` (H200, 2 warps
    best everywhere): 8 x 512 for 2048 -> 8192 and the lm_head, 4 x 1024 for 4096 -> 2048
    (fewer output rows need smaller row blocks to fill 132 SMs)."""
    return (4, 1024) if n <= 4096 and k >= 4096 else (8, 512)


def _launch(x, packed, scales, biases, spec: QuantSpec, block_n, block_k, num_warps, num_stages,
            unpack):  # fmt: skip
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
    if m > 1 and unpack == "magic":  # all rows in one program: codes unpacked once
        rows = triton.next_power_of_2(m)
        _gemv_multi_kernel[(triton.cdiv(n, block_n),)](
            x, packed.view(torch.int32), scales, biases, y,
            m, n, k, x.stride(0), packed.stride(0), scales.stride(0), y.stride(0),
            BITS=spec.bits, GROUP=spec.group_size, BLOCK_N=block_n, BLOCK_K=block_k,
            ROWS=rows, num_warps=4 if rows == 8 else num_warps, num_stages=num_stages,
        )  # fmt: skip
        return y
    _gemv_kernel[(triton.cdiv(n, block_n), m)](
        x, packed.view(torch.int32), scales, biases, y,
        n, k, x.stride(0), packed.stride(0), scales.stride(0), y.stride(0),
        BITS=spec.bits, GROUP=spec.group_size, BLOCK_N=block_n, BLOCK_K=block_k,
        MANTISSA=unpack == "mantissa", num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


def quant_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 2,
    num_stages: int = 2,
    unpack: str = "magic",
) -> torch.Tensor:
    """x: [M <= 8, K]; packed: [N, K * bits / 32] int32 (MLX uint32 bits); scales, biases:
    [N, K / group]. Returns y [M, N] in x's dtype (fp32 accumulation). unpack: "magic" or
    "mantissa" (see `gemv_rows`)."""
    if unpack not in ("magic", "mantissa"):
        raise ValueError(f"unpack {unpack!r}: expected 'magic' or 'mantissa'")
    bn, bk = default_blocks(packed.shape[0], x.shape[-1])
    return _launch(x, packed, scales, biases, spec, block_n or bn, block_k or bk, num_warps,
                   num_stages, unpack)  # fmt: skip
