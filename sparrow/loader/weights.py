"""Load HF-format weights into a model, tensor by tensor, straight onto the target device.

Sources are safetensors checkpoints (one file, or shards listed by
`model.safetensors.index.json`) or an in-memory state dict. Both go through `WeightAssembler`,
which maps names, checks every shape and dtype against the model, fills fused expert tensors
from per-expert weights, and reports what is missing. Errors name the file, the tensor and
the expected shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from sparrow.config import ModelConfig, load_model_config
from sparrow.models import get_architecture

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, or does not match the model's config."""


_FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def build_empty_model(cfg: ModelConfig) -> torch.nn.Module:
    """The model with parameters on the meta device (no memory) for the loader to fill."""
    with torch.device("meta"):
        return get_architecture(cfg.architecture).Model(cfg)


class WeightAssembler:
    """Collects checkpoint tensors into a model's parameters on `device` in `dtype`."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype):
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.arch = get_architecture(model.config.architecture)
        self.expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.tensors: dict[str, torch.Tensor] = {}
        self.expert_parts: dict[str, set[tuple[int, str]]] = {}
        self.sources: dict[str, str] = {}

    def target_shape(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """(parameter, expected shape of this checkpoint tensor); None if it is ignored."""
        param = self.arch.checkpoint_name(name)
        if param is None:
            return None
        expert = self.arch.per_expert_target(param)
        if expert is not None:
            fused, _, proj = expert
            if fused not in self.expected:
                return fused, ()
            rows = self.arch.expert_slice(proj, self.model.config.moe_intermediate_size)
            shape = self.expected[fused][1:]
            return fused, (len(range(shape[0])[rows]), shape[1])
        return param, self.expected.get(param, ())

    def check(self, name: str, shape: tuple[int, ...], dtype, source: str) -> bool:
        """Validate one checkpoint tensor before reading its data. False if it is ignored."""
        target = self.target_shape(name)
        if target is None:
            return False
        param, expected = target
        if param not in self.expected:
            raise CheckpointError(
                f"{source}: tensor {name!r} does not belong to this model "
                f"({self.model.config.num_layers} layers, {self.model.config.num_experts} experts)"
            )
        if tuple(shape) != expected:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(shape)}, expected {list(expected)}"
            )
        if dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{source}: tensor {name!r} has dtype {dtype}, expected a float dtype "
                f"(bfloat16, float16 or float32) with shape {list(expected)}"
            )
        return True

    def add(self, name: str, tensor: torch.Tensor, source: str) -> None:
        """Place one (already checked) checkpoint tensor."""
        param = self.arch.checkpoint_name(name)
        value = tensor.to(device=self.device, dtype=self.dtype)
        expert = self.arch.per_expert_target(param)
        if expert is None:
            if param in self.sources:
                raise CheckpointError(
                    f"{source}: tensor {name!r} also appears in {self.sources[param]}"
                )
            self.tensors[param], self.sources[param] = value, source
            return
        fused, index, proj = expert
        if fused not in self.tensors:
            self.tensors[fused] = torch.empty(
                self.expected[fused], device=self.device, dtype=self.dtype
            )
            self.sources[fused] = source
        rows = self.arch.expert_slice(proj, self.model.config.moe_intermediate_size)
        self.tensors[fused][index][rows] = value
        self.expert_parts.setdefault(fused, set()).add((index, proj))

    def finish(self, where: str) -> torch.nn.Module:
        """Check nothing is missing and install the tensors into the model."""
        if self.model.config.tie_word_embeddings and "lm_head.weight" not in self.tensors:
            if "embed_tokens.weight" in self.tensors:
                self.tensors["lm_head.weight"] = self.tensors["embed_tokens.weight"]
        missing = [n for n in self.expected if n not in self.tensors]
        for fused, parts in self.expert_parts.items():
            projs = ("gate_proj", "up_proj") if fused.endswith("gate_up_proj") else ("down_proj",)
            want = {(e, p) for e in range(self.expected[fused][0]) for p in projs}
            if want - parts:
                e, p = min(want - parts)
                missing.append(f"{fused.rsplit('.', 1)[0]}.{e}.{p}.weight")
        if missing:
            shown = ", ".join(f"{n} (expected shape {list(self.shape_of(n))})" for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"{where}: missing tensors: {shown}{more}")
        self.model.load_state_dict(self.tensors, strict=True, assign=True)
        return self.model

    def shape_of(self, name: str) -> tuple[int, ...]:
        target = self.target_shape(name)
        return target[1] if target else ()


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


def _iter_file(path: Path, assembler: WeightAssembler, bar: tqdm) -> None:
    """Read one file tensor by tensor, each straight onto the assembler's device."""
    try:
        with safe_open(str(path), framework="pt", device=str(assembler.device)) as f:
            for name in f.keys():
                piece = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())
                if assembler.check(name, tuple(piece.get_shape()), dtype, str(path)):
                    assembler.add(name, f.get_tensor(name), str(path))
                bar.update(1)
    except SafetensorError as e:
        raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from e


def load_checkpoint(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> torch.nn.Module:
    """Load `model_dir` (config.json + safetensors) into a model on `device`."""
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    assembler = WeightAssembler(build_empty_model(cfg), device, dtype)
    files = checkpoint_files(model_dir)
    total = 0
    for path in files.values():
        try:
            with safe_open(str(path), framework="pt") as f:
                total += len(f.keys())
        except SafetensorError as e:
            raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from e
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress) as bar:
        for path in files.values():
            _iter_file(path, assembler, bar)
    return assembler.finish(str(model_dir)).eval()


def load_tensors(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    where: str = "state dict",
) -> torch.nn.Module:
    """Build a model from (HF name, tensor) pairs, e.g. an HF model's `state_dict()`: the same
    name mapping and checks as files. Tensors already on `device` in `dtype` are used as they
    are (no copy), so an HF model and ours can share one set of weights."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    assembler = WeightAssembler(build_empty_model(cfg), device, dtype)
    for name, t in items:
        if assembler.check(name, tuple(t.shape), t.dtype, where):
            assembler.add(name, t, where)
    return assembler.finish(where).eval()
