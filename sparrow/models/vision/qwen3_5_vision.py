"""The Qwen3.5/3.6-MoE vision tower (HF 5.17 `Qwen3_5MoeVisionModel`): flat patches and
their grids in, one embedding of the text width per 2x2 block of patches out.

Conv3d patch embedding (with bias) plus a learned 48x48 position table resampled bilinearly
(align_corners) to each grid; 27 pre-LN blocks (LayerNorm eps 1e-6, fused qkv, 2-D axial
RoPE over (h, w) applied in fp32, tanh-GELU MLP) with attention within each frame; then the
merger: LayerNorm per patch, 2x2 patches concatenated (4 * 1152 = 4608), Linear 4608 ->
4608, exact GELU, Linear -> out_hidden_size (2048 in the checkpoint, 3584 HF's default).

Parameters are named like HF's without the `model.visual.` prefix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.config import ConfigError
from sparrow.models.vision.common import (
    Grid,
    PatchEmbed,
    VisionArgs,
    activation,
    apply_rotary,
    axial_rotary,
    check_patches,
    frame_bounds,
    grids_of,
    merge_block_coords,
    patch_positions,
    segment_attention,
)

MODEL_TYPES = ("qwen3_5_moe",)
# HF's Qwen3_5MoeVisionConfig defaults where they differ from the checkpoint's.
_HF_MISSING = {"out_hidden_size": 3584}
_INT_KEYS = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "out_hidden_size",
    "num_position_embeddings",
)
LAYER_NORM_EPS = 1e-6  # fixed in HF's blocks and merger


@dataclass(frozen=True)
class Qwen3_5VisionArgs(VisionArgs):
    """The vision tower of Qwen3.5/3.6 MoE; defaults are the Qwen3.6-35B-A3B checkpoint's."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        self.check(_INT_KEYS, "vision_config")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ConfigError(
                f"vision_config num_position_embeddings "
                f"{self.num_position_embeddings} is not a square"
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> Qwen3_5VisionArgs:
        """From an HF `qwen3_5_moe` config.json dict; keys its `vision_config` leaves out
        take HF's defaults. ConfigError on what the tower does not implement."""
        vision = raw.get("vision_config") or {}
        if not isinstance(vision, dict):
            raise ConfigError("vision_config must be a JSON object")
        vision = {"num_heads": vision.get("num_attention_heads")} | vision
        values = {key: vision[key] for key in _INT_KEYS if vision.get(key) is not None}
        values = _HF_MISSING | values
        if vision.get("hidden_act") is not None:
            values["hidden_act"] = vision["hidden_act"]
        return cls(**values | cls.rope_values(vision))

    @property
    def patch_dim(self) -> int:
        """Width of one flat patch row: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class Qwen3_5VisionAttention(nn.Module):
    def __init__(self, args: Qwen3_5VisionArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)  # HF rotates in fp32
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, bounds))


class Qwen3_5VisionMLP(nn.Module):
    def __init__(self, args: Qwen3_5VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3_5VisionBlock(nn.Module):
    def __init__(self, args: Qwen3_5VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = Qwen3_5VisionAttention(args)
        self.mlp = Qwen3_5VisionMLP(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class Qwen3_5PatchMerger(nn.Module):
    """[N, D] -> [N / merge^2, out]: LayerNorm per patch, then each merge block's patches
    (consecutive rows) side by side through Linear, exact GELU, Linear."""

    def __init__(self, args: Qwen3_5VisionArgs):
        super().__init__()
        self.merged = args.hidden_size * args.spatial_merge_size**2
        self.norm = nn.LayerNorm(args.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, args.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3_5VisionModel(nn.Module):
    """Patches [N, C * T * P * P] + grid_thw [num_images, 3] -> [N / merge^2, out_hidden_size],
    the images' tokens in order."""

    def __init__(self, args: Qwen3_5VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(
            args.in_channels, args.temporal_patch_size, args.patch_size, args.hidden_size, bias=True
        )
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = nn.ModuleList(Qwen3_5VisionBlock(args) for _ in range(args.depth))
        self.merger = Qwen3_5PatchMerger(args)

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = grids_of(grid_thw, self.args.spatial_merge_size)
        check_patches(patches, grids, self.args.patch_dim)
        x = self.patch_embed(patches)
        x = x + self.position_embeddings(grids).to(x.dtype)
        cos, sin = self.rotary(grids, x.device)
        bounds = frame_bounds(grids)
        for block in self.blocks:
            x = block(x, cos, sin, bounds)
        return self.merger(x)

    def position_embeddings(self, grids: list[Grid]) -> torch.Tensor:
        """[N, D]: the learned table bilinearly resampled to each grid (4 taps per patch,
        weights in fp32), the same for every frame of a grid."""
        side = math.isqrt(self.args.num_position_embeddings)
        indices, weights = [], []
        for t, h, w in grids:
            rows, cols = merge_block_coords(h, w, self.args.spatial_merge_size)
            row_taps, row_weights = _bilinear_taps(rows, h, side)
            col_taps, col_weights = _bilinear_taps(cols, w, side)
            indices.append(
                (row_taps[:, :, None] * side + col_taps[:, None, :]).view(-1, 4).repeat(t, 1)
            )
            weights.append(
                (row_weights[:, :, None] * col_weights[:, None, :]).view(-1, 4).repeat(t, 1)
            )
        device = self.pos_embed.weight.device
        taps = self.pos_embed(torch.cat(indices).to(device))  # [N, 4, D]
        return (taps * torch.cat(weights).to(device)[:, :, None]).sum(1)

    def rotary(self, grids: list[Grid], device: torch.device) -> tuple[torch.Tensor, ...]:
        """(cos, sin) [N, head_dim] fp32 over the patches' (row, col), every frame alike."""
        positions = patch_positions(grids, self.args.spatial_merge_size)
        cos, sin = axial_rotary(
            positions[:, 1], positions[:, 2], self.args.head_dim, self.args.rope_theta
        )
        return cos.to(device), sin.to(device)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, ...]:
    """Source taps [n, 2] into a `side`-long axis and their weights (fp32) for positions
    `index` on an axis of `size`, align_corners: the ends map onto the table's ends."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return (floor.long()[:, None] + offsets).clamp(0, side - 1), weights


_PREFIX = re.compile(r"^(model\.)?visual\.")


def checkpoint_name(name: str) -> str | None:
    """`model.visual.blocks.0.attn.qkv.weight` -> `blocks.0.attn.qkv.weight`; None for a
    tensor outside the tower (text model, MTP head)."""
    m = _PREFIX.match(name)
    return name[m.end() :] if m else None


VisionArgs = Qwen3_5VisionArgs
VisionModel = Qwen3_5VisionModel
