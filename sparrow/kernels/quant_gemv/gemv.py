"""Fused-dequant GEMV for one activation row (decode at batch 1): y[M, N] = x[M, K] @ W[N, K]^T,
W group-affine 4- or 8-bit (MLX layout), never materialised in memory. 2-16 rows go to the
tensor-core kernel in `mma.py` (it unpacks each code once for all rows).

Row-parallel: each program owns BLOCK_N output rows and walks K. Per word of codes (all in
one group),
    sum_k (s q_k + b) x_k = s * sum_k q_k x_k + b * sum_k x_k,
so the codes meet x in one multiply-add each and scale/bias are applied once per word.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sparrow.kernels.activations import silu
from sparrow.kernels.dequant.unpack import fit_block_k
from sparrow.kernels.launch import fast
from sparrow.kernels.pdl import (
    after_wait,
    launch_args,
    let_next_launch,
    wait_for_previous,
    wait_previous,
)
from sparrow.kernels.quant_gemv.mma import MMA_ROWS, quant_mma
from sparrow.quant.affine import QuantSpec

# code j of a word to the top mantissa bits (19-22) of 1.0: shift by 19 - 4j, then one LOP3
# (mask | exponent; Triton's own `(t & m) | e` compiles to two).
_MANTISSA_ASM = tl.constexpr("{\n.reg .b32 t;\n" + "".join(
    f"{'shl' if 19 - 4 * j >= 0 else 'shr'}.b32 t, $8, {abs(19 - 4 * j)};\n"
    f"lop3.b32 ${j}, t, 0x00780000, 0x3F800000, 0xEA;\n" for j in range(8)) + "}")


@triton.jit
def _code_floats(b_w, j: tl.constexpr, BITS: tl.constexpr):
    """Code j of every word as the float 1 + q / 2^BITS (q in the top mantissa bits of 1.0:
    no int->float convert)."""
    shift: tl.constexpr = (23 - BITS) - BITS * j  # code j to bits 23 - BITS .. 22
    if shift >= 0:
        b_q = b_w << shift
    else:
        b_q = b_w >> -shift
    b_q = (b_q & (((1 << BITS) - 1) << (23 - BITS))) | 0x3F800000
    return b_q.to(tl.float32, bitcast=True)


@triton.jit
def _x_slots8(b_x):
    """x [G, W, 8] (the 8 values each word's codes meet) -> its 8 slots [G, W], in
    registers (reshape and split: no shared-memory round trip)."""
    e, o = tl.split(tl.reshape(b_x, [b_x.shape[0], b_x.shape[1], 2, 2, 2]))
    ee, eo = tl.split(e)
    oe, oo = tl.split(o)
    x0, x4 = tl.split(ee)
    x2, x6 = tl.split(eo)
    x1, x5 = tl.split(oe)
    x3, x7 = tl.split(oo)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_slots4(b_x):
    """x [G, W, 4] -> its 4 slots [G, W] (8-bit words)."""
    e, o = tl.split(tl.reshape(b_x, [b_x.shape[0], b_x.shape[1], 2, 2]))
    x0, x2 = tl.split(e)
    x1, x3 = tl.split(o)
    return x0, x1, x2, x3


@triton.jit
def _codes_dot_x(b_w, p_x, BITS: tl.constexpr, PACKED: tl.constexpr):
    """sum_j v_j x[word * PER_WORD + j] per word ([GROUPS, BLOCK_N, WPG]) and sum_j x
    ([GROUPS, WPG]), v_j = 1 + q_j / 2^BITS. The x of each word come in one vector load
    (p_x: [GROUPS, WPG] word starts) and are split into slots in registers."""
    PER_WORD: tl.constexpr = 32 // BITS
    b_x = tl.load(p_x[:, :, None] + tl.arange(0, PER_WORD)[None, None, :]).to(tl.float32)
    b_xs = tl.sum(b_x, axis=2)
    if PER_WORD == 8:
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_slots8(b_x)
        if PACKED:  # on the GPU: shift + LOP3 per code in PTX
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                _MANTISSA_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b_w], (tl.float32,) * 8, True, 1)
        else:
            v0, v1 = _code_floats(b_w, 0, BITS), _code_floats(b_w, 1, BITS)
            v2, v3 = _code_floats(b_w, 2, BITS), _code_floats(b_w, 3, BITS)
            v4, v5 = _code_floats(b_w, 4, BITS), _code_floats(b_w, 5, BITS)
            v6, v7 = _code_floats(b_w, 6, BITS), _code_floats(b_w, 7, BITS)
        b_qx = (v0 * x0[:, None, :] + v1 * x1[:, None, :] + v2 * x2[:, None, :]
                + v3 * x3[:, None, :] + v4 * x4[:, None, :] + v5 * x5[:, None, :]
                + v6 * x6[:, None, :] + v7 * x7[:, None, :])  # fmt: skip
    else:
        x0, x1, x2, x3 = _x_slots4(b_x)
        b_qx = (_code_floats(b_w, 0, BITS) * x0[:, None, :]
                + _code_floats(b_w, 1, BITS) * x1[:, None, :]
                + _code_floats(b_w, 2, BITS) * x2[:, None, :]
                + _code_floats(b_w, 3, BITS) * x3[:, None, :])  # fmt: skip
    return b_qx, b_xs


# Two words' 16 codes against 8 fp16 pairs of (scaled) x: for each word, ANDs with 0x000F000F
# and 0x00F000F0 leave codes 0 and 4, and 1 and 5 times 16, in the two 16-bit halves, as
# fp16 subnormals q * 2^-24 and q * 2^-20 (exact); a shift by 8 and the same two ANDs give
# codes 2 and 6, 3 and 7. One packed FMA multiplies each pair by x_i and x_(i+4) (those of
# the odd codes taken 16 times smaller) and accumulates; then the two halves are added and
# converted: 21 instructions per 16 codes. Powers of two apart from the shift-and-AND form
# (codes i and i + 4 by a shift by 4i and an AND, 25 per 16 codes), so the same results to
# the bit; on the H200 (docs/bench/gemv-and-pairs-ab-*-s15.json) 4.65 -> 4.63 us at 2048 ->
# 8192, the MoE layer 14.46 us at one token either way, 50.0 -> 49.2 at 8; sm_90 kernels 7%
# fewer instructions. That form against the one before it (codes 2i and 2i + 1 paired by a
# PRMT and an AND, one word per accumulator, 15 per 8 codes): 4.83 -> 4.67 us and 16.11 ->
# 15.08 us (docs/bench/gemv-two-words-ab-*-s15.json).
_PAIR_MASKS = ("0x000F000F", "0x00F000F0")
_F16_DOT_ASM = tl.constexpr(
    "{\n.reg .b32 t, c, acc;\n.reg .f16 lo, hi;\n"
    + "".join(
        (f"shr.u32 t, ${1 + wd}, 8;\n" if i == 2 else "")
        + f"and.b32 c, {'t' if i >= 2 else f'${1 + wd}'}, {_PAIR_MASKS[i % 2]};\n"
        + ("mul.rn.f16x2 acc, c, $3;\n" if wd == 0 and i == 0
           else f"fma.rn.f16x2 acc, c, ${3 + 4 * wd + i}, acc;\n")
        for wd in range(2) for i in range(4)
    )
    + "mov.b32 {lo, hi}, acc;\nadd.rn.f16 lo, lo, hi;\ncvt.f32.f16 $0, lo;\n}"
)
_F16_PAIR_ASM = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")  # $1 to the low half


@triton.jit
def _f16_pair(a, b):
    return tl.inline_asm_elementwise(_F16_PAIR_ASM, "=r,f,f", [a, b], tl.int32, True, 1)


@triton.jit
def _pair_dots(b_w, a0, a1, a2, a3, b0, b1, b2, b3):
    """Each even-odd pair of words (b_w [GROUPS, BLOCK_N, WPG]) against its fp16 x pairs
    (a: the even word's, b: the odd word's): [GROUPS, BLOCK_N, WPG / 2] (`_F16_DOT_ASM`)."""
    w_even, w_odd = tl.split(tl.reshape(b_w, [b_w.shape[0], b_w.shape[1], b_w.shape[2] // 2, 2]))
    return tl.inline_asm_elementwise(_F16_DOT_ASM, "=f,r,r,r,r,r,r,r,r,r,r",
                                     [w_even, w_odd, a0, a1, a2, a3, b0, b1, b2, b3],
                                     tl.float32, True, 1)  # fmt: skip


# Two words' x (16 16-bit values, 32 bytes) as 8 registers of pairs. As inline PTX the load
# takes the register layout of its use, where the compiler gives a `tl.load` a layout of its
# own and moves the values to their use through shared memory. Pure, so that copies of it
# merge: its pointers come through `after_wait`, which keeps it after the wait for x.
_X_PAIRS_ASM = tl.constexpr("ld.global.v4.b32 {$0, $1, $2, $3}, [$8];\n"
                            "ld.global.v4.b32 {$4, $5, $6, $7}, [$8+16];")


@triton.jit
def _halves(p, dtype: tl.constexpr):
    """The low and the high 16-bit float (bf16 or fp16) of registers p, in fp32."""
    if dtype == tl.bfloat16:
        return (p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_x(r0, r1, r2, r3, dtype: tl.constexpr):
    """One word's 8 x values (pairs r0..r3) in fp32, in order."""
    x0, x1 = _halves(r0, dtype)
    x2, x3 = _halves(r1, dtype)
    x4, x5 = _halves(r2, dtype)
    x6, x7 = _halves(r3, dtype)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _abs_max8(x0, x1, x2, x3, x4, x5, x6, x7):
    return tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                                 tl.maximum(tl.abs(x2), tl.abs(x3))),
                      tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                                 tl.maximum(tl.abs(x6), tl.abs(x7))))  # fmt: skip


