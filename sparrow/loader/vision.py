"""Load a vision tower from HF tensors: an in-memory state dict or a checkpoint directory.

Only the tower's tensors are read (the text model's are skipped by name); every one must map
onto a parameter with the same shape, and every parameter must be filled. Errors name the
source, the tensor and the expected shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import safe_open

from sparrow.config import ConfigError
from sparrow.loader.weights import CheckpointError, checkpoint_files
from sparrow.models.vision import VISION_MODEL_TYPES, vision_architecture

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_vision_tensors(
    config: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    where: str = "state dict",
) -> torch.nn.Module:
    """The tower for HF config dict `config`, filled from (HF name, tensor) pairs such as an
    HF model's `state_dict()`, on `device` in `dtype`, in eval mode. Tensors already on
    `device` in `dtype` are used as they are (no copy)."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return _assemble(config, ((name, t, where) for name, t in items), device, dtype, where)


def _assemble(
    config: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor, str]],
    device: torch.device | str,
    dtype: torch.dtype,
    where: str,
) -> torch.nn.Module:
    """Build the tower on the meta device and fill it from (name, tensor, source) triples."""
    arch = vision_architecture(config)
    with torch.device("meta"):
        model = arch.VisionModel(arch.VisionArgs.from_hf(config))
    params = {name: tuple(p.shape) for name, p in model.named_parameters()}
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor, source in tensors:
        param = arch.checkpoint_name(name)
        if param is None:
            continue
        if param not in params:
            raise CheckpointError(
                f"{source}: tensor {name!r} (as {param}) does not belong to "
                f"this {type(model).__name__}"
            )
        if param in loaded:
            raise CheckpointError(
                f"{source}: tensor {name!r} fills {param}, which another tensor already filled"
            )
        _check(name, tensor, params[param], source)
        loaded[param] = tensor.to(device=device, dtype=dtype)
    missing = [f"{n} (expected shape {list(s)})" for n, s in params.items() if n not in loaded]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{where}: missing vision tensors: {', '.join(missing[:5])}{more}")
    model.load_state_dict(loaded, strict=True, assign=True)
    return model.eval()


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], source: str) -> None:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}"
        )
    if tensor.dtype not in _FLOAT_DTYPES:
        raise CheckpointError(
            f"{source}: tensor {name!r} has dtype {tensor.dtype}, expected a "
            f"float dtype with shape {list(shape)}"
        )


def load_vision_checkpoint(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """The tower of the checkpoint in `model_dir` (config.json + safetensors, one file or
    shards), reading only the tower's tensors."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config ({e})") from e
    try:
        arch = vision_architecture(config)
        arch.VisionArgs.from_hf(config)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    files = checkpoint_files(model_dir).values()
    return _assemble(config, _vision_tensors(files, arch), device, dtype, str(model_dir))


def _vision_tensors(
    files: Iterable[Path], arch: ModuleType
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, file) for the tower's tensors, read one at a time."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if arch.checkpoint_name(name) is not None:
                    yield name, f.get_tensor(name), str(path)


def has_vision_tensors(model_dir: str | Path) -> bool:
    """Whether the checkpoint in `model_dir` names a vision tower in its config and holds
    any of the tower's tensors (text-only exports of a multimodal model hold none)."""
    model_dir = Path(model_dir)
    try:
        arch = vision_architecture(json.loads((model_dir / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, ConfigError):
        return False
    for path in checkpoint_files(model_dir).values():
        with safe_open(str(path), framework="pt") as f:
            if any(arch.checkpoint_name(name) is not None for name in f.keys()):
                return True
    return False


def names_vision(config: dict[str, Any]) -> bool:
    """Whether an HF config.json dict describes a model with a vision tower."""
    return (
        isinstance(config.get("vision_config"), dict)
        and config.get("model_type") in VISION_MODEL_TYPES
    )


def random_vision(
    config: dict[str, Any],
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """The tower `config` describes with random weights drawn on `device` (no file): matrices
    normal(0, 0.02), norm weights 1, biases 0; in eval mode."""
    arch = vision_architecture(config)
    with torch.device("meta"):
        model = arch.VisionModel(arch.VisionArgs.from_hf(config))
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
    return model.eval()


def attach_vision(model: torch.nn.Module, model_dir: str | Path) -> bool:
    """Load the checkpoint's vision tower onto `model` (as `model.visual`, on its device,
    in its dtype) if it has one; returns whether it did."""
    if not has_vision_tensors(model_dir):
        return False
    model.visual = load_vision_checkpoint(model_dir, model.device, model.dtype)
    return True
