"""Group-affine integer quantisation in the MLX layout.

A weight [..., N, K] is cut into groups of `group_size` along K (the input dim). Per group:
beta = min, alpha = max, scale = (alpha - beta) / (2^bits - 1), code = round((w - beta)/scale)
clamped to [0, 2^bits - 1], and the weight is recovered as

    w = scale * code + bias        (bias = beta)

Codes are packed 32 / bits per 32-bit word, the first element in the lowest bits:
    w[n, k] = scales[n, k // g] * ((W[n, k * bits // 32] >> (bits * (k % (32 // bits)))) & mask)
              + biases[n, k // g]
which is the byte layout of MLX checkpoints (`.weight` uint32, `.scales`, `.biases`), so their
tensors are used as they are. Packed words are kept as int32 (same bits as MLX's uint32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {self.group_size}")

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """[..., N, K] -> shape of the packed words [..., N, K * bits / 32]."""
        self.check_in_features(shape[-1])
        return (*shape[:-1], shape[-1] // self.per_word)

    def group_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """[..., N, K] -> shape of scales and biases [..., N, K / group_size]."""
        self.check_in_features(shape[-1])
        return (*shape[:-1], shape[-1] // self.group_size)

    def check_in_features(self, k: int) -> None:
        if k % self.group_size:
            raise ValueError(f"input dim {k} is not a multiple of group_size {self.group_size}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [..., K] in [0, 2^bits) -> int32 words [..., K * bits / 32]."""
    per_word = 32 // bits
    c = codes.to(torch.int64).unflatten(-1, (-1, per_word))
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)  # < 2^32, fits int64
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 (or uint32) words [..., W] -> codes [..., W * 32 / bits] as int32."""
    per_word = 32 // bits
    w = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    return ((w[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2).to(torch.int32)


def quantize(
    w: torch.Tensor, spec: QuantSpec, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (packed int32 [..., N, K*bits/32], scales, biases [..., N, K/g]).
    Scales and biases are stored in `dtype`; codes are computed against the stored values."""
    spec.check_in_features(w.shape[-1])
    if w.dim() > 2:  # slice by slice: a fused expert tensor's fp32 and int64 temporaries are
        parts = [quantize(x, spec, dtype) for x in w]  # several times its size
        return tuple(torch.stack(p) for p in zip(*parts, strict=True))  # type: ignore[return-value]
    levels = (1 << spec.bits) - 1
    g = w.float().unflatten(-1, (-1, spec.group_size))
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / levels).to(dtype)
    biases = lo.to(dtype)
    s = scales.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    codes = ((g - biases.float()[..., None]) / s).round().clamp(0, levels)
    return pack(codes.flatten(-2), spec.bits), scales, biases


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The float weight [..., N, K] that packed/scales/biases represent (computed in fp32)."""
    codes = unpack(packed, spec.bits).float().unflatten(-1, (-1, spec.group_size))
    w = codes * scales.float()[..., None] + biases.float()[..., None]
    return w.flatten(-2).to(dtype)
