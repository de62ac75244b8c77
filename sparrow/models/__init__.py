"""Model architectures as plug-ins, keyed by the HF `model_type` of a checkpoint's config.json.

Each architecture module exports:
- `MODEL_TYPES`: the HF model_type values it runs;
- `ModelArgs`: a frozen dataclass with `ModelArgs.from_hf(config_dict)`, carrying at least
  `architecture` (the module's registry name), `vocab_size`, `max_position_embeddings`
  (and `max_context` where rope scaling takes positions past it),
  `eos_token_ids`, `tie_word_embeddings` and `quantization`;
- `Model(args)`: an `nn.Module` with `forward(meta, cache) -> hidden [T, D]`,
  `logits(hidden) -> [N, vocab] fp32`, `cache_specs()` (one `CacheSpec` or None per layer),
  `device` and `dtype`;
- its weight-name mapping: `checkpoint_name`, `expert_target`, `expert_slice`, and the MLX
  layout hooks `is_mlx_conv`, `from_mlx`, `to_mlx`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from sparrow.config import ConfigError
from sparrow.models import minimax_m3, qwen3_5_moe

ARCHITECTURES: dict[str, ModuleType] = {"qwen3_5_moe": qwen3_5_moe, "minimax_m3": minimax_m3}
MODEL_TYPES: dict[str, ModuleType] = {
    model_type: module for module in ARCHITECTURES.values() for model_type in module.MODEL_TYPES
}


def get_architecture(name: str) -> ModuleType:
    """The architecture module registered as `name` (a ModelArgs' `architecture`)."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def model_args_from_hf(raw: dict[str, Any]) -> Any:
    """The ModelArgs of the architecture that runs this HF config dict; ConfigError for a
    model_type no architecture runs, or a config it rejects."""
    if not isinstance(raw, dict):
        raise ConfigError("expected a JSON object")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"unknown model_type {model_type!r}; supported: {sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type].ModelArgs.from_hf(raw)


def load_model_args(model_dir: str | Path) -> Any:
    """Read and parse `<model_dir>/config.json`; errors name the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    try:
        return model_args_from_hf(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
