"""The MiniMax M3 vision tower and projector (HF 5.17 `MiniMaxM3VLVisionModel` +
`MiniMaxM3VLMultiModalProjector`): flat patches and their grids in, one embedding of the
text width per 2x2 block of patches out.

CLIP-style encoder: Conv3d patch embedding (2x14x14, no bias), `pre_layrnorm`, 32 pre-LN
layers (LayerNorm eps 1e-5, separate q/k/v/out projections with bias, exact-GELU MLP), no
post-norm. Projector: per patch Linear 1280 -> 6144, GELU, Linear -> 6144; then each 2x2
block's four rows side by side (24576) through Linear -> 6144, GELU, Linear -> 6144.

Two behaviours of HF 5.17 that this file reproduces:
- RoPE: HF's position ids are (frame, row, col) and its axial rotary reads the first two
  columns, so the angles are (frame, row) with head_dim / 4 frequencies each, over the whole
  head (80 dims); the column is never encoded, and for a single image the frame is 0.
- Attention spans every patch of the call: all images and frames passed together attend to
  one another (HF runs one unmasked sequence).

Parameters are named like HF's in memory without the `model.` prefix; `checkpoint_name` also
reads the original MiniMax names that HF's `save_pretrained` writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.config import ConfigError
from sparrow.models.vision.common import (
    PatchEmbed,
    VisionArgs,
    activation,
    apply_rotary,
    axial_rotary,
    check_patches,
    grids_of,
    patch_positions,
    segment_attention,
)

MODEL_TYPES = ("minimax_m3_vl",)
# Args field -> key of the HF vision_config.
_HF_VISION_KEYS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_channels": "num_channels",
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "spatial_merge_size": "spatial_merge_size",
}


@dataclass(frozen=True)
class MiniMaxM3VisionArgs(VisionArgs):
    """The M3 vision tower and projector; defaults are HF's (the released checkpoint's)."""

    num_layers: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_heads: int = 16
    hidden_act: str = "gelu"
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    projector_hidden_size: int = 6144
    text_hidden_size: int = 6144

    def __post_init__(self) -> None:
        self.check((*_HF_VISION_KEYS, "projector_hidden_size", "text_hidden_size"), "M3 vision")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> MiniMaxM3VisionArgs:
        """From an HF `minimax_m3_vl` config.json dict: `vision_config`, the top-level
        `projector_hidden_size` and `text_config.hidden_size`; missing keys take HF's
        defaults. ConfigError on what the tower does not implement."""
        vision, text = raw.get("vision_config") or {}, raw.get("text_config") or {}
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ConfigError("vision_config and text_config must be JSON objects")
        values: dict[str, Any] = {
            field: vision[key]
            for field, key in _HF_VISION_KEYS.items()
            if vision.get(key) is not None
        }
        for field in ("hidden_act", "layer_norm_eps"):
            if vision.get(field) is not None:
                values[field] = vision[field]
        values |= cls.rope_values(vision)
        if raw.get("projector_hidden_size") is not None:
            values["projector_hidden_size"] = raw["projector_hidden_size"]
        if text.get("hidden_size") is not None:
            values["text_hidden_size"] = text["hidden_size"]
        return cls(**values)

    @property
    def patch_dim(self) -> int:
        """Width of one flat patch row: C * T * P * P."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2


class MiniMaxM3VisionAttention(nn.Module):
    def __init__(self, args: MiniMaxM3VisionArgs):
        super().__init__()
        self.num_heads = args.num_heads
        dim = args.hidden_size
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, -1)
        q = apply_rotary(self.q_proj(x).view(shape), cos, sin)  # in x's dtype, as HF
        k = apply_rotary(self.k_proj(x).view(shape), cos, sin)
        return self.out_proj(segment_attention(q, k, self.v_proj(x).view(shape), bounds))


