"""CPU-only media pipeline: load and decode images and videos, sample frames, resize,
normalise and patchify them the way the HF 5.17 processors do, and expand each item into its
prompt placeholder.

The package imports nothing from the engine, so the gateway and the single-process server
can both run it in front of the model.
"""

from sparrow.multimodal.fetch import fetch_bytes, load_image
from sparrow.multimodal.image import ProcessedImage, preprocess_image, smart_resize
from sparrow.multimodal.media import MediaError, MediaLimits, decode_image, media_digest
from sparrow.multimodal.specs import MINIMAX_M3, QWEN3_5_MOE, ImageSpec
from sparrow.multimodal.video import (
    MINIMAX_M3_VIDEO,
    QWEN3_5_MOE_VIDEO,
    ProcessedVideo,
    VideoSpec,
    placeholder_text,
    preprocess_video,
)

__all__ = [
    "MINIMAX_M3",
    "MINIMAX_M3_VIDEO",
    "QWEN3_5_MOE",
    "QWEN3_5_MOE_VIDEO",
    "ImageSpec",
    "MediaError",
    "MediaLimits",
    "ProcessedImage",
    "ProcessedVideo",
    "VideoSpec",
    "decode_image",
    "fetch_bytes",
    "load_image",
    "media_digest",
    "placeholder_text",
    "preprocess_image",
    "preprocess_video",
    "smart_resize",
]
