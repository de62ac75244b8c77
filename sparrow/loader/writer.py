"""Write checkpoints: safetensors shards (one file, or shards plus an index, as HF does) and
the float release layout of a model's family (`save_checkpoint`), which HF transformers,
mlx-lm and llama.cpp's converter read as they read the family's published checkpoints."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from sparrow.models import get_architecture
from sparrow.models.interface import ModelArgs

INDEX_FILE = "model.safetensors.index.json"


class ShardWriter:
    """Accumulates tensors and saves a shard whenever `shard_bytes` would be exceeded, so a
    checkpoint larger than host memory can be written tensor by tensor.

        with ShardWriter(out_dir) as w:
            for name, t in tensors: w.add(name, t)
    """

    def __init__(self, out_dir: str | Path, shard_bytes: int = 4 << 30):
        self.out, self.shard_bytes = Path(out_dir), shard_bytes
        self.out.mkdir(parents=True, exist_ok=True)
        self.current: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.shard_bytes:
            self._flush()
        self.current[name] = tensor.contiguous().cpu()
        self.size += nbytes

    def _flush(self) -> None:
        self.shards.append(list(self.current))
        path = self.out / f"model-{len(self.shards):05d}.safetensors"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.current, self.size = {}, 0

    def close(self) -> None:
        """Save the last shard and name the files: model.safetensors, or
        model-0000i-of-0000n.safetensors with model.safetensors.index.json."""
        self._flush()
        n = len(self.shards)
        if n == 1:
            (self.out / "model-00001.safetensors").rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.shards, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.out / f"model-{i:05d}.safetensors").rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {}, "weight_map": weight_map}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()


def text_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, tensor) of what a text checkpoint of `model` holds: not the vision
    tower, and not the lm_head where it is tied to the embedding."""
    tied = model.config.tie_word_embeddings
    for param, t in model.state_dict().items():
        if param.startswith("visual.") or (tied and param.startswith("lm_head.")):
            continue
        yield param, t


def release_config(
    cfg: ModelArgs, dtype: torch.dtype | None = None, vision: bool = False
) -> dict[str, Any]:
    """The config.json of the family's release for `cfg`; its `vision_config` only with
    `vision` (the checkpoints written here hold no tower; mlx-lm's writer drops it too);
    `dtype` names the tensors' float type."""
    config = cfg.to_hf_config()
    if not vision:
        config.pop("vision_config", None)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    return config


def release_tensors(
    cfg: ModelArgs, params: Iterable[tuple[str, torch.Tensor]], mlx: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for parameters (name, tensor) of a `cfg` model, laid out as
    the family's float release (or, with `mlx`, mlx-lm's MLX layout) stores them."""
    arch = get_architecture(cfg.architecture)
    for param, t in params:
        yield from arch.release_tensors(param, t, mlx)


def write_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    shard_bytes: int = 4 << 30,
    progress: bool = False,
) -> Path:
    """config.json and the (checkpoint name, tensor) pairs as safetensors shards, written
    tensor by tensor."""
    out = Path(out_dir)
    with ShardWriter(out, shard_bytes) as writer:
        for name, t in tqdm(tensors, desc="writing weights", unit="tensor", disable=not progress):
            writer.add(name, t)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def save_checkpoint(
    model: torch.nn.Module,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    shard_bytes: int = 4 << 30,
) -> Path:
    """A float model as its family's released float checkpoint (config.json and safetensors;
    tensors cast to `dtype` if given). Quantised models go to the MLX layout
    (`mlx_writer.save_mlx_checkpoint`)."""
    cfg = model.config
    if cfg.quantization is not None:
        raise ValueError("a quantised model is written in the MLX layout (save_mlx_checkpoint)")
    params = text_parameters(model)
    if dtype is not None:
        params = ((p, t.to(dtype)) for p, t in params)
    config = release_config(cfg, dtype or next(model.parameters()).dtype)
    return write_checkpoint(out_dir, config, release_tensors(cfg, params), shard_bytes)
