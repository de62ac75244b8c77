"""Write tensors as a safetensors checkpoint: one file, or shards plus an index, as HF does."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

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
