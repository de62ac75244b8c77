"""The products of one block of 4-bit or 8-bit codes with x, as `@triton.jit` device
functions for the row GEMV's K loop (`rows.gemv_rows`). Per word of codes (all in one group)

    sum_k (s q_k + b) x_k = s * sum_k q_k x_k + b * sum_k x_k,

so the codes meet x in one multiply-add each and scale/bias are applied once per word, by the
caller. Two forms: fp32 products (`codes_dot_x`: codes as the floats 1 + q / 2^BITS) and, for
4-bit codes and 16-bit x on the GPU, products in packed fp16 pairs (`codes_dot_x_f16`, x loaded
straight into the products' register layout, and `codes_dot_x_f16_loaded`, x through a
`tl.load`).
"""

from __future__ import annotations

import triton
import triton.language as tl

# code j of a word to the top mantissa bits (19-22) of 1.0: shift by 19 - 4j, then one LOP3
# (mask | exponent; Triton's own `(t & m) | e` compiles to two).
_MANTISSA_ASM = tl.constexpr(
    "{\n.reg .b32 t;\n"
    + "".join(
        f"{'shl' if 19 - 4 * j >= 0 else 'shr'}.b32 t, $8, {abs(19 - 4 * j)};\n"
        f"lop3.b32 ${j}, t, 0x00780000, 0x3F800000, 0xEA;\n"
        for j in range(8)
    )
    + "}"
)


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
def codes_dot_x(b_w, p_x, BITS: tl.constexpr, PACKED: tl.constexpr):
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
                _MANTISSA_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b_w], (tl.float32,) * 8, True, 1
            )
        else:
            v0, v1 = _code_floats(b_w, 0, BITS), _code_floats(b_w, 1, BITS)
            v2, v3 = _code_floats(b_w, 2, BITS), _code_floats(b_w, 3, BITS)
            v4, v5 = _code_floats(b_w, 4, BITS), _code_floats(b_w, 5, BITS)
            v6, v7 = _code_floats(b_w, 6, BITS), _code_floats(b_w, 7, BITS)
        b_qx = (
            v0 * x0[:, None, :]
            + v1 * x1[:, None, :]
            + v2 * x2[:, None, :]
            + v3 * x3[:, None, :]
            + v4 * x4[:, None, :]
            + v5 * x5[:, None, :]
            + v6 * x6[:, None, :]
            + v7 * x7[:, None, :]
        )
    else:
        x0, x1, x2, x3 = _x_slots4(b_x)
        b_qx = (
            _code_floats(b_w, 0, BITS) * x0[:, None, :]
            + _code_floats(b_w, 1, BITS) * x1[:, None, :]
            + _code_floats(b_w, 2, BITS) * x2[:, None, :]
            + _code_floats(b_w, 3, BITS) * x3[:, None, :]
        )
    return b_qx, b_xs


# Two words' 16 codes against 8 fp16 pairs of (scaled) x: for each word, ANDs with 0x000F000F
# and 0x00F000F0 leave codes 0 and 4, and 1 and 5 times 16, in the two 16-bit halves, as
# fp16 subnormals q * 2^-24 and q * 2^-20 (exact); a shift by 8 and the same two ANDs give
# codes 2 and 6, 3 and 7. One packed FMA multiplies each pair by x_i and x_(i+4) (those of
# the odd codes taken 16 times smaller) and accumulates; then the two halves are added and
# converted: 21 instructions per 16 codes. It gives the results of a shift by 4i and an AND
# per pair of codes i and i + 4 (25 instructions per 16 codes) to the bit, and on the H200
# 4.63 against 4.65 us at 2048 -> 8192, the MoE
# layer 14.46 us at one token either way and 49.2 against 50.0 at 8, with 7% fewer sm_90
# instructions. Pairing codes 2i and 2i + 1 (a PRMT and an AND, one word per accumulator,
# 15 instructions per 8 codes) is slower than the shift-and-AND form: 4.83 against 4.67 us
# and the layer 16.11 against 15.08 us.
_PAIR_MASKS = ("0x000F000F", "0x00F000F0")
_F16_DOT_ASM = tl.constexpr(
    "{\n.reg .b32 t, c, acc;\n.reg .f16 lo, hi;\n"
    + "".join(
        (f"shr.u32 t, ${1 + wd}, 8;\n" if i == 2 else "")
        + f"and.b32 c, {'t' if i >= 2 else f'${1 + wd}'}, {_PAIR_MASKS[i % 2]};\n"
        + (
            "mul.rn.f16x2 acc, c, $3;\n"
            if wd == 0 and i == 0
            else f"fma.rn.f16x2 acc, c, ${3 + 4 * wd + i}, acc;\n"
        )
        for wd in range(2)
        for i in range(4)
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
    return tl.inline_asm_elementwise(
        _F16_DOT_ASM,
        "=f,r,r,r,r,r,r,r,r,r,r",
        [w_even, w_odd, a0, a1, a2, a3, b0, b1, b2, b3],
        tl.float32,
        True,
        1,
    )


# Two words' x (16 16-bit values, 32 bytes) as 8 registers of pairs. As inline PTX the load
# takes the register layout of its use, where the compiler gives a `tl.load` a layout of its
# own and moves the values to their use through shared memory. Pure, so that copies of it
# merge: its pointers come through `after_wait`, which keeps it after the wait for x.
_X_PAIRS_ASM = tl.constexpr(
    "ld.global.v4.b32 {$0, $1, $2, $3}, [$8];\nld.global.v4.b32 {$4, $5, $6, $7}, [$8+16];"
)


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
    return tl.maximum(
        tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
        tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))),
    )


@triton.jit
def _word_pairs(x0, x1, x2, x3, x4, x5, x6, x7, up):
    """A word's x scaled by up as the 4 fp16 pairs its codes meet: (x_i, x_(i+4)), the odd
    i 16 times smaller (they meet codes times 16)."""
    u16 = up * 0.0625
    return (
        _f16_pair(x0 * up, x4 * up),
        _f16_pair(x1 * u16, x5 * u16),
        _f16_pair(x2 * up, x6 * up),
        _f16_pair(x3 * u16, x7 * u16),
    )


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
def codes_dot_x_f16(b_w, x_ptr, GROUPS: tl.constexpr, WPG: tl.constexpr):
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
        _X_PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,l", [x_ptr + o_p * 8], (tl.int32,) * 8, True, 1
    )
    dt: tl.constexpr = x_ptr.dtype.element_ty
    e0, e1, e2, e3, e4, e5, e6, e7 = _word_x(r0, r1, r2, r3, dt)
    o0, o1, o2, o3, o4, o5, o6, o7 = _word_x(r4, r5, r6, r7, dt)
    b_xs = e0 + e1 + e2 + e3 + e4 + e5 + e6 + e7 + o0 + o1 + o2 + o3 + o4 + o5 + o6 + o7
    amax = tl.maximum(
        _abs_max8(e0, e1, e2, e3, e4, e5, e6, e7), _abs_max8(o0, o1, o2, o3, o4, o5, o6, o7)
    )
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
def codes_dot_x_f16_loaded(b_w, p_x):
    """`codes_dot_x_f16` with x from a `tl.load` (p_x [GROUPS, WPG] word starts), one power
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
