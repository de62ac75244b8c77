"""CPU-only media pipeline: load and decode images, resize, normalise and patchify them the
way the HF 5.17 processors do, and expand each image into its prompt placeholder tokens.

The package imports nothing from the engine, so the gateway and the single-process server
can both run it in front of the model.
"""

from sparrow.multimodal.image import ProcessedImage, preprocess_image, smart_resize
from sparrow.multimodal.media import MediaError, MediaLimits, decode_image, load_image
from sparrow.multimodal.specs import MINIMAX_M3, QWEN3_5_MOE, ImageSpec, spec_for_model_type

__all__ = [
    "MINIMAX_M3",
    "QWEN3_5_MOE",
    "ImageSpec",
    "MediaError",
    "MediaLimits",
    "ProcessedImage",
    "decode_image",
    "load_image",
    "preprocess_image",
    "smart_resize",
    "spec_for_model_type",
]
