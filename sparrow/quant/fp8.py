"""FP8 block-scaled weights: HF's `quant_method: "fp8"` (DeepSeek style, as Qwen3.6's and
MiniMax M2's FP8 releases store them).

A weight [..., N, K] is stored as float8_e4m3fn codes and a float32 multiplier per block of
[block_n, block_k] weights, `weight_scale_inv` [..., ceil(N / block_n), ceil(K / block_k)]
(despite its name it multiplies):

    w[n, k] = float(code[n, k]) * weight_scale_inv[n // block_n, k // block_k]

A block dim of None spans the whole dim: (1, None) is a scale per output channel, (None, None)
one per tensor (compressed-tensors' FP8 strategies, `loader.compressed_tensors`). A gate_up
projection that a checkpoint stores as two pieces (gate rows, then up rows) keeps the pieces'
block rows apart: `segments=2`, each half its own grid (the same grid as the whole when the
half is a multiple of block_n).

Quantisation is HF transformers 5.17's (`integrations/finegrained_fp8.py`, `Fp8Quantize`):
per block amax, scale = 448 / amax (1 for an all-zero block), codes = clamp(w * scale) cast to
e4m3, `weight_scale_inv` = 1 / scale, all in fp32. A block cut short by the end of a dim takes
the amax of what it holds: checkpoints of other tools (DeepSeek style) store such ceil grids;
HF's quantiser, and Sparrow quantising on load (`layers.fp8.fp8_twin`), leave such matrices
in float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


@dataclass(frozen=True)
class Fp8Spec:
    """Block of weights one scale covers: [block_n rows, block_k columns]; None: the whole
    dim."""

    block_n: int | None = 128
    block_k: int | None = 128

    def __post_init__(self) -> None:
        for b in (self.block_n, self.block_k):
            if b is not None and b < 1:
                raise ValueError(f"FP8 block dims must be positive, got {self.block}")

    @property
    def bits(self) -> int:
        return 8

    @property
    def block(self) -> tuple[int | None, int | None]:
        return self.block_n, self.block_k

    def grid(self, rows: int, cols: int) -> tuple[int, int]:
        """Scales of one [rows, cols] matrix: (ceil(rows / block_n), ceil(cols / block_k))."""
        gn = 1 if self.block_n is None else math.ceil(rows / self.block_n)
        gk = 1 if self.block_k is None else math.ceil(cols / self.block_k)
        return gn, gk

    def scale_shape(self, shape: tuple[int, ...], segments: int = 1) -> tuple[int, ...]:
        """[..., N, K] -> the shape of `weight_scale_inv`: [..., segments * gn, gk] with the
        grid of one segment of N / segments rows."""
        gn, gk = self.grid(shape[-2] // segments, shape[-1])
        return (*shape[:-2], segments * gn, gk)

    def describe(self) -> str:
        if self.block_n is None and self.block_k is None:
            return "per-tensor"
        if self.block_n == 1 and self.block_k is None:
            return "per-channel"
        return f"blocks of [{self.block_n or 'N'}, {self.block_k or 'K'}]"


def scale_name(param: str) -> str:
    """The `weight_scale_inv` beside a weight, named as HF names it: `X.weight` ->
    `X.weight_scale_inv`, a fused expert tensor `experts.gate_up_proj` ->
    `experts.gate_up_proj_scale_inv`."""
    return param + "_scale_inv"


def _blocks(w: torch.Tensor, spec: Fp8Spec, grid: tuple[int, int]) -> torch.Tensor:
    """[..., N, K] fp32, zero-padded to whole blocks -> [..., gn, bn, gk, bk]."""
    n, k = w.shape[-2:]
    bn, bk = spec.block_n or n, spec.block_k or k
    w = F.pad(w, (0, grid[1] * bk - k, 0, grid[0] * bn - n))
    return w.unflatten(-1, (grid[1], bk)).unflatten(-3, (grid[0], bn))


def _unblock(w: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[..., gn, bn, gk, bk] -> [..., N, K] (the padding dropped)."""
    return w.flatten(-2).flatten(-3, -2)[..., :n, :k]


def quantize(
    w: torch.Tensor, spec: Fp8Spec, segments: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (codes float8_e4m3fn [..., N, K], weight_scale_inv float32
    [..., segments * gn, gk]), HF's `Fp8Quantize` block by block."""
    if segments > 1:
        parts = [quantize(p, spec) for p in w.chunk(segments, dim=-2)]
        return torch.cat([q for q, _ in parts], -2), torch.cat([s for _, s in parts], -2)
    if w.dim() > 2:  # expert by expert: the fp32 copy of a fused expert tensor is 4x its size
        parts = [quantize(x, spec) for x in w]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    n, k = w.shape[-2:]
    blocks = _blocks(w.float(), spec, spec.grid(n, k))
    max_abs = blocks.abs().amax(dim=(-3, -1))
    safe_max_abs = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = FP8_MAX / safe_max_abs
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inv_scales = (1.0 / scales).to(torch.float32)
    scaled = blocks * scales.unsqueeze(-1).unsqueeze(-3)
    codes = torch.clamp(scaled, min=-FP8_MAX, max=FP8_MAX).to(FP8)
    return _unblock(codes, n, k).contiguous(), inv_scales


def dequantize(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    spec: Fp8Spec,
    dtype: torch.dtype = torch.float32,
    segments: int = 1,
) -> torch.Tensor:
    """The float weight [..., N, K] that codes [..., N, K] and weight_scale_inv represent:
    fp32 code * fp32 scale (HF's `Fp8Dequantize`), in `dtype`."""
    if segments > 1:
        parts = zip(codes.chunk(segments, -2), scale_inv.chunk(segments, -2), strict=True)
        return torch.cat([dequantize(c, s, spec, dtype) for c, s in parts], -2)
    n, k = codes.shape[-2:]
    blocks = _blocks(codes.float(), spec, tuple(scale_inv.shape[-2:]))
    w = blocks * scale_inv.float().unsqueeze(-1).unsqueeze(-3)
    return _unblock(w, n, k).to(dtype)
