"""Write a model (quantised or not) as an MLX-layout checkpoint.

The layout mlx-lm / mlx-vlm use for Qwen3.5/3.6 MoE: keys under `language_model.model.` (and
`language_model.lm_head.`), experts as `mlp.switch_mlp.{gate,up,down}_proj` stacked over
experts, the depthwise conv as [C, K, 1], +1 baked into the zero-centred RMSNorm weights,
packed weights as uint32 with `.scales` / `.biases`, and a `quantization` block in
config.json. `load_checkpoint` reads it back (and real mlx-community checkpoints) unchanged.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from sparrow.loader.writer import ShardWriter
from sparrow.models import get_architecture

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def mlx_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(MLX name, tensor) for every parameter of `model`, in the MLX layout."""
    arch = get_architecture(model.config.architecture)
    inter = model.config.moe_intermediate_size
    for param, t in model.state_dict().items():
        t = t.view(torch.uint32) if t.dtype == torch.int32 else t
        if param.startswith("lm_head."):
            yield f"language_model.{param}", t
            continue
        if ".mlp.experts." in param:
            mlp, _, rest = param.partition(".experts.")
            fused, _, kind = rest.partition("_proj")
            kind = kind.lstrip("_") or "weight"
            projs = ("gate_proj", "up_proj") if fused == "gate_up" else ("down_proj",)
            for proj in projs:
                rows = arch.expert_slice(proj, inter)
                name = f"language_model.model.{mlp}.switch_mlp.{proj}.{kind}"
                yield name, t[:, rows].contiguous()
            continue
        yield f"language_model.model.{param}", arch.to_mlx(param, t)


def save_mlx_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    shard_bytes: int = 4 << 30,
) -> Path:
    """Write config.json (with the quantization block), safetensors shards, and the tokenizer
    files found in `tokenizer_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    config = cfg.to_hf_config()
    if cfg.quantization is not None:
        paths = [p for p, m in model.named_modules() if hasattr(m, "weight")]
        config["quantization"] = cfg.quantization.to_mlx(paths)
        config["quantization_config"] = config["quantization"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with ShardWriter(out, shard_bytes) as writer:
        for name, t in mlx_tensors(model):
            writer.add(name, t)
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out