@triton.jit
def _word_pairs(x0, x1, x2, x3, x4, x5, x6, x7, up):
    """A word's x scaled by up as the 4 fp16 pairs its codes meet: (x_i, x_(i+4)), the odd
    i 16 times smaller (they meet codes times 16)."""
    u16 = up * 0.0625
    return (_f16_pair(x0 * up, x4 * up), _f16_pair(x1 * u16, x5 * u16),
            _f16_pair(x2 * up, x6 * up), _f16_pair(x3 * u16, x7 * u16))  # fmt: skip


@triton.jit
def _pow2_scales(amax):
    """(up, down) for x whose largest |x| is amax: up = 2^(141 - e) brings it into
    [2^14, 2^15) (e its biased exponent); down = 2^(e - 117) takes up off again together
    with the 2^-24 of the codes' fp16 subnormals. Both stay normal fp32 (x beyond 2^117:
    inf)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the largest |x|
    e = tl.minimum(tl.maximum(e, 14), 244)
    up = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2^(141 - e)
    down = ((e + 10) << 23).to(tl.float32, bitcast=True)  # 2^(e - 117)
    return up, down


@triton.jit
def _codes_dot_x_f16(b_w, x_ptr, GROUPS: tl.constexpr, WPG: tl.constexpr):
    """(sum_k q_k x_k [GROUPS, BLOCK_N], sum_k x_k [GROUPS, 1]) per group of 4-bit codes
    (words [GROUPS, BLOCK_N, WPG], x from x_ptr on: a pointer from `after_wait`), the
    products in fp16 packed pairs. The x of each even-odd pair of words (16 values, one
    load, `_X_PAIRS_ASM`) are scaled by a power of two so their largest |x| lies in
    [2^14, 2^15): products and 8-term sums then stay normal fp16 (relative rounding 2^-11,
    4x below the bf16 output's), and the scale is taken off in fp32 (exact). One scale per
    pair, not per group, needs no reduction across threads, so nothing leaves the layout of
    the products (no shared memory, no barrier)."""
    o_p = tl.arange(0, GROUPS)[:, None, None] * WPG + 2 * tl.arange(0, WPG // 2)[None, None, :]
    r0, r1, r2, r3, r4, r5, r6, r7 = tl.inline_asm_elementwise(
        _X_PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,l", [x_ptr + o_p * 8], (tl.int32,) * 8, True, 1)
    dt: tl.constexpr = x_ptr.dtype.element_ty
    e0, e1, e2, e3, e4, e5, e6, e7 = _word_x(r0, r1, r2, r3, dt)
    o0, o1, o2, o3, o4, o5, o6, o7 = _word_x(r4, r5, r6, r7, dt)
    b_xs = e0 + e1 + e2 + e3 + e4 + e5 + e6 + e7 + o0 + o1 + o2 + o3 + o4 + o5 + o6 + o7
    amax = tl.maximum(_abs_max8(e0, e1, e2, e3, e4, e5, e6, e7),
                      _abs_max8(o0, o1, o2, o3, o4, o5, o6, o7))  # fmt: skip
    up, down = _pow2_scales(amax)
    a0, a1, a2, a3 = _word_pairs(e0, e1, e2, e3, e4, e5, e6, e7, up)
    b0, b1, b2, b3 = _word_pairs(o0, o1, o2, o3, o4, o5, o6, o7, up)
    b_d = _pair_dots(b_w, a0, a1, a2, a3, b0, b1, b2, b3)
    return tl.sum(b_d * down, axis=2), tl.sum(b_xs, axis=2)


@triton.jit
def _split_pairs(p):
    """[GROUPS, WPG] -> the even and the odd words' values, [GROUPS, 1, WPG / 2] each."""
    e, o = tl.split(tl.reshape(p, [p.shape[0], p.shape[1] // 2, 2]))
    return e[:, None, :], o[:, None, :]


@triton.jit
def _codes_dot_x_f16_loaded(b_w, p_x):
    """`_codes_dot_x_f16` with x from a `tl.load` (p_x [GROUPS, WPG] word starts), one power
    of two per group; the compiler moves the fp16 pairs through shared memory to the
    products' layout. For blocks where threads share x pairs (`x_in_place_pays`)."""
    b_x = tl.load(p_x[:, :, None] + tl.arange(0, 8)[None, None, :]).to(tl.float32)
    b_xs = tl.sum(tl.sum(b_x, axis=2), axis=1)
    amax = tl.max(tl.max(tl.abs(b_x), axis=2), axis=1)
    up, down = _pow2_scales(amax)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_slots8(b_x * up[:, None, None])
    a0, b0 = _split_pairs(_f16_pair(x0, x4))
    a1, b1 = _split_pairs(_f16_pair(x1 * 0.0625, x5 * 0.0625))  # against codes times 16
    a2, b2 = _split_pairs(_f16_pair(x2, x6))
    a3, b3 = _split_pairs(_f16_pair(x3 * 0.0625, x7 * 0.0625))
    b_d = _pair_dots(b_w, a0, a1, a2, a3, b0, b1, b2, b3)
    return tl.sum(b_d, axis=2) * down[:, None], b_xs[:, None]


@triton.jit
def _words(w_ptr, o_n, m_n, g0, o_gw, stride_wn, WPG: tl.constexpr):
    """Words [GROUPS, BLOCK_N, WPG] of groups g0.."""
    return tl.load(w_ptr + o_n[None, :, None] * stride_wn + g0 * WPG + o_gw[:, None, :],
                   mask=m_n[None, :, None], other=0)  # fmt: skip


@triton.jit
def _scales(s_ptr, b_ptr, o_n, m_n, g0, o_g, stride_sn):
    """Scales and biases [GROUPS, BLOCK_N] (fp32) of groups g0.."""
    o_s = o_n[None, :] * stride_sn + g0 + o_g[:, None]
    b_s = tl.load(s_ptr + o_s, mask=m_n[None, :], other=0.0).to(tl.float32)
    b_b = tl.load(b_ptr + o_s, mask=m_n[None, :], other=0.0).to(tl.float32)
    return b_s, b_b


@triton.jit
def _block_dot(x_ptr, b_w, g0, o_gw, BITS: tl.constexpr, GROUP: tl.constexpr,
               PACKED: tl.constexpr, F16_DOT: tl.constexpr, X_IN_PLACE: tl.constexpr):  # fmt: skip
    """The codes of one block (words b_w [GROUPS, BLOCK_N, WPG] of groups g0..) against x:
    F16_DOT (sum_k q_k x_k [GROUPS, BLOCK_N], sum_k x_k [GROUPS, 1]), else (sum_j v_j x
    per word [GROUPS, BLOCK_N, WPG], sum_j x [GROUPS, WPG]) (`_codes_dot_x`)."""
    PER_WORD: tl.constexpr = 32 // BITS
    GROUPS: tl.constexpr = b_w.shape[0]
    WPG: tl.constexpr = GROUP // PER_WORD
    p_x = x_ptr + (g0 * WPG + o_gw) * PER_WORD
    if F16_DOT:
        if X_IN_PLACE:
            b_d, b_xs = _codes_dot_x_f16(b_w, after_wait(x_ptr + g0 * GROUP), GROUPS, WPG)
        else:
            b_d, b_xs = _codes_dot_x_f16_loaded(b_w, p_x)
    else:
        b_d, b_xs = _codes_dot_x(b_w, p_x, BITS, PACKED)
    return b_d, b_xs


@triton.jit
def _block_sum(b_d, b_xs, b_s, b_b, g0, o_g, BITS: tl.constexpr, GROUP: tl.constexpr,
               F16_DOT: tl.constexpr, sq_ptr, eps, HEAD: tl.constexpr,
               PARTS: tl.constexpr):  # fmt: skip
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
def gemv_rows(x_ptr, w_ptr, s_ptr, b_ptr, o_n, m_n, K, stride_wn, stride_sn,
              BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PACKED: tl.constexpr, PREFETCH: tl.constexpr,
              USE_PDL: tl.constexpr, F16_DOT: tl.constexpr = False, sq_ptr=None, eps=0.0,
              HEAD: tl.constexpr = 0, PARTS: tl.constexpr = 1,
              X_IN_PLACE: tl.constexpr = False, ONE_STEP: tl.constexpr = False):  # fmt: skip
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
    X_IN_PLACE there is no prefetch inside the loop, where a masked-off tile took registers
    (246 -> 168 at 16 x 2048 with 2 warps; with fp32 products ptxas then spilled 3 KB, hence
    only with x in place), and without PREFETCH and PDL no loop (straight-line code). On
    the H200 the MoE layer's down GEMV (K 512) without the loop, 8 layers from HBM,
    alternating 5 rounds (docs/bench/moe-gemv-one-step-ab-*-s19.json): 8 tokens 49.58 ->
    47.66 us, 32 tokens 138.2 -> 130.7, outputs identical; under PDL it lost (2 tokens
    25.04 -> 26.45), and with prefetch too (2048 -> 9216 4.29 -> 5.03 us: the loads before
    the wait had no loop to keep them there, docs/bench/gemv-one-step-ab-*-s19.json).
    X_IN_PLACE (F16_DOT): `_codes_dot_x_f16`, else `_codes_dot_x_f16_loaded`."""
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
        b_acc = _block_sum(b_d, b_xs, b_s, b_b, 0, o_g, BITS, GROUP, F16_DOT, sq_ptr, eps,
                           HEAD, PARTS)  # fmt: skip
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
        b_acc += _block_sum(b_d, b_xs, b_s, b_b, g0, o_g, BITS, GROUP, F16_DOT, sq_ptr, eps,
                            HEAD, PARTS)  # fmt: skip
        if PREFETCH and not (ONE_STEP and X_IN_PLACE):  # the next tile (none past the end)
            m_next = m_n & (o_n * 0 + g0 + GROUPS < num_groups)
            b_w = _words(w_ptr, o_n, m_next, g0 + GROUPS, o_gw, stride_wn, WPG)
            b_s, b_b = _scales(s_ptr, b_ptr, o_n, m_next, g0 + GROUPS, o_g, stride_sn)
    return tl.sum(b_acc, axis=0)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, rw_ptr, ids_ptr, sw_ptr, ss_ptr, sb_ptr,
    sq_ptr, cw_ptr, cs_ptr, slot_ptr,
    N, K, eps, conv_rows,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym, stride_cs, stride_cp,
    TOP_K: tl.constexpr, EXPERTS: tl.constexpr, SHARED: tl.constexpr, GATED: tl.constexpr,
    APPLY_WEIGHT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr,
    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, F16_DOT: tl.constexpr = False,
    HEAD: tl.constexpr = 0, PARTS: tl.constexpr = 1, CONV_KW: tl.constexpr = 0,
    LATE_TRIGGER: tl.constexpr = False, X_IN_PLACE: tl.constexpr = False,
    ONE_STEP: tl.constexpr = False,
):  # fmt: skip
    """One program: BLOCK_N outputs of output row i_m.

    Plain: y[i_m] = x[i_m] @ W^T. GATED: W's rows N..2N are the up projection of rows 0..N
    (a fused gate_up) and y = silu(x W[:N]^T) * (x W[N:]^T), x read by token i_m // TOP_K.
    EXPERTS: W is a stack of experts [E, ...] and row i_m = t * TOP_K + slot (an assignment)
    reads expert ids[i_m]; SHARED: the last slot of each token reads the shared expert's
    weights (sw, ss, sb: one expert's shape) instead; APPLY_WEIGHT scales a row by its
    routing weight rw[i_m]. PREFETCH: see `gemv_rows`, also for HEAD and PARTS (x's heads
    scaled by their 1 / rms, `quant_gemv_rms_scaled`); with EXPERTS the ids are read before
    the wait too, so they must come from a kernel that finished before the previous one let
    this one launch (the previous one was launched with LATE_TRIGGER). LATE_TRIGGER: the
    next kernel launches only once every program here has waited for the previous one.
    CONV_KW > 0: the outputs below conv_rows are the GDN conv's channels: each gets its
    causal conv (weights cw [C, CONV_KW]) with the sequence's window in the conv-state pool
    cs (slot slot[i_m], channels contiguous, positions stride_cp apart) and SiLU, and the
    window moves by one (`quant_gemv_conv`)."""
    if LATE_TRIGGER:  # (`gemv_rows` then prefetches within its loop only)
        wait_previous(USE_PDL)
        let_next_launch(USE_PDL)
    elif PREFETCH:
        let_next_launch(USE_PDL)  # `gemv_rows` waits after its first weight loads
    else:
        wait_for_previous(USE_PDL)
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    if EXPERTS:
        i_e = tl.load(ids_ptr + i_m).to(tl.int64)
        w_ptr = w_ptr + i_e * stride_we
        s_ptr, b_ptr = s_ptr + i_e * stride_se, b_ptr + i_e * stride_se
        if SHARED:
            if i_m % TOP_K == TOP_K - 1:
                w_ptr, s_ptr, b_ptr = sw_ptr, ss_ptr, sb_ptr
    if GATED:
        p_x = x_ptr + (i_m // TOP_K) * stride_xm
    else:
        p_x = x_ptr + i_m * stride_xm
    if CONV_KW > 0:  # the window's older inputs, before any wait: only this kernel writes them
        m_c = o_n < conv_rows
        p_cs = cs_ptr + tl.load(slot_ptr + i_m).to(tl.int64) * stride_cs + o_n
        b_conv = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(CONV_KW - 1):
            b_old = tl.load(p_cs + j * stride_cp, mask=m_c, other=0.0)
            b_conv += b_old.to(tl.float32) * tl.load(cw_ptr + o_n * CONV_KW + j, mask=m_c,
                                                     other=0.0).to(tl.float32)  # fmt: skip
            if j > 0:  # position j of the old window is j - 1 of the new
                tl.store(p_cs + (j - 1) * stride_cp, b_old, mask=m_c)
        b_cw = tl.load(cw_ptr + o_n * CONV_KW + CONV_KW - 1, mask=m_c, other=0.0)
    if GATED:  # gate rows o_n and up rows o_n + N in one walk over K (one tile of 2 BLOCK_N)
        o_gu = tl.arange(0, 2 * BLOCK_N)
        o_rows = i_n * BLOCK_N + o_gu % BLOCK_N + (o_gu // BLOCK_N) * N
        m_rows = i_n * BLOCK_N + o_gu % BLOCK_N < N
        b_gu = gemv_rows(p_x, w_ptr, s_ptr, b_ptr, o_rows, m_rows, K, stride_wn, stride_sn,
                         BITS, GROUP, 2 * BLOCK_N, BLOCK_K, PACKED, PREFETCH,
                         USE_PDL, F16_DOT, X_IN_PLACE=X_IN_PLACE, ONE_STEP=ONE_STEP)  # fmt: skip
        b_y, b_u = tl.split(tl.permute(tl.reshape(b_gu, [2, BLOCK_N]), [1, 0]))
        b_y = silu(b_y) * b_u
    else:
        b_y = gemv_rows(p_x, w_ptr, s_ptr, b_ptr, o_n, m_n, K, stride_wn, stride_sn, BITS,
                        GROUP, BLOCK_N, BLOCK_K, PACKED, PREFETCH, USE_PDL, F16_DOT, sq_ptr,
                        eps, HEAD, PARTS, X_IN_PLACE, ONE_STEP)  # fmt: skip
    if APPLY_WEIGHT:
        b_y *= tl.load(rw_ptr + i_m)
    if CONV_KW > 0:  # the new input, rounded like the projection's output, ends the window
        b_in = b_y.to(y_ptr.dtype.element_ty)
        tl.store(p_cs + (CONV_KW - 2) * stride_cp, b_in.to(cs_ptr.dtype.element_ty), mask=m_c)
        b_conv += b_in.to(tl.float32) * b_cw.to(tl.float32)
        b_y = tl.where(m_c, silu(b_conv), b_y)
    tl.store(y_ptr + i_m * stride_ym + o_n, b_y.to(y_ptr.dtype.element_ty), mask=m_n)


def x_in_place_pays(block_k: int, spec: QuantSpec, num_warps: int) -> bool:
    """Whether x goes straight into the fp16-pair products' layout (`_codes_dot_x_f16`):
    where a block has as many even-odd word pairs per row as the program has threads, so no
    two threads load and convert the same x. Where more threads share a pair, the x is
    converted once and passed through shared memory (`_codes_dot_x_f16_loaded`). On the
    H200, graphs over weights beyond L2, alternating 5 rounds (docs/bench/gemv-x-*-s19.json):
    2048 -> 8192 at 16 x 2048 with 2 warps 4.66 -> 4.08 us (with ONE_STEP 3.79), 2048 ->
    9216 5.94 -> 4.23 (4.05), 2048 -> 1024 2.57 -> 2.08 (1.90), outputs equal to the bit;
    with two threads a pair, 32 x 1024 with 4 warps, 2048 -> 12352 5.56 -> 5.46 but the
    MoE layer at 8 tokens (gate_up 16 x 1024, 4 warps) 49.3 -> 58.9 us."""
    return spec.bits == 4 and block_k // spec.group_size * (spec.group_size // 16) >= 32 * num_warps


class HeadRms(NamedTuple):
    """x's heads scaled by 1 / rms inside the GEMV: sq_sums [H, P] partial sums of squares
    of each head (P a power of two), inv_rms = rsqrt(sum / head_dim + eps)."""

    sq_sums: torch.Tensor | None
    eps: float


class ConvStep(NamedTuple):
    """The GDN conv's one-token step as a GEMV epilogue on outputs 0..rows-1: weight [rows,
    KW], pool [S, rows, KW - 1] (channels contiguous, `causal_conv1d.conv.state_pool`),
    slots [M] (one per activation row)."""

    weight: torch.Tensor | None
    pool: torch.Tensor | None
    slots: torch.Tensor | None
    rows: int


def shared_expert_args(shared_w, packed: torch.Tensor, scales: torch.Tensor) -> tuple:
    """The (packed words, scales, biases) kernel arguments of a shared expert run beside the
    routed experts `packed`, `scales` ([E, rows, ...]); (None,) * 3 without one."""
    if shared_w is None:
        return (None,) * 3
    if shared_w[0].stride(0) != packed.stride(-2) or shared_w[1].stride(0) != scales.stride(-2):
        raise ValueError("the shared expert's rows must be laid out like a routed expert's")
    return (shared_w[0].view(torch.int32), *shared_w[1:])


def launch_gemv(x, w, y, spec: QuantSpec, block_n: int, block_k: int, num_warps: int,
                num_stages: int = 2, gated: bool = False, ids=None, rw=None, top_k: int = 1,
                shared_w=None, prefetch: bool | None = None, f16_dot: bool | None = None,
                rms: HeadRms | None = None, conv: ConvStep | None = None,
                late_trigger: bool = False, x_in_place: bool | None = None):  # fmt: skip
    """Rows of y [R, N] from x ([R // top_k, K] if gated else [R, K]) and w = (packed, scales,
    biases): [N (2N if gated), K * bits / 32] and [N, K / group], or with experts (ids [R])
    stacks of those [E, ...]. rw [R]: routing weights to apply. shared_w: one expert's
    weights for the last of each token's top_k slots. prefetch: the weight prefetch of
    `gemv_rows`, by default with programmatic dependent launch and without experts. With
    experts it reads the ids before the wait as well, so it may follow only a launch with
    late_trigger, whose wait covered the kernel that wrote them; with late_trigger itself
    the kernel waits first and prefetches within its loop only. late_trigger: the next
    kernel launches after this one's wait, not before (see `_gemv_kernel`).
    f16_dot: the 4-bit products in packed fp16 pairs (`_codes_dot_x_f16`), by default for
    experts (dense shapes: `quant_gemv` takes them from `default_config`); never for fp32
    activations, which keep fp32 products (the precision they ask for). Measured on the
    H200 (`bench.gemv --quick`, `bench.moe`): the MoE layer at 1 / 8 / 32 tokens 16.9 /
    55.8 / 155.6 us against 18.9 / 64.5 / 192 with fp32 products. Error against the
    dequantised reference (max-normalised) 3-6e-3 against 1e-6..2e-3 in fp32, below the
    layer's bf16 output rounding. rms, conv: the GDN fusions of `quant_gemv_rms_scaled`
    and `quant_gemv_conv` (plain GEMVs only). x_in_place (fp16 pairs): x loaded in the
    products' layout (`_codes_dot_x_f16`), by default where that pays (`x_in_place_pays`).
    K in one block changes the loop (ONE_STEP, see `gemv_rows`)."""
    packed, scales, biases = w
    n, k = y.shape[1], x.shape[1]
    experts = ids is not None
    sw = shared_expert_args(shared_w, packed, scales)
    if (rms or conv) and (experts or gated or rw is not None):
        raise ValueError("the GDN norm and conv fusions take plain GEMVs")
    rms = rms or HeadRms(None, 0.0)
    heads, parts = rms.sq_sums.shape if rms.sq_sums is not None else (0, 1)
    head = k // heads if heads else 0
    if head and (head * heads != k or head % spec.group_size or parts & (parts - 1)):
        raise ValueError(f"{heads} heads in {parts} parts do not split K = {k} into whole "
                         f"groups of {spec.group_size} (parts: a power of two)")  # fmt: skip
    conv = conv or ConvStep(None, None, None, 0)
    conv_strides = (conv.pool.stride(0), conv.pool.stride(2)) if conv.rows else (0, 0)
    if conv.rows and conv.pool.stride(1) != 1:
        raise ValueError("the conv-state pool's channels must be contiguous (`state_pool`)")
    grid = (triton.cdiv(n, block_n), y.shape[0])
    pdl = launch_args(y, grid)
    bk = fit_block_k(k, block_k, spec.group_size)
    if x_in_place is None:
        x_in_place = x_in_place_pays(bk, spec, num_warps)
    x_in_place = x_in_place and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0
    ptx = x.is_cuda and spec.bits == 4  # the packed PTX paths
    prefetch = pdl["USE_PDL"] and not experts if prefetch is None else prefetch
    f16_dot = ptx and x.dtype != torch.float32 and (experts if f16_dot is None else f16_dot)
    fast(_gemv_kernel)[grid](
        x, packed.view(torch.int32), scales, biases, y, rw, ids, *sw,
        rms.sq_sums, conv.weight, conv.pool, conv.slots,
        n, k, rms.eps, conv.rows, x.stride(0), packed.stride(0) if experts else 0,
        packed.stride(-2), scales.stride(0) if experts else 0, scales.stride(-2), y.stride(0),
        *conv_strides,
        TOP_K=top_k, EXPERTS=experts, SHARED=shared_w is not None, GATED=gated,
        APPLY_WEIGHT=rw is not None,
        BITS=spec.bits, GROUP=spec.group_size, BLOCK_N=block_n,
        BLOCK_K=bk, PACKED=ptx,
        F16_DOT=f16_dot,
        PREFETCH=prefetch,
        HEAD=head, PARTS=parts,
        CONV_KW=conv.weight.shape[1] if conv.rows else 0, LATE_TRIGGER=late_trigger,
        X_IN_PLACE=f16_dot and x_in_place,
        ONE_STEP=bk == k,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )  # fmt: skip
    return y


MAX_ROWS = MMA_ROWS  # beyond this, prefill paths (dequantising GEMM) take over


def default_config(n: int, k: int) -> tuple[int, int, int, bool]:
    """(block_n, block_k, num_warps, fp16-pair products) for one row, from the H200 (each
    in a CUDA graph over weights beyond L2). Tenth session, products in fp16 pairs against
    the fp32 defaults of then, alternating in one run (docs/bench/gemv-shapes-*-s10.json):
    lm_head 2048 -> 248320 32 x 1024, 4 warps, 76.0 us = 87% of bandwidth (fp32 16 x 1024,
    1 warp: 87.0-93.0); 2048 -> 12352 and 9216 32 x 1024, 4 warps (6.20 / 5.95 us; fp32 8 x
    1024, 1 warp: 6.48 / 6.09); 2048 -> 8192 16 x 2048, 2 warps (4.89 vs 6.16); 2048 ->
    1024 16 x 2048, 2 warps (2.91 vs 3.88). Kept in fp32: K >= 4096 (4096 -> 2048) 8 x
    4096, 2 warps (3.61 us; fp16 pairs 3.95); the 8-bit router 2048 -> 257 4 x 2048, 4
    warps (3.0 us); smaller matrices 4 x 1024, 2 warps (eighth-session sweeps). The fp16
    pairs need many rows per thread to pay for converting x (1-warp 8-row blocks lost).
    Nineteenth session, with x loaded in place and one K step (`x_in_place_pays`,
    docs/bench/gemv-x-blocks-*-s19.json): 2048 -> 9216 16 x 2048, 2 warps 4.05 us (32 x
    1024, 4 warps 5.43); 2048 -> 8192 3.79 (32 x 2048, 4 warps 3.76, 8 x 2048 3.93);
    2048 -> 12352 keeps 32 x 1024 (5.45; 16 x 2048 5.58, 32 x 2048 5.53)."""
    if n >= 65536:
        return 32, 1024, 4, True
    if k >= 4096:
        return 8, 4096, 2, False
    if n > 9216:
        return 32, 1024, 4, True
    if n > 4096:
        return 16, 2048, 2, True
    if k >= 2048:
        return (16, 2048, 2, True) if n >= 1024 else (4, 2048, 4, False)
    return 4, 1024, 2, False


def _check(x, packed, scales, biases, spec: QuantSpec) -> None:
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


def quant_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    gated: bool = False,
    prefetch: bool | None = None,
    f16_dot: bool | None = None,
) -> torch.Tensor:
    """x: [M <= 16, K]; packed: [N, K * bits / 32] int32 (MLX uint32 bits); scales, biases:
    [N, K / group]. Returns y [M, N] in x's dtype (fp32 accumulation). One row runs the row
    GEMV (block sizes, warps and the weight prefetch override `default_config` and
    `launch_gemv`'s choice; f16_dot: see there), 2-16 rows the tensor-core kernel. gated: the
    rows are a fused gate_up [2I, K]; returns silu(gate) * up [M, I] (in the kernel at one
    row)."""
    _check(x, packed, scales, biases, spec)
    n = packed.shape[0]
    if x.shape[0] > 1:
        y = quant_mma(x, packed, scales, biases, spec)
        return F.silu(y[:, : n // 2]) * y[:, n // 2 :] if gated else y
    outputs = n // 2 if gated else n
    x, w, (bn, bk, nw, f16) = _row_args(x, packed, scales, biases, outputs)
    y = torch.empty(1, outputs, device=x.device, dtype=x.dtype)
    return launch_gemv(x, w, y, spec, block_n or bn, block_k or bk, num_warps or nw,
                       num_stages, gated=gated, prefetch=prefetch,
                       f16_dot=f16 if f16_dot is None else f16_dot)  # fmt: skip


def _row_args(x, packed, scales, biases, outputs: int):
    """The (x, weights, `default_config`) of a checked one-row GEMV with `outputs` outputs."""
    w = (packed.contiguous(), scales.contiguous(), biases.contiguous())
    return x.contiguous(), w, default_config(outputs, x.shape[1])


def _one_row(x, packed, scales, biases, spec: QuantSpec, what: str):
    """The (x, weights, default config) of a one-row GEMV with a GDN fusion."""
    _check(x, packed, scales, biases, spec)
    if x.shape[0] != 1:
        raise ValueError(f"the GEMV with the {what} takes one row, got {x.shape[0]}")
    return _row_args(x, packed, scales, biases, packed.shape[0])


def quant_gemv_conv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    biases: torch.Tensor, spec: QuantSpec, conv_weight: torch.Tensor,
                    conv_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """A GDN layer's in-projection at one decode token with its conv step in the epilogue:
    y = x @ W^T [1, N], the first C outputs (the conv's channels: conv_weight [C, KW],
    conv_pool [S, C, KW - 1] from `state_pool`, updated in place at slots [1]) replaced by
    silu(causal conv) of the window they end. One kernel for the projection and the
    `causal_conv1d` decode step."""
    x, w, (bn, bk, nw, f16) = _one_row(x, packed, scales, biases, spec, "conv step")
    c, kw = conv_weight.shape
    if c > packed.shape[0] or conv_pool.shape[1:] != (c, kw - 1) or slots.shape != (1,):
        raise ValueError(f"conv weight {list(conv_weight.shape)}, pool "
                         f"{list(conv_pool.shape)}, slots {list(slots.shape)} do not fit "
                         f"{packed.shape[0]} outputs and one row")  # fmt: skip
    y = torch.empty(1, packed.shape[0], device=x.device, dtype=x.dtype)
    conv = ConvStep(conv_weight.contiguous(), conv_pool, slots, c)
    return launch_gemv(x, w, y, spec, bn, bk, nw, f16_dot=f16, conv=conv)


def quant_gemv_rms_scaled(x: torch.Tensor, sq_sums: torch.Tensor, eps: float,
                          packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                          spec: QuantSpec, dtype: torch.dtype | None = None):  # fmt: skip
    """A GDN layer's out-projection at one decode token, finishing the layer's gated RMSNorm:
    y = (x * inv_rms) @ W^T [1, N] in dtype (default: the scales'), x [1, H, D] (the decode
    step's o * w * silu(z)), each head scaled by rsqrt(sum of sq_sums [1, H, P] / D +
    eps), the head's sum of o^2 in P parts (the step's column blocks). The factor multiplies
    each quantisation group's partial sum, so it waits for no reduction over x: measured on
    the H200, the norm computed whole from o and z in this GEMV's prologue instead cost
    2.7 us a layer (graphs of 30 layers)."""
    h = x.shape[1]
    if x.dim() != 3 or sq_sums.shape[:2] != (1, h) or sq_sums.dtype != torch.float32:
        raise ValueError(f"x {list(x.shape)}, sums of squares {list(sq_sums.shape)} "
                         f"{sq_sums.dtype}: expected [1, H, D] and [1, H, P] fp32")  # fmt: skip
    x, w, (bn, bk, nw, f16) = _one_row(x.flatten(1), packed, scales, biases, spec, "norm")
    y = torch.empty(1, packed.shape[0], device=x.device, dtype=dtype or scales.dtype)
    rms = HeadRms(sq_sums[0].contiguous(), eps)
    return launch_gemv(x, w, y, spec, bn, bk, nw, f16_dot=f16, rms=rms)
