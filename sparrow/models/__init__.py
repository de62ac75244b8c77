"""Model architectures as plug-ins, keyed by the HF `model_type` of a checkpoint's config.json.

Each architecture is one module satisfying `interface.Architecture`: its `ModelArgs`
(`from_hf`), `Model`, presets, weight-name mapping and MLX layout hooks, the formats its
checkpoints speak (`SPEAKS`: stop tokens, tool-call and reasoning parsers, tokenizer layout,
media) and its tensor-parallel plan. Everything outside `models/` reaches a family through
the functions here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparrow.config import ConfigError
from sparrow.models import minimax_m3, qwen3_5_moe, qwen3_moe, qwen3_next
from sparrow.models.interface import Architecture, ModelArgs

ARCHITECTURES: dict[str, Architecture] = {
    module.NAME: module for module in (qwen3_5_moe, minimax_m3, qwen3_next, qwen3_moe)
}
MODEL_TYPES: dict[str, Architecture] = {
    model_type: module for module in ARCHITECTURES.values() for model_type in module.MODEL_TYPES
}
# `sparrow checkpoint random --preset` names -> ModelArgs, over every architecture.
PRESETS: dict[str, ModelArgs] = {
    name: args for module in ARCHITECTURES.values() for name, args in module.PRESETS.items()
}


def get_architecture(name: str) -> Architecture:
    """The architecture module registered as `name` (a ModelArgs' `architecture`)."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def architecture_of(raw: dict[str, Any]) -> Architecture:
    """The architecture that runs an HF config dict; ConfigError for a model_type none runs."""
    if not isinstance(raw, dict):
        raise ConfigError("expected a JSON object")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"unknown model_type {model_type!r}; supported: {sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def model_args_from_hf(raw: dict[str, Any]) -> ModelArgs:
    """The ModelArgs of the architecture that runs this HF config dict; ConfigError for a
    model_type no architecture runs, or a config it rejects."""
    return architecture_of(raw).ModelArgs.from_hf(raw)


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """`<model_dir>/config.json` as a dict; ConfigError names the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e


def architecture_for_dir(model_dir: str | Path) -> Architecture:
    """The architecture of the checkpoint in `model_dir`; errors name the file."""
    try:
        return architecture_of(read_config(model_dir))
    except ConfigError as e:
        raise _named(e, model_dir) from e


def load_model_args(model_dir: str | Path) -> ModelArgs:
    """Read and parse `<model_dir>/config.json`; errors name the file."""
    raw = read_config(model_dir)
    try:
        return model_args_from_hf(raw)
    except ConfigError as e:
        raise _named(e, model_dir) from e


def _named(e: ConfigError, model_dir: str | Path) -> ConfigError:
    path = str(Path(model_dir) / "config.json")
    return e if str(e).startswith(path) else ConfigError(f"{path}: {e}")