class MiniMaxM3VisionMLP(nn.Module):
    def __init__(self, args: MiniMaxM3VisionArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MiniMaxM3VisionLayer(nn.Module):
    def __init__(self, args: MiniMaxM3VisionArgs):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = MiniMaxM3VisionAttention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = MiniMaxM3VisionMLP(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, bounds)
        return x + self.mlp(self.layer_norm2(x))


class MiniMaxM3VisionEncoder(nn.Module):
    """Patches [N, C * T * P * P] -> [N, hidden_size]; every patch of the call attends to
    every other."""

    def __init__(self, args: MiniMaxM3VisionArgs):
        super().__init__()
        self.args = args
        self.embeddings = PatchEmbed(
            args.num_channels,
            args.temporal_patch_size,
            args.patch_size,
            args.hidden_size,
            bias=False,
        )
        self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.layers = nn.ModuleList(MiniMaxM3VisionLayer(args) for _ in range(args.num_layers))

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = grids_of(grid_thw, self.args.spatial_merge_size)
        check_patches(patches, grids, self.args.patch_dim)
        x = self.embeddings(patches)
        positions = patch_positions(grids, self.args.spatial_merge_size).to(x.device)
        # HF's rotary reads columns 0 and 1 of (frame, row, col): frame and row.
        cos, sin = axial_rotary(
            positions[:, 0], positions[:, 1], self.args.head_dim, self.args.rope_theta
        )
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x = self.pre_layrnorm(x)
        bounds = [0, x.shape[0]]  # one segment: the whole call, as HF
        for layer in self.layers:
            x = layer(x, cos, sin, bounds)
        return x


class MiniMaxM3Projector(nn.Module):
    """[N, hidden_size] -> [N / merge^2, text_hidden_size]: a GELU MLP per patch, then one
    over each merge block's patches (consecutive rows) side by side."""

    def __init__(self, args: MiniMaxM3VisionArgs):
        super().__init__()
        merged = args.text_hidden_size * args.spatial_merge_size**2
        self.linear_1 = nn.Linear(args.hidden_size, args.projector_hidden_size)
        self.linear_2 = nn.Linear(args.projector_hidden_size, args.text_hidden_size)
        self.merge_linear_1 = nn.Linear(merged, args.projector_hidden_size)
        self.merge_linear_2 = nn.Linear(args.projector_hidden_size, args.text_hidden_size)
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_2(F.gelu(self.linear_1(x))).reshape(-1, self.merged)
        return self.merge_linear_2(F.gelu(self.merge_linear_1(x)))


class MiniMaxM3VisionModel(nn.Module):
    """Patches [N, C * T * P * P] + grid_thw [num_images, 3] -> [N / merge^2,
    text_hidden_size], the images' tokens in order."""

    def __init__(self, args: MiniMaxM3VisionArgs):
        super().__init__()
        self.args = args
        self.vision_tower = MiniMaxM3VisionEncoder(args)
        self.multi_modal_projector = MiniMaxM3Projector(args)

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(patches, grid_thw))


_VISION = re.compile(r"^(model\.)?(vision_tower\.|multi_modal_projector\.|patch_merge_mlp\.)")
# The original MiniMax names (what HF's save_pretrained writes) -> HF's in-memory names.
_RENAMES = (
    (
        re.compile(r"^vision_tower\.vision_model\.embeddings\.patch_embedding\."),
        "vision_tower.embeddings.proj.",
    ),
    (re.compile(r"^vision_tower\.vision_model\.encoder\.layers\."), "vision_tower.layers."),
    (re.compile(r"^vision_tower\.vision_model\."), "vision_tower."),
    (re.compile(r"^patch_merge_mlp\.linear_"), "multi_modal_projector.merge_linear_"),
    # save_pretrained's reversed `.block_sparse_moe.` -> `.mlp.` rename reaches these too.
    (re.compile(r"^(vision_tower\.layers\.\d+)\.block_sparse_moe\."), r"\1.mlp."),
)


def checkpoint_name(name: str) -> str | None:
    """Map an HF in-memory or original MiniMax tensor name to ours; None outside the tower.
    `vision_tower.vision_model.encoder.layers.3.block_sparse_moe.fc1.weight` ->
    `vision_tower.layers.3.mlp.fc1.weight`; `patch_merge_mlp.linear_1.bias` ->
    `multi_modal_projector.merge_linear_1.bias`."""
    if not _VISION.match(name):
        return None
    name = name.removeprefix("model.")
    for pattern, target in _RENAMES:
        name = pattern.sub(target, name, count=1)
    return name


VisionArgs = MiniMaxM3VisionArgs
VisionModel = MiniMaxM3VisionModel
