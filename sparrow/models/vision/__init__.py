"""Vision towers, keyed by the HF `model_type` of the multimodal checkpoint's config.json.

Each tower module exports `MODEL_TYPES`, `VisionArgs` (with `VisionArgs.from_hf(config)`),
`VisionModel(args)` (`forward(patches [N, C * T * P * P], grid_thw [num_images, 3]) ->
[num_tokens, text hidden]`) and `checkpoint_name` (HF tensor name -> parameter name, None
for tensors outside the tower). The towers run in plain PyTorch.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from sparrow.config import ConfigError
from sparrow.models.vision import minimax_m3_vision, qwen3_5_vision

VISION_MODEL_TYPES: dict[str, ModuleType] = {
    model_type: module
    for module in (qwen3_5_vision, minimax_m3_vision)
    for model_type in module.MODEL_TYPES
}


def vision_architecture(config: dict[str, Any]) -> ModuleType:
    """The tower module for an HF config.json dict; ConfigError for a model_type without one."""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in VISION_MODEL_TYPES:
        raise ConfigError(
            f"no vision tower for model_type {model_type!r}; supported: "
            f"{sorted(VISION_MODEL_TYPES)}"
        )
    return VISION_MODEL_TYPES[model_type]
