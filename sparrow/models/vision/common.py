"""Pieces both vision towers use: the patch embedding, the grids of one call, patch
coordinates in merge-block order, 2-D axial rotary, and attention over segments of the
packed patch sequence.

Shapes: N patches of all images of a call back to back, H heads of size Dh; a grid is
(t, h, w) in patches, its patches ordered (t, h / merge, w / merge, merge_h, merge_w), the
order the HF processors and `sparrow.multimodal` emit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.config import ConfigError

Grid = tuple[int, int, int]

# HF ACT2FN names -> functions: "gelu" is the exact (erf) GELU.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation an HF `hidden_act` names; ConfigError for one not implemented."""
    if name not in ACTIVATIONS:
        raise ConfigError(
            f"vision hidden_act {name!r} is not implemented; supported: {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def check_heads(hidden_size: int, num_heads: int) -> None:
    """ConfigError unless the width splits into heads whose size is a multiple of 4: HF's
    axial rotary gives head_dim / 4 frequencies to each of its two axes."""
    if min(hidden_size, num_heads) < 1 or hidden_size % num_heads:
        raise ConfigError(
            f"vision hidden_size {hidden_size} is not a multiple of num_heads {num_heads}"
        )
    if (hidden_size // num_heads) % 4:
        raise ConfigError(f"vision head dim {hidden_size // num_heads} must be a multiple of 4")


class VisionArgs:
    """What the towers' frozen args dataclasses share: head size, validation, and the axial
    rope's theta as HF's `vision_config` gives it."""

    hidden_size: int
    num_heads: int
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def check(self, positive: Sequence[str], what: str) -> None:
        """ConfigError unless the `positive` fields are positive integers, the heads divide
        the width and the activation exists."""
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{what} {key} must be a positive integer, got {value!r}")
        check_heads(self.hidden_size, self.num_heads)
        activation(self.hidden_act)

    @staticmethod
    def rope_values(vision: dict[str, Any]) -> dict[str, float]:
        """`rope_theta` from a vision_config (in `rope_parameters` or at its top level);
        ConfigError for a rope type other than axial."""
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision rope_type {rope['rope_type']!r}: only axial exists")
        theta = rope.get("rope_theta", vision.get("rope_theta"))
        return {} if theta is None else {"rope_theta": float(theta)}


class PatchEmbed(nn.Module):
    """Flat patches [N, C * T * P * P] -> [N, D]. The parameter is HF's Conv3d (kernel =
    stride = (T, P, P)); on one patch per row that conv is a matmul with the kernel flattened
    in the same (C, T, P, P) order as the columns."""

    def __init__(self, channels: int, temporal: int, patch: int, dim: int, bias: bool):
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(channels, dim, kernel, stride=kernel, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(
            patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias
        )


def grids_of(grid_thw: torch.Tensor | Sequence[Sequence[int]], merge: int) -> list[Grid]:
    """`grid_thw` [num_images, 3] as (t, h, w) tuples; ValueError for a grid that is not
    positive or whose h, w are not multiples of `merge`."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
    grids = [tuple(int(v) for v in row) for row in rows]
    for grid in grids:
        if len(grid) != 3 or min(grid) < 1 or grid[1] % merge or grid[2] % merge:
            raise ValueError(
                f"grid_thw row {list(grid)}: need (t, h, w) >= 1 with h and w "
                f"multiples of the merge size {merge}"
            )
    if not grids:
        raise ValueError("grid_thw holds no images")
    return grids


def check_patches(patches: torch.Tensor, grids: list[Grid], patch_dim: int) -> None:
    """ValueError unless `patches` is [sum of t * h * w, patch_dim]."""
    rows = sum(t * h * w for t, h, w in grids)
    if patches.dim() != 2 or tuple(patches.shape) != (rows, patch_dim):
        raise ValueError(
            f"patches have shape {list(patches.shape)}, expected [{rows}, "
            f"{patch_dim}] for grids {grids}"
        )


def merge_block_coords(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) [h * w] of one frame's patches, in merge-block order."""
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    return rows.flatten(), cols.flatten()


def patch_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """[N, 3] long: (frame, row, col) of every patch of the call, in patch order."""
    out = []
    for t, h, w in grids:
        rows, cols = merge_block_coords(h, w, merge)
        frames = torch.arange(t).repeat_interleave(h * w)
        out.append(torch.stack([frames, rows.repeat(t), cols.repeat(t)], dim=-1))
    return torch.cat(out)


def frame_bounds(grids: list[Grid]) -> list[int]:
    """Segment boundaries [0, ..., N] with one segment per frame (t slice) of every grid."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def axial_rotary(
    first: torch.Tensor, second: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [N, head_dim] fp32 for HF's axial RoPE over two position axes [N]:
    head_dim / 4 frequencies `theta^(-2i / (head_dim / 2))` per axis; the angles are
    (first, second) concatenated, then repeated for the rotate-half layout."""
    half = head_dim // 2
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=first.device) / half)
    )
    angles = torch.cat(
        [first[:, None].float() * inv_freq, second[:, None].float() * inv_freq], dim=-1
    )
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: x [N, H, Dh], cos / sin [N, Dh], in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]
) -> torch.Tensor:
    """Bidirectional attention within each segment [bounds[i], bounds[i + 1]): q, k, v
    [N, H, Dh] -> [N, H * Dh]. One SDPA call per segment, so the scores of one segment at a
    time exist; scale Dh^-0.5."""
    scale = q.shape[-1] ** -0.5
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [1, H, L, Dh]
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs).reshape(q.shape[0], -1)
