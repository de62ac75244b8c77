"""Load HF- or MLX-format weights into a model, tensor by tensor, straight onto the device.

Sources are safetensors checkpoints (one file, or shards listed by
`model.safetensors.index.json`; float, MLX group-affine, HF FP8 blocks or compressed-tensors:
`formats`) or an in-memory state dict. Both go through `WeightAssembler`, which maps names,
checks every shape and dtype against the model, fills fused expert tensors from per-expert
or per-projection pieces, quantises float weights on load when the model is quantised
(group-affine or FP8 blocks), and reports what is missing. Errors name the file, the tensor
and the expected shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from sparrow.config import QuantConfig
from sparrow.distributed.shard import Cut, Shard, ShardPlan, cut_shape, pieces, shard_args
from sparrow.layers.fp8 import Fp8Experts
from sparrow.layers.linear import fuse_all
from sparrow.layers.quantized import companion, quantize_modules
from sparrow.loader.formats import (  # noqa: F401 (CheckpointError, checkpoint_files: re-exported)
    FLOAT_DTYPES,
    PACKED_DTYPES,
    Checkpoint,
    CheckpointError,
    checkpoint_files,
    describe,
    stored_quantization,
)
from sparrow.models import get_architecture, load_model_args
from sparrow.models.interface import ModelArgs
from sparrow.quant import fp8
from sparrow.quant.affine import QuantSpec, quantize
from sparrow.quant.fp8 import FP8, Fp8Spec, scale_name


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
    # a float tensor to quantise into a packed (group-affine) or FP8 parameter
    quantize: QuantSpec | Fp8Spec | None
    cut: Cut | None = None  # the part of the tensor this rank reads (tensor parallelism)
    scale_index: tuple = ()  # FP8 on load: the piece's rows of `weight_scale_inv`


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
        self.fp8 = {  # FP8 parameter -> (its spec, segments)
            f"{path}.{name}" if path else name: (module.spec, segments)
            for path, module in model.named_modules()
            for name, segments in getattr(module, "fp8_weights", {}).items()
        }
        self.fp8_scales = {scale_name(p) for p in self.fp8}  # kept float32
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
            if self.mlx_layout or src_dtype not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"{source}: tensor {name!r}: tensor parallelism loads "
                    f"float checkpoints in HF layout (quantise on load)"
                )
            cut = pieces(param, self.shard[1], self.shard[0])
            src_shape = cut_shape(tuple(src_shape), cut)
        index, scale_index = (), ()
        expert = self.arch.expert_target(param)
        if expert is not None:
            fused, e, proj, kind = expert
            held = self.model.config.expert_range if self.shard else None
            if held is not None and e is not None:  # one expert's tensor: this rank's?
                if not held[0] <= e < held[0] + held[1]:
                    return None
                e -= held[0]
            if kind == "weight":
                param = fused
            else:
                param = scale_name(fused) if kind == "weight_scale_inv" else companion(fused, kind)
            if param in self.params:  # a piece of a fused [.., 2I, hidden] or down tensor
                index = self._piece(param, e, proj)
                if param in self.fp8:
                    scale_index = self._piece(scale_name(param), e, proj)
        if param not in self.params:
            raise CheckpointError(
                f"{source}: tensor {name!r} does not belong to this model "
                f"({self.model.config.num_layers} layers, {self.model.config.num_experts} "
                f"experts, quantised: {self.model.config.quantization is not None})"
            )
        shape = tuple(torch.empty(self.params[param].shape, device="meta")[index].shape)
        spec = self.specs.get(param)
        float_src = src_dtype in FLOAT_DTYPES
        if param in self.fp8:
            stored = Target(param, index, None, cut, scale_index)
            return self._fp8_target(name, stored, shape, src_shape, src_dtype, source)
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
        wants_packed = spec is not None and src_dtype in PACKED_DTYPES
        if not (float_src or wants_packed):
            kind = "uint32/int32 packed words" if spec is not None else "a float dtype"
            raise CheckpointError(
                f"{source}: tensor {name!r} has dtype {src_dtype}, expected {kind} "
                f"with shape {list(shape)}"
            )
        return Target(param, index, spec if float_src else None, cut)

    def _piece(self, param: str, e: int | None, proj: str) -> tuple:
        """The index of one projection's piece in a fused [.., 2I, hidden] or down parameter
        (or in its scales: the halves of a gate_up hold their own rows)."""
        shape = self.params[param].shape
        rows = self.arch.expert_slice(proj, shape[-2] // 2)
        return (rows,) if len(shape) == 2 else (slice(None) if e is None else e, rows)

    def _fp8_target(
        self, name: str, stored: Target, shape: tuple, src_shape: tuple, src_dtype, source: str
    ) -> Target:
        """An FP8 parameter's tensor: FP8 codes as stored, or float to quantise on load."""
        if tuple(src_shape) != shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(src_shape)}, expected {list(shape)}"
            )
        if src_dtype == FP8:
            return stored
        if src_dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{source}: tensor {name!r} has dtype {src_dtype}, expected float8_e4m3fn "
                f"(or a float dtype to quantise) with shape {list(shape)}"
            )
        return replace(stored, quantize=self.fp8[stored.param][0])

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
        if isinstance(target.quantize, Fp8Spec):  # a whole fused gate_up holds two segments
            segments = self.fp8[target.param][1] if not target.index else 1
            codes, scales = fp8.quantize(tensor, target.quantize, segments)
            self._put(target.param, target.index, codes, source)
            self._put(scale_name(target.param), target.scale_index, scales, source)
        elif target.quantize is not None:
            packed, scales, biases = quantize(tensor, target.quantize, self.dtype)
            self._put(target.param, target.index, packed, source)
            self._put(companion(target.param, "scales"), target.index, scales, source)
            self._put(companion(target.param, "biases"), target.index, biases, source)
        else:
            self._put(target.param, target.index, tensor, source)

    def _put(self, param: str, index: tuple, value: torch.Tensor, source: str) -> None:
        dest = self.params[param]
        keep = dest.dtype in (torch.int32, FP8) or param in self.fp8_scales
        dtype = dest.dtype if keep else self.dtype
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
        if any(isinstance(m, Fp8Experts) for m in self.model.modules()):
            self.model.cuda_graphs = False  # FP8 experts read the routing on the host
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


