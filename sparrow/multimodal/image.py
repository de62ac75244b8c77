"""Image -> (pixel patches, grid_thw, placeholder tokens), bit-identical to the HF 5.17
torchvision-backend processors on CPU.

The steps follow `Qwen2VLImageProcessor` / `MiniMaxM3VLImageProcessor`: `smart_resize` picks
a size that is a multiple of `patch * merge` within the pixel budget; the uint8 image goes
through torch's native uint8 antialiased bicubic (what torchvision's resize calls on CPU; PIL
differs by about one level, float or GPU paths by more); then `(x - 255 mean) / (255 std)`
in float32; then patchify, with the single frame repeated `temporal_patch_size` times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from sparrow.multimodal.media import MediaError
from sparrow.multimodal.specs import ImageSpec


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for a vision tower.

    pixel_values: [grid_t * grid_h * grid_w, C * T * ph * pw] float32; rows ordered
    (t, h / merge, w / merge, merge_h, merge_w), columns (C, T, ph, pw).
    grid_thw: (grid_t, grid_h, grid_w) in patches.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int


def smart_resize(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """Target (height, width): multiples of `spec.factor`, pixels within the spec's budget.

    The same arithmetic as HF `smart_resize` (qwen2_vl / minimax_m3_vl image processing);
    an aspect ratio above `spec.max_aspect_ratio` is a MediaError.
    """
    if min(height, width) < 1:
        raise MediaError(f"image has no pixels: {width}x{height}")
    ratio = max(height, width) / min(height, width)
    if ratio > spec.max_aspect_ratio:
        raise MediaError(f"image aspect ratio {ratio:.1f} exceeds {spec.max_aspect_ratio:g}")
    factor = spec.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > spec.max_pixels:
        beta = math.sqrt((height * width) / spec.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> [1, 3, H, W] uint8, channels-last in memory as torchvision makes it."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    array = np.array(image, dtype=np.uint8, copy=True)
    return torch.from_numpy(array).permute(2, 0, 1).unsqueeze(0)


def resize_uint8(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[N, 3, h, w] uint8 -> [N, 3, height, width] uint8, antialiased bicubic, torch native."""
    if images.dtype != torch.uint8:
        raise TypeError(f"resize_uint8 takes uint8, got {images.dtype}")
    if tuple(images.shape[-2:]) == (height, width):
        return images
    return F.interpolate(
        images, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )


def normalize(images: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> float32 `(x - mean / rescale) / (std / rescale)`, HF's fused form."""
    scale = 1.0 / spec.rescale_factor
    mean = (torch.tensor(spec.image_mean) * scale).view(-1, 1, 1)
    std = (torch.tensor(spec.image_std) * scale).view(-1, 1, 1)
    return (images.to(torch.float32) - mean) / std


def patchify(images: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    """[N, C, H, W] -> [N, grid_h * grid_w, C * T * ph * pw], the frame repeated T times."""
    n, c, height, width = images.shape
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    patches = images.reshape(n, c, grid_h // m, m, p, grid_w // m, m, p)
    # [N, grid_h/m, grid_w/m, m, m, C, p, p]
    patches = patches.permute(0, 2, 5, 3, 6, 1, 4, 7)
    patches = patches.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
    return patches.reshape(n, grid_h * grid_w, c * t * p * p)


def preprocess_image(image: Image.Image, spec: ImageSpec) -> ProcessedImage:
    """Resize, normalise and patchify one decoded RGB image for `spec`'s vision tower."""
    height, width = image.height, image.width
    target_h, target_w = smart_resize(height, width, spec)
    pixels = resize_uint8(image_to_tensor(image), target_h, target_w)
    patches = patchify(normalize(pixels, spec), spec)[0]
    grid = (1, target_h // spec.patch_size, target_w // spec.patch_size)
    return ProcessedImage(patches, grid, num_image_tokens(grid, spec))


def num_image_tokens(grid_thw: tuple[int, int, int], spec: ImageSpec) -> int:
    """Placeholder tokens one image takes: t * h * w / merge**2."""
    t, h, w = grid_thw
    return t * h * w // spec.merge_size**2


def placeholder_token_ids(num_tokens: int, spec: ImageSpec) -> list[int]:
    """The prompt span for one image: start, `num_tokens` image pads, end."""
    return [spec.start_token_id] + [spec.image_token_id] * num_tokens + [spec.end_token_id]
