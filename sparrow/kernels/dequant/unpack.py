"""Packed group-affine codes to float values inside a kernel, shared by the kernels that
expand weights in registers (tensor-core GEMV, dequantise kernel, grouped expert GEMM).

`unpack_codes(words, scales, biases, ...)`: words [..., W] (int32, MLX layout: code j of a
word in bits BITS*j..), scales and biases broadcastable to [..., W] (each word lies in one
group) -> values [..., W, 32 // BITS] in code order: in the scales' dtype on the packed path,
fp32 otherwise (callers cast).

4-bit codes into bf16/fp16 (the GPU path, `PACKED=True`) go two per 32-bit register: for
byte i of a word, one PRMT puts byte i of the word and of the word >> 4 in the two halves
(codes 2i and 2i + 1 in their low nibbles), one LOP3 masks them and ORs in the exponent of
MAGIC (128 for bf16, 1024 for fp16: the half then holds MAGIC + code exactly), one packed FMA
subtracts MAGIC and one applies scale and bias (rounded once, as `scale * q + bias` in fp32
then cast). Per word: one shift, 4 PRMT, 4 LOP3, 8 packed FMA: about 2 instructions per code,
against 5 for shift, mask, convert and FMA in fp32. Elsewhere (8-bit, fp32, the interpreter,
which cannot run inline PTX) codes are shifted, masked and converted in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _packed_asm(fma: str, one: int, minus_magic: int, magic: int) -> str:
    """PTX for one word ($8), its scale ($9) and bias ($10) -> 8 halves $0..$7 in order."""
    body = "".join(
        f"prmt.b32 p, $8, t, {hex(((4 + i) << 12) | ((4 + i) << 8) | (i << 4) | i)};\n"
        f"lop3.b32 p, p, 0x000F000F, {hex(magic * 0x10001)}, 0xEA;\n"  # (p & m) | magic
        f"{fma} p, p, one, mm;\n"
        f"{fma} p, p, s2, b2;\n"
        f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, p;\n"
        for i in range(4)
    )
    return (
        "{\n.reg .b32 t, p, one, mm, s2, b2;\n"
        f"mov.b32 one, {hex(one * 0x10001)};\nmov.b32 mm, {hex(minus_magic * 0x10001)};\n"
        "mov.b32 s2, {$9, $9};\nmov.b32 b2, {$10, $10};\nshr.u32 t, $8, 4;\n" + body + "}"
    )


_BF16_ASM = tl.constexpr(_packed_asm("fma.rn.bf16x2", 0x3F80, 0xC300, 0x4300))
_FP16_ASM = tl.constexpr(_packed_asm("fma.rn.f16x2", 0x3C00, 0xE400, 0x6400))


def fit_block_k(k: int, block_k: int, group: int) -> int:
    """The largest power-of-two number of groups, at most block_k wide, that divides K."""
    groups = max(1, block_k // group)
    while (k // group) % groups:
        groups //= 2
    return groups * group


def packed_unpack(dtype: torch.dtype, bits: int, device: torch.device) -> bool:
    """Whether kernels may take the packed PTX path for these weights and this device."""
    return device.type == "cuda" and bits == 4 and dtype in (torch.bfloat16, torch.float16)


@triton.jit
def group_scales(s_ptr, b_ptr, o_n, m_n, o_g, stride_sn):
    """Scales and biases of rows o_n for quantisation groups o_g (any shapes that broadcast
    together; m_n masks the rows): o_n * stride_sn + o_g in the [N, K / group] tensors. The
    tensor-core GEMV and the grouped GEMM load theirs with it, one K step ahead."""
    b_s = tl.load(s_ptr + o_n * stride_sn + o_g, mask=m_n, other=0.0)
    return b_s, tl.load(b_ptr + o_n * stride_sn + o_g, mask=m_n, other=0.0)


@triton.jit
def _code(words, j: tl.constexpr, BITS: tl.constexpr):
    return ((words >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def unpack_codes(words, scales, biases, BITS: tl.constexpr, PACKED: tl.constexpr):
    """[..., W] words -> [..., W, 32 // BITS] values (see the module docstring)."""
    if PACKED:  # 4-bit, bf16/fp16 scales, compiled for a GPU
        if scales.dtype == tl.bfloat16:
            c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
                _BF16_ASM,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
                [words, scales, biases],
                (tl.bfloat16,) * 8,
                True,
                1,
            )
        else:
            c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
                _FP16_ASM,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
                [words, scales, biases],
                (tl.float16,) * 8,
                True,
                1,
            )
    else:
        s = scales.to(tl.float32)
        b = biases.to(tl.float32)
        c0 = _code(words, 0, BITS) * s + b
        c1 = _code(words, 1, BITS) * s + b
        c2 = _code(words, 2, BITS) * s + b
        c3 = _code(words, 3, BITS) * s + b
        if BITS == 4:
            c4 = _code(words, 4, BITS) * s + b
            c5 = _code(words, 5, BITS) * s + b
            c6 = _code(words, 6, BITS) * s + b
            c7 = _code(words, 7, BITS) * s + b
    # join appends its axis last (fastest): pair codes from the top index bit down
    if BITS == 8:
        values = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    else:
        values = tl.join(
            tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7))
        )
    return values