def open_checkpoint(model_dir: Path, block: QuantConfig | None) -> Checkpoint:
    """The checkpoint in `model_dir` as the format its config.json declares (`block`) reads
    (compressed-tensors: imported only for its checkpoints, the package takes seconds)."""
    if block is not None and block.method == "compressed-tensors":
        from sparrow.loader.compressed_tensors import CompressedTensors

        return CompressedTensors(model_dir, block)
    return Checkpoint(model_dir, block)


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
    checkpoint (MLX, HF FP8, compressed-tensors: `formats`) loads as stored, each module in
    the format its files hold (`stored_quantization`). `shard`: one rank's model under
    tensor parallelism, each tensor read in the part the rank keeps. The model's
    `weight_format` says what its weights are (`formats.describe`)."""
    model_dir = Path(model_dir)
    cfg = load_model_args(model_dir)
    ckpt = open_checkpoint(model_dir, cfg.quantization)
    arch = get_architecture(cfg.architecture)
    on_load = cfg.quantization is None and quantize is not None
    if cfg.quantization is not None:  # stored quantised: every module as the files hold it
        cfg = cfg.replace(quantization=stored_quantization(cfg, ckpt))
    elif quantize is not None:
        cfg = cfg.replace(quantization=quantize)
    plan = None
    if shard is not None:
        plan = arch.shard_plan(cfg, shard.experts)
        cfg = shard_args(cfg, plan, shard)
    mlx = any(
        arch.is_mlx_conv(arch.checkpoint_name(n) or "", shape)
        for n, (shape, _, _) in ckpt.tensors.items()
    )
    assembler = WeightAssembler(
        build_empty_model(cfg, dtype),
        device,
        dtype,
        mlx_layout=mlx,
        shard=(shard, plan) if shard is not None else None,
    )
    total = len(ckpt.tensors)
    with (
        tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress) as bar,
        ckpt.reader(assembler.device) as read,  # each tensor straight onto the device
    ):
        for name, (shape, src_dtype, path) in ckpt.tensors.items():
            target = assembler.target(name, shape, src_dtype, str(path))
            if target is not None:
                assembler.add(target, read(name, target.cut), str(path))
            bar.update(1)
    model = assembler.finish(str(model_dir)).eval()
    model.weight_format = describe(model, ckpt.label, on_load)
    return model


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
