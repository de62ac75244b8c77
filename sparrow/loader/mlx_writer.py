"""Write a model (quantised or not) as an MLX-layout checkpoint, the layout mlx-lm reads and
writes for the family (`Architecture.release_tensors` with `mlx`: names as mlx-lm's model
has them after its `sanitize`, e.g. Qwen3.5/3.6 under `language_model.model.` with experts
as `mlp.switch_mlp.{gate,up,down}_proj` stacked over experts, the depthwise conv as
[C, K, 1] and +1 baked into the zero-centred RMSNorm weights).

Packed weights are uint32 with `.scales` / `.biases`; config.json is the release's with a
`quantization` block that describes exactly the tensors stored: the default width, an entry
for each module quantised otherwise (the 8-bit routers, the widths of a model loaded from a
mixed-recipe checkpoint), and `false` for each module mlx-lm could quantise that is stored
in float (M3's routers by Sparrow's policy, layers whose input is not a whole number of
groups). `load_checkpoint` reads it back (and real mlx-community checkpoints) unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparrow.layers.quantized import companion
from sparrow.loader.writer import ShardWriter, release_config, text_parameters
from sparrow.models import get_architecture
from sparrow.quant.affine import QuantSpec

# Copied beside the weights from `tokenizer_dir`, as mlx-lm's `save` copies them.
_COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _specs(model: nn.Module) -> dict[str, QuantSpec]:
    """Quantised parameter (packed words, scales and biases) -> its module's spec."""
    specs = {}
    for path, module in model.named_modules():
        for name in getattr(module, "logical_shapes", ()):
            param = f"{path}.{name}" if path else name
            for p in (param, companion(param, "scales"), companion(param, "biases")):
                specs[p] = module.spec
    return specs


def save_mlx_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    shard_bytes: int = 4 << 30,
) -> Path:
    """Write safetensors shards, config.json (with the quantization block of a quantised
    model), and the tokenizer and generation config files found in `tokenizer_dir`."""
    out = Path(out_dir)
    cfg = model.config
    arch = get_architecture(cfg.architecture)
    specs = _specs(model)
    block: dict[str, Any] | None = None
    if cfg.quantization is not None:
        q = cfg.quantization
        block = {"group_size": q.group_size, "bits": q.bits, "mode": "affine"}
    with ShardWriter(out, shard_bytes) as writer:
        for param, t in text_parameters(model):
            spec = specs.get(param)
            for name, piece in arch.release_tensors(param, t, True):
                writer.add(name, piece.view(torch.uint32) if piece.dtype == torch.int32 else piece)
                if block is not None:
                    conv = arch.is_mlx_conv(param, tuple(piece.shape))
                    _describe(block, name, piece, spec, conv)
    config = release_config(cfg)
    if block is not None:
        config["quantization"] = config["quantization_config"] = block
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in _COPIED_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out


def _describe(
    block: dict[str, Any], name: str, tensor: torch.Tensor, spec: QuantSpec | None, conv: bool
) -> None:
    """Enter one written tensor's module into the MLX quantization block: its spec where it
    differs from the default (on its `.scales`), `false` for a float matrix (a module mlx-lm
    would otherwise take for quantised by default)."""
    module, _, kind = name.rpartition(".")
    if spec is not None and kind == "scales":
        if (spec.bits, spec.group_size) != (block["bits"], block["group_size"]):
            block[module] = {"group_size": spec.group_size, "bits": spec.bits}
    elif spec is None and kind == "weight" and tensor.dim() >= 2 and not conv:
        block[module] = False
