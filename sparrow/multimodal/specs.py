"""Per-model image preprocessing constants, as frozen dataclasses.

Each architecture's defaults mirror the HF 5.17 image processor that its checkpoints name
(`Qwen2VLImageProcessor` for Qwen3.5/3.6-MoE, `MiniMaxM3VLImageProcessor` for MiniMax M3)
with the values the published `preprocessor_config.json` files set. `from_preprocessor_config`
applies a checkpoint's own file on top, the way the HF processor's `__init__` reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the only resample mode both processors use


@dataclass(frozen=True)
class ImageSpec:
    """How one architecture turns an RGB image into patches and placeholder tokens.

    Patches are `[grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size**2]`;
    an image takes `grid_h * grid_w / merge_size**2` placeholder tokens.
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_token_id: int
    start_token_id: int
    end_token_id: int
    rescale_factor: float = 1 / 255
    max_aspect_ratio: float = 200.0

    def __post_init__(self) -> None:
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ValueError(f"patch, temporal patch and merge sizes must be >= 1: {self}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or not all(self.image_std):
            raise ValueError(f"image_mean/image_std need 3 values, std non-zero: {self}")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged patch."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Width of one flattened patch row: C * T * ph * pw."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def from_preprocessor_config(self, config: dict[str, Any]) -> ImageSpec:
        """Return this spec with a checkpoint's `preprocessor_config.json` values applied.

        Keys read: `size` ({shortest_edge, longest_edge} = min/max pixels), `min_pixels`,
        `max_pixels` (these win over `size`, as in HF), `patch_size`, `temporal_patch_size`,
        `merge_size`, `image_mean`, `image_std`, `rescale_factor`. Settings this pipeline
        does not implement (another resample mode, resize/rescale/normalise switched off)
        raise ValueError instead of being ignored.
        """
        _reject_unsupported(config)
        changes: dict[str, Any] = {}
        size = config.get("size")
        if isinstance(size, dict):
            if size.get("shortest_edge") is not None:
                changes["min_pixels"] = int(size["shortest_edge"])
            if size.get("longest_edge") is not None:
                changes["max_pixels"] = int(size["longest_edge"])
        # MiniMax M3's published file says size [672, 672]; HF ignores it (the class default
        # stands), and so does any other non-dict size here.
        for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            if config.get(key) is not None:
                changes[key] = int(config[key])
        for key in ("image_mean", "image_std"):
            if config.get(key) is not None:
                changes[key] = tuple(float(v) for v in config[key])
        if config.get("rescale_factor") is not None:
            changes["rescale_factor"] = float(config["rescale_factor"])
        return dataclasses.replace(self, **changes)


def _reject_unsupported(config: dict[str, Any]) -> None:
    if config.get("resample", BICUBIC) != BICUBIC:
        raise ValueError(
            f"preprocessor_config resample={config['resample']}: only bicubic "
            f"({BICUBIC}) is implemented"
        )
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if config.get(key, True) is not True:
            raise ValueError(f"preprocessor_config {key}={config[key]}: only true is implemented")


# Qwen3.5/3.6-MoE: Qwen2VLImageProcessor with the checkpoint's preprocessor_config.json
# (size 65,536..16,777,216 pixels, patch 16, mean = std = 0.5); tokens from config.json.
QWEN3_5_MOE = ImageSpec(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=65_536,
    max_pixels=16_777_216,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    image_token_id=248056,
    start_token_id=248053,
    end_token_id=248054,
)

# MiniMax M3: MiniMaxM3VLImageProcessor class defaults (3,136..451,584 pixels, CLIP mean/std).
MINIMAX_M3 = ImageSpec(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=4 * 28 * 28,
    max_pixels=451_584,
    image_mean=OPENAI_CLIP_MEAN,
    image_std=OPENAI_CLIP_STD,
    image_token_id=200025,
    start_token_id=200029,
    end_token_id=200030,
)
