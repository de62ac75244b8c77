"""Load HF- or MLX-format weights into a model, tensor by tensor, straight onto the device.

Sources are safetensors checkpoints (one file, or shards listed by
`model.safetensors.index.json`) or an in-memory state dict. Both go through `WeightAssembler`,
which maps names, checks every shape and dtype against the model, fills fused expert tensors
from per-expert or per-projection pieces, quantises float weights on load when the model is
quantised, and reports what is missing. Errors name the file, the tensor and the expected
shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from sparrow.config import QuantConfig
from sparrow.distributed.shard import Cut, Shard, ShardPlan, cut_shape, pieces, shard_args, take
from sparrow.layers.linear import fuse_all
from sparrow.layers.quantized import companion, quantize_modules
from sparrow.loader.writer import INDEX_FILE
from sparrow.models import get_architecture, load_model_args
from sparrow.models.common import text_model_name
from sparrow.models.interface import Architecture, ModelArgs
from sparrow.quant.affine import QuantSpec, quantize

_FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
_PACKED_DTYPES = {torch.int32, torch.uint32}
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
}


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, or does not match the model's config."""


def build_empty_model(cfg: ModelArgs, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model with parameters on the meta device (no memory) for the loader to fill;
    quantised modules where `cfg.quantization` says so."""
    with torch.device("meta"):
        model = get_architecture(cfg.architecture).Model(cfg)
        if cfg.quantization is not None:
            quantize_modules(model, cfg.quantization, dtype)
    return model


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes."""

    param: str
    index: tuple  # into the parameter: () whole, (e, rows) one expert, (slice(None), rows) all
    quantize: QuantSpec | None  # a float tensor to quantise into a packed parameter
    cut: Cut | None = None  # the part of the tensor this rank reads (tensor parallelism)


class WeightAssembler:
    """Collects checkpoint tensors into a model's parameters on `device` in `dtype`."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device | str,
        dtype: torch.dtype,
        mlx_layout: bool = False,
        shard: tuple[Shard, ShardPlan] | None = None,
    ):
        """shard: (this rank's share, the full model's shard plan): `model` is the rank's
        model and each tensor is read in the part the rank keeps (`distributed.shard`)."""
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.mlx_layout = mlx_layout
        self.shard = shard
        self.arch = get_architecture(model.config.architecture)
        self.params = dict(model.named_parameters())
        self.specs = {  # packed parameter -> its quantisation
            f"{path}.{name}" if path else name: module.spec
            for path, module in model.named_modules()
            if hasattr(module, "logical_shapes")
            for name in module.logical_shapes
        }
        self.tensors: dict[str, torch.Tensor] = {}
        self.filled: dict[str, torch.Tensor] = {}  # bool coverage over the indexed dims
        self.sources: dict[str, str] = {}

    def target(
        self, name: str, src_shape: tuple[int, ...], src_dtype, source: str
    ) -> Target | None:
        """Validate one checkpoint tensor before reading its data. None if it is ignored."""
        param = self.arch.checkpoint_name(name)
        if param is None:
            return None
        cut = None
        if self.shard is not None:
            if self.mlx_layout or src_dtype not in _FLOAT_DTYPES:
                raise CheckpointError(
                    f"{source}: tensor {name!r}: tensor parallelism loads "
                    f"float checkpoints in HF layout (quantise on load)"
                )
            cut = pieces(param, self.shard[1], self.shard[0])
            src_shape = cut_shape(tuple(src_shape), cut)
        index: tuple = ()
        expert = self.arch.expert_target(param)
        if expert is not None:
            fused, e, proj, kind = expert
            held = self.model.config.expert_range if self.shard else None
            if held is not None and e is not None:  # one expert's tensor: this rank's?
                if not held[0] <= e < held[0] + held[1]:
                    return None
                e -= held[0]
            param = fused if kind == "weight" else companion(fused, kind)
            if param in self.params:  # a piece of a fused [.., 2I, hidden] or down tensor
                shape = self.params[param].shape
                rows = self.arch.expert_slice(proj, shape[-2] // 2)
                index = (rows,) if len(shape) == 2 else (slice(None) if e is None else e, rows)
        if param not in self.params:
            raise CheckpointError(
                f"{source}: tensor {name!r} does not belong to this model "
                f"({self.model.config.num_layers} layers, {self.model.config.num_experts} "
                f"experts, quantised: {self.model.config.quantization is not None})"
            )
        shape = tuple(torch.empty(self.params[param].shape, device="meta")[index].shape)
        spec = self.specs.get(param)
        float_src = src_dtype in _FLOAT_DTYPES
        if spec is not None and float_src:  # quantise on load
            shape = (*shape[:-1], shape[-1] * spec.per_word)
        if self.mlx_layout and self.arch.is_mlx_conv(param, tuple(src_shape)):
            shape = (shape[0], shape[2], shape[1])
        if tuple(src_shape) != shape:
            # a float weight quantised on load has no stored grid to name
            grid = None if spec is not None and float_src else self._grid(param)
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(src_shape)}, expected {list(shape)}"
                + (f" ({grid.bits}-bit, group_size {grid.group_size})" if grid else "")
            )
        wants_packed = spec is not None and src_dtype in _PACKED_DTYPES
        if not (float_src or wants_packed):
            kind = "uint32/int32 packed words" if spec is not None else "a float dtype"
            raise CheckpointError(
                f"{source}: tensor {name!r} has dtype {src_dtype}, expected {kind} "
                f"with shape {list(shape)}"
            )
        return Target(param, index, spec if float_src else None, cut)

    def _grid(self, param: str) -> QuantSpec | None:
        """The quantisation of a packed parameter or of its scales / biases; None for float."""
        for kind in ("scales", "biases"):
            if param.endswith("." + kind):
                return self.specs.get(param.removesuffix(kind) + "weight")
            if param.endswith("_" + kind):
                return self.specs.get(param.removesuffix("_" + kind))
        return self.specs.get(param)

    def add(self, target: Target, tensor: torch.Tensor, source: str) -> None:
        """Place one checked checkpoint tensor."""
        tensor = tensor.to(self.device)
        if self.mlx_layout:
            tensor = self.arch.from_mlx(target.param, tensor)
        if target.quantize is not None:
            packed, scales, biases = quantize(tensor, target.quantize, self.dtype)
            self._put(target.param, target.index, packed, source)
            self._put(companion(target.param, "scales"), target.index, scales, source)
            self._put(companion(target.param, "biases"), target.index, biases, source)
        else:
            self._put(target.param, target.index, tensor, source)

    def _put(self, param: str, index: tuple, value: torch.Tensor, source: str) -> None:
        dest = self.params[param]
        dtype = torch.int32 if dest.dtype == torch.int32 else self.dtype
        value = value.view(torch.int32) if value.dtype == torch.uint32 else value.to(dtype)
        if not index:
            if param in self.sources:
                raise CheckpointError(
                    f"{source}: {param} was already loaded from {self.sources[param]}"
                )
            self.tensors[param], self.sources[param] = value, source
            self.filled[param] = torch.ones((), dtype=torch.bool)
            return
        if param not in self.tensors:
            self.tensors[param] = torch.empty(dest.shape, device=self.device, dtype=dtype)
            self.filled[param] = torch.zeros(dest.shape[:2], dtype=torch.bool)
            self.sources[param] = source
        self.tensors[param][index] = value
        self.filled[param][index] = True

    def finish(self, where: str) -> torch.nn.Module:
        """Check that every parameter is complete and install them into the model."""
        if self.model.config.tie_word_embeddings and "lm_head.weight" not in self.tensors:
            for kind in ("weight", "scales", "biases"):
                if f"embed_tokens.{kind}" in self.tensors and f"lm_head.{kind}" in self.params:
                    self.tensors[f"lm_head.{kind}"] = self.tensors[f"embed_tokens.{kind}"]
                    self.filled[f"lm_head.{kind}"] = self.filled[f"embed_tokens.{kind}"]
        missing = [
            self._describe_missing(n)
            for n in self.params
            if n not in self.filled or not bool(self.filled[n].all())
        ]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"{where}: missing tensors: {', '.join(missing[:5])}{more}")
        self.model.load_state_dict(self.tensors, strict=True, assign=True)
        fuse_all(self.model)  # one matmul per group of projections
        return self.model

    def _describe_missing(self, param: str) -> str:
        shape = list(self.params[param].shape)
        if param in self.filled and self.filled[param].dim() == 2:
            missing = [int(i) for i in (~self.filled[param]).nonzero()[0]]
            dense = len(shape) == 2  # rows of a fused gate_up, else (expert, row)
            row, inter = missing[0 if dense else 1], shape[-2] // 2
            proj = "down_proj" if "down_proj" in param else ("gate_proj", "up_proj")[row >= inter]
            where = proj if dense else f"expert {missing[0]}, {proj}"
            return f"{param} ({where}; full shape {shape})"
        return f"{param} (expected shape {shape})"


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


def _headers(files: Iterable[Path]) -> dict[Path, dict[str, tuple[tuple[int, ...], object]]]:
    """name -> (shape, dtype) for every tensor of every file, from the headers alone."""
    out = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                out[path] = {}
                for name in f.keys():
                    piece = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())
                    out[path][name] = (tuple(piece.get_shape()), dtype)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from e
    return out


def stored_quantization(
    cfg: ModelArgs, headers: Mapping[Path, Mapping[str, tuple[tuple[int, ...], object]]]
) -> QuantConfig:
    """How a quantised checkpoint stores each module (`cfg.quantization`: the block its
    config.json declares; `headers`: its tensors' shapes and dtypes), as an entry per module
    under our module paths: the spec the block gives it (its own entry, else the
    default) where the files hold packed words, None where they hold a float matrix (an entry
    `false`, or none: mlx-lm leaves out the modules a `quant_predicate` keeps in float).
    Errors name the file and the tensor: a module the block declares quantised stored in
    float (with the packed shape expected) or the reverse, pieces of one of our modules (gate
    and up of a fused projection, the routed experts' projections) stored at different
    widths. Shapes are checked as the tensors load (`WeightAssembler.target`), missing
    scales and biases when they are all read (`WeightAssembler.finish`)."""
    arch, block = get_architecture(cfg.architecture), cfg.quantization
    tensors = {n: (shape, dt, path) for path, t in headers.items() for n, (shape, dt) in t.items()}
    layout: dict[str, tuple[QuantSpec | None, str]] = {}  # module -> (spec, a tensor of it)
    for name, (shape, src_dtype, path) in tensors.items():
        owner = _owner(arch, name)
        packed = src_dtype in _PACKED_DTYPES
        if owner is None or owner[1] != "weight" or not (packed or len(shape) >= 2):
            continue
        spec = _stored_spec(block, name, shape, packed, path)
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
    overrides = tuple((module, spec) for module, (spec, _) in layout.items())
    return QuantConfig(block.bits, block.group_size, overrides)


def _owner(arch: Architecture, name: str) -> tuple[str, str] | None:
    """(our module, kind: weight / scales / biases / another parameter's name) a checkpoint
    tensor fills; None for tensors the text model does not read."""
    param = arch.checkpoint_name(name)
    if param is None:
        return None
    expert = arch.expert_target(param)
    if expert is None:
        module, _, kind = param.rpartition(".")
        return module, kind
    fused, _, _, kind = expert
    if fused.endswith(".weight"):  # a linear layer's fused gate_up (`mlp.gate_up_proj.weight`)
        return fused.removesuffix(".weight"), kind
    return fused.rpartition(".")[0], kind  # the routed experts (`mlp.experts.down_proj`)


def _stored_spec(
    block: QuantConfig,
    name: str,
    shape: tuple[int, ...],
    packed: bool,
    path: Path,
) -> QuantSpec | None:
    """The spec of the checkpoint module whose `.weight` is `name`, checked against what the
    block declares for it (matched as `QuantConfig.spec_for` matches)."""
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


def _width(spec: QuantSpec | None) -> str:
    if spec is None:
        return "in float"
    return f"at {spec.bits} bits in groups of {spec.group_size}"


def rank_args(cfg: ModelArgs, shard: Shard) -> ModelArgs:
    """The config of one rank's model under tensor (or expert) parallelism."""
    plan = get_architecture(cfg.architecture).shard_plan(cfg, shard.experts)
    return shard_args(cfg, plan, shard)


def load_checkpoint(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantize: QuantConfig | None = None,
    progress: bool = True,
    shard: Shard | None = None,
) -> torch.nn.Module:
    """Load `model_dir` (config.json + safetensors, HF or MLX layout) into a model on
    `device`. A float checkpoint is quantised on load when `quantize` is given; a quantised
    checkpoint loads as stored, each module at the width its files hold
    (`stored_quantization`). `shard`: one rank's model under tensor parallelism, each
    tensor read in the part the rank keeps."""
    model_dir = Path(model_dir)
    cfg = load_model_args(model_dir)
    headers = _headers(checkpoint_files(model_dir).values())
    arch = get_architecture(cfg.architecture)
    if cfg.quantization is not None:  # stored quantised: every module as the files hold it
        cfg = cfg.replace(quantization=stored_quantization(cfg, headers))
    elif quantize is not None:
        cfg = cfg.replace(quantization=quantize)
    plan = None
    if shard is not None:
        plan = arch.shard_plan(cfg, shard.experts)
        cfg = shard_args(cfg, plan, shard)
    mlx = any(
        arch.is_mlx_conv(arch.checkpoint_name(n) or "", shape)
        for tensors in headers.values()
        for n, (shape, _) in tensors.items()
    )
    assembler = WeightAssembler(
        build_empty_model(cfg, dtype),
        device,
        dtype,
        mlx_layout=mlx,
        shard=(shard, plan) if shard is not None else None,
    )
    total = sum(len(t) for t in headers.values())
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress) as bar:
        for path, tensors in headers.items():
            # Each tensor is read straight onto the target device, one at a time.
            with safe_open(str(path), framework="pt", device=str(assembler.device)) as f:
                for name, (shape, src_dtype) in tensors.items():
                    target = assembler.target(name, shape, src_dtype, str(path))
                    if target is not None:
                        tensor = (
                            take(f.get_slice(name), len(shape), target.cut)
                            if target.cut is not None
                            else f.get_tensor(name)
                        )
                        assembler.add(target, tensor, str(path))
                    bar.update(1)
    return assembler.finish(str(model_dir)).eval()


def load_tensors(
    cfg: ModelArgs,
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    where: str = "state dict",
    quantize: QuantConfig | None = None,
) -> torch.nn.Module:
    """Build a model from (HF name, tensor) pairs, e.g. an HF model's `state_dict()`: the same
    name mapping and checks as files. Tensors already on `device` in `dtype` are used as they
    are (no copy), so an HF model and ours can share one set of weights. With `quantize`,
    float tensors are quantised as they arrive."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    if quantize is not None:
        cfg = cfg.replace(quantization=quantize)
    assembler = WeightAssembler(build_empty_model(cfg, dtype), device, dtype)
    for name, t in items:
        target = assembler.target(name, tuple(t.shape), t.dtype, where)
        if target is not None:
            assembler.add(target, t, where)
    return assembler.finish(where).eval()
