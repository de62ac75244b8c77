"""What a checkpoint's files hold: its safetensors files and tensor headers, the format its
config.json declares and the spec each module is stored at, and, once loaded, what the
model's weights are (`describe`: logged at start-up, shown by /v1/models).

Formats (`QuantConfig.method`): float (no block); MLX group-affine (`quantization`: uint32
words, `.scales`, `.biases`); HF FP8 blocks (`quant_method: "fp8"`: float8_e4m3fn `.weight`
and its `.weight_scale_inv`, the layout Sparrow holds them in, `quant.fp8`);
compressed-tensors (`quant_method: "compressed-tensors"`), whose modules are converted as
they are read (`loader.compressed_tensors`). Each source lists its tensors as Sparrow reads
them, (shape, dtype, file) by name, and reads them one at a time."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from sparrow.config import QuantConfig
from sparrow.distributed.shard import Cut, take
from sparrow.layers.moe import Experts
from sparrow.layers.sigmoid_moe import SigmoidRouter
from sparrow.loader.writer import INDEX_FILE
from sparrow.models import get_architecture
from sparrow.models.common import text_model_name
from sparrow.models.interface import Architecture, ModelArgs
from sparrow.quant.affine import QuantSpec
from sparrow.quant.fp8 import FP8, Fp8Spec

FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
PACKED_DTYPES = {torch.int32, torch.uint32}
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F8_E4M3": FP8,
}

# shape, dtype (a torch dtype, or safetensors' name of one torch does not read), file
Header = tuple[tuple[int, ...], Any, Path]
Spec = QuantSpec | Fp8Spec


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, or does not match the model's config."""


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """The safetensors files of a checkpoint: from the shard index if there is one."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid shard index ({e})") from e
        files = {f: model_dir / f for f in sorted(set(weight_map.values()))}
        for f, path in files.items():
            if not path.is_file():
                raise CheckpointError(f"{index}: lists shard {f} which does not exist")
        return files
    files = {p.name: p for p in sorted(model_dir.glob("*.safetensors"))}
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    return files


def read_headers(files: Iterable[Path]) -> dict[str, Header]:
    """name -> (shape, dtype, file) for every tensor of every file, from the headers alone."""
    out = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())
                    out[name] = (tuple(piece.get_shape()), dtype, path)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from e
    return out


class Checkpoint:
    """A float, MLX or HF FP8 checkpoint: its tensors (`tensors`) as stored (`headers`)."""

    def __init__(self, model_dir: Path, block: QuantConfig | None):
        self.model_dir, self.block = model_dir, block
        self.headers: dict[str, Header] = read_headers(checkpoint_files(model_dir).values())
        self.tensors: dict[str, Header] = self.headers

    @property
    def label(self) -> str:
        """The format, as `describe` reports it."""
        return "float" if self.block is None else self.block.method

    @contextlib.contextmanager
    def reader(self, device: torch.device) -> Iterator[Callable[[str, Cut | None], torch.Tensor]]:
        """read(name, cut) -> the tensor on `device` (only the part `cut` names); files are
        opened as they are first read and closed at the end."""
        with contextlib.ExitStack() as stack:
            handles: dict[Path, Any] = {}

            def read(name: str, cut: Cut | None = None) -> torch.Tensor:
                shape, _, path = self.headers[name]
                if path not in handles:
                    f = safe_open(str(path), framework="pt", device=str(device))
                    handles[path] = stack.enter_context(f)
                if cut is not None:
                    return take(handles[path].get_slice(name), len(shape), cut)
                return handles[path].get_tensor(name)

            yield read

    def stored_spec(self, name: str, shape: tuple[int, ...], dtype, path: Path) -> Spec | None:
        """The spec of the module whose weight tensor is `name` (None: float), checked against
        what config.json declares."""
        packed = dtype in PACKED_DTYPES
        if self.block.method == "fp8":
            if packed:
                raise CheckpointError(
                    f"{path}: tensor {name!r} holds packed words, but config.json declares "
                    f"quant_method 'fp8' (float8_e4m3fn weights with weight_scale_inv)"
                )
            return self.block.fp8 if dtype == FP8 else None
        if dtype == FP8:
            raise CheckpointError(
                f"{path}: tensor {name!r} is float8_e4m3fn, but config.json's quantization "
                f"block is MLX's (group-affine): FP8 checkpoints declare quant_method 'fp8'"
            )
        return _mlx_spec(self.block, name, shape, packed, path)


def stored_quantization(cfg: ModelArgs, ckpt: Checkpoint) -> QuantConfig:
    """How a quantised checkpoint stores each module (`cfg.quantization`: the block its
    config.json declares; `ckpt`: its tensors), as an entry per module under our module paths:
    the spec it is stored at (`Checkpoint.stored_spec`), None where the files hold a float
    matrix. Errors name the file and the tensor: a module stored otherwise than the block
    declares, pieces of one of our modules (gate and up of a fused projection, the routed
    experts' projections) stored at different formats. Shapes are checked as the tensors
    load (`WeightAssembler.target`), missing scales when they are all read
    (`WeightAssembler.finish`)."""
    arch, block = get_architecture(cfg.architecture), cfg.quantization
    layout: dict[str, tuple[Spec | None, str]] = {}  # module -> (spec, a tensor of it)
    for name, (shape, src_dtype, path) in ckpt.tensors.items():
        owner = _owner(arch, name)
        float_src = src_dtype in FLOAT_DTYPES
        if owner is None or owner[1] != "weight" or (float_src and len(shape) < 2):
            continue
        spec = ckpt.stored_spec(name, shape, src_dtype, path)
        module = owner[0]
        if module in layout and layout[module][0] != spec:
            other = layout[module][1]
            raise CheckpointError(
                f"{path}: tensor {name!r} is stored {_width(spec)}, {other!r} "
                f"{_width(layout[module][0])}: both fill {module}, which holds one format"
            )
        layout.setdefault(module, (spec, name))
    if cfg.tie_word_embeddings and "lm_head" not in layout and "embed_tokens" in layout:
        layout["lm_head"] = layout["embed_tokens"]
    return replace(block, overrides=tuple((m, spec) for m, (spec, _) in layout.items()))


def _owner(arch: Architecture, name: str) -> tuple[str, str] | None:
    """(our module, kind: weight / scales / biases / weight_scale_inv / another parameter's
    name) a checkpoint tensor fills; None for tensors the text model does not read."""
    param = arch.checkpoint_name(name)
    if param is None:
        return None
    expert = arch.expert_target(param)
    if expert is None:
        module, _, kind = param.rpartition(".")
        if module.endswith(".experts") and kind in ("gate_up_proj", "down_proj"):
            return module, "weight"  # the fused experts as the release stores them
        return module, kind
    fused, _, _, kind = expert
    if fused.endswith(".weight"):  # a linear layer's fused gate_up (`mlp.gate_up_proj.weight`)
        return fused.removesuffix(".weight"), kind
    return fused.rpartition(".")[0], kind  # the routed experts (`mlp.experts.down_proj`)


def _mlx_spec(
    block: QuantConfig, name: str, shape: tuple[int, ...], packed: bool, path: Path
) -> QuantSpec | None:
    """The spec of the checkpoint module whose `.weight` is `name`, checked against what the
    MLX block declares for it (matched as `QuantConfig.spec_for` matches)."""
    module = text_model_name(name).removesuffix(".weight")
    default = (None, QuantSpec(block.bits, block.group_size))
    matches = (o for o in block.overrides if module == o[0] or module.endswith("." + o[0]))
    entry, declared = next(matches, default)
    if not packed:
        if entry is not None and declared is not None:
            words = [*shape[:-1], shape[-1] // declared.per_word]
            raise CheckpointError(
                f"{path}: tensor {name!r} is stored in float with shape {list(shape)}, but "
                f"config.json's quantization block declares {entry!r} {_width(declared)}: "
                f"expected uint32 packed words with shape {words} and its scales and biases"
            )
        return None
    if declared is None:
        raise CheckpointError(
            f"{path}: tensor {name!r} holds packed words, but config.json's quantization "
            f"block declares {entry!r} unquantised (false)"
        )
    return declared


def _width(spec: Spec | None) -> str:
    if spec is None:
        return "in float"
    if isinstance(spec, Fp8Spec):
        return f"in FP8 ({spec.describe()})"
    return f"at {spec.bits} bits in groups of {spec.group_size}"


def describe(model: nn.Module, checkpoint: str, on_load: bool = False) -> dict[str, Any]:
    """What the model's weights are, for the start-up log and /v1/models: the checkpoint's
    format, whether Sparrow quantised it on load, the float dtype, each quantised format with
    its bits, group or block and how many modules hold it, and the modules kept float (layer
    indices as `*`)."""
    counts: dict[Spec, int] = {}
    kept: set[str] = set()
    for path, module in model.named_modules():
        if path.startswith("visual") or not _holds_weights(module):
            continue
        spec = getattr(module, "spec", None)
        if spec is None:
            kept.add(re.sub(r"\.\d+\.", ".*.", path + ".").rstrip("."))
        else:
            counts[spec] = counts.get(spec, 0) + 1
    quantized = []
    for spec, n in counts.items():
        if isinstance(spec, Fp8Spec):
            entry = {"format": "fp8", "fmt": "e4m3", "bits": 8, "block": list(spec.block)}
        else:
            entry = {"format": "affine", "bits": spec.bits, "group_size": spec.group_size}
        quantized.append(entry | {"modules": n})
    return {
        "checkpoint": checkpoint,
        "quantized_on_load": on_load,
        "dtype": str(model.dtype).removeprefix("torch."),
        "quantized": quantized,
        "float": sorted(kept),
    }


def _holds_weights(module: nn.Module) -> bool:
    """A module whose weight a checkpoint stores as a matrix: linear layers, embeddings,
    routed experts and routers, float or quantised."""
    return hasattr(module, "spec") or isinstance(
        module, nn.Linear | nn.Embedding | Experts | SigmoidRouter
    )


def summary_line(info: Mapping[str, Any]) -> str:
    """`describe`'s dict as one log line."""
    if not info["quantized"]:
        return f"{info['checkpoint']} checkpoint, every weight {info['dtype']}"
    parts = []
    for q in info["quantized"]:
        if q["format"] == "fp8":
            block = "x".join("all" if b is None else str(b) for b in q["block"])
            parts.append(f"fp8 e4m3 blocks {block}: {q['modules']} modules")
        else:
            width = f"affine {q['bits']}-bit groups of {q['group_size']}"
            parts.append(f"{width}: {q['modules']} modules")
    parts.append(f"{info['dtype']}: {', '.join(info['float']) or 'none'}")
    how = "quantised on load" if info["quantized_on_load"] else "as stored"
    return f"{info['checkpoint']} checkpoint, {how}; " + "; ".join(parts)
