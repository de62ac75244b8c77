"""compressed-tensors checkpoints (llm-compressor's `quant_method: "compressed-tensors"`) read
into Sparrow's formats with the `compressed-tensors` package's own definitions: its
`QuantizationConfig` and schemes, the format each scheme is stored in, each format's
parameter names and its int32 unpacking.

- `pack-quantized` (int4 / int8 codes packed in int32 `weight_packed`, `weight_scale`,
  `weight_zero_point` where asymmetric, `weight_shape`; strategy group or channel) becomes
  group-affine in MLX's layout (`quant.affine`): compressed-tensors computes w = s * (q - z)
  with q the signed code, so the unsigned code c = q + 2^(b-1) gives w = s * c + bias,
  bias = -s * (z + 2^(b-1)). The group-affine kernels take groups of 32, 64 or 128: those
  load as stored; a larger group (or a channel: a group of the whole row) that is a multiple
  of one is split into groups of the largest such size, its scale and zero point repeated
  (exact); anything else (groups of 16, a row not a multiple of 32) is refused, naming the
  tensor and the group size.
- `float-quantized` (float8_e4m3fn `weight`, `weight_scale` per tensor, channel, group or
  block) becomes Sparrow's FP8 blocks (`quant.fp8`): a channel's scale is a block of one row
  by the whole input, a group's a block of one row by the group, a tensor's scale repeated on
  every row; exact.

Activation and KV-cache scales (`input_scale`, `k_scale`, ...) are not read: the reference
path runs float activations. Other formats (NVFP4, MXFP4, int8 `int-quantized`, sparse) are
refused, naming them. A module is compressed where its files hold its compressed parameters;
its scheme is the config group whose targets match the checkpoint's module name (an exact
name before a regex, before a class name: names are all there is without the model) and
that `ignore` leaves.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.compressors.pack_quantized.base import PACK_ZP_STRATS
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.utils.match import match_name
from compressed_tensors.utils.safetensors_load import get_quantization_config
from torch import nn

from sparrow.config import ConfigError, QuantConfig
from sparrow.distributed.shard import Cut
from sparrow.loader.formats import FP8, Checkpoint, CheckpointError, Header, Spec
from sparrow.quant.affine import QuantSpec, pack
from sparrow.quant.fp8 import Fp8Spec

SUPPORTED = ("pack-quantized", "float-quantized")
# Activation and KV-cache quantisation parameters: not read (float activations)
_ACTIVATIONS = {
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
    "output_zero_point",
    "output_global_scale",
    "k_scale",
    "v_scale",
    "q_scale",
}
# A module's own parameter that marks it compressed, by format
_MARK = {"pack-quantized": "weight_packed", "float-quantized": "weight_scale"}


@dataclass(frozen=True)
class Group:
    """One config group: its name, scheme and the format its modules are stored in."""

    name: str
    scheme: QuantizationScheme
    format: str


# Group sizes the group-affine kernels take (`quant.affine.QuantSpec`), largest first
KERNEL_GROUPS = (128, 64, 32)


@dataclass(frozen=True)
class Module:
    """One compressed module: its checkpoint name, group, stored tensors (parameter ->
    checkpoint name) and the Sparrow spec it becomes; `repeat`: groups of `spec` per stored
    scale (pack-quantized groups split to a size the kernels take)."""

    name: str
    group: Group
    stored: dict[str, str]
    spec: Spec
    repeat: int = 1


def read_config(model_dir: Path) -> tuple[QuantizationConfig, list[Group]]:
    """The checkpoint's compressed-tensors config (found as compressed-tensors finds it) and
    its groups; ConfigError for a config it does not validate or a format Sparrow does not
    read."""
    raw = get_quantization_config(str(model_dir / "config.json"))
    try:
        config = QuantizationConfig.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(
            f"{model_dir / 'config.json'}: quantization_config is not a compressed-tensors "
            f"config: {e}"
        ) from e
    groups = []
    for name, scheme in config.config_groups.items():
        fmt = scheme.format or (config.format if config.format != "mixed-precision" else None)
        fmt = str(fmt or infer_module_format(nn.Linear, scheme).value)
        if fmt not in SUPPORTED:
            raise ConfigError(
                f"{model_dir / 'config.json'}: compressed-tensors format {fmt!r} (config group "
                f"{name!r}) is not supported; Sparrow reads {', '.join(map(repr, SUPPORTED))}"
            )
        groups.append(Group(name, scheme, fmt))
    return config, groups


class CompressedTensors(Checkpoint):
    """A compressed-tensors checkpoint: each compressed module's tensors listed and read as
    Sparrow's (`X.weight` packed words + `X.scales` + `X.biases`, or FP8 `X.weight` +
    `X.weight_scale_inv`), the others as stored."""

    def __init__(self, model_dir: Path, block: QuantConfig):
        super().__init__(model_dir, block)
        self.config, self.groups = read_config(model_dir)
        self.modules: dict[str, Module] = {}  # Sparrow's tensor name -> its module
        self.tensors = self._plan()

    @property
    def label(self) -> str:
        used = sorted({m.group.format for m in self.modules.values()})
        return f"compressed-tensors ({', '.join(used) or 'nothing compressed'})"

    def _plan(self) -> dict[str, Header]:
        """The tensors as Sparrow reads them, in the files' order: a compressed module's where
        its first tensor is, activation scales left out."""
        marks = {
            name.rpartition(".")[0]
            for name in self.headers
            if name.rpartition(".")[2] in _MARK.values()
        }
        out: dict[str, Header] = {}
        done: set[str] = set()
        for name, header in self.headers.items():
            module, _, param = name.rpartition(".")
            if param in _ACTIVATIONS:
                continue
            if param == "weight_g_idx":
                raise CheckpointError(
                    f"{header[2]}: tensor {name!r}: weights in activation order (actorder "
                    f"'group') are not supported: Sparrow's groups are contiguous"
                )
            if module not in marks:
                out[name] = header
            elif module not in done:
                done.add(module)
                found = self._module(module, name, header[2])
                for local, shape, dtype in self._converted_headers(found):
                    out[f"{module}.{local}"] = (shape, dtype, header[2])
                    self.modules[f"{module}.{local}"] = found
        return out

    def _module(self, module: str, name: str, path: Path) -> Module:
        """The compressed module `module` (found at tensor `name`) with its group and spec;
        errors name the tensor."""
        group = self._group(module)
        if group is None:
            raise CheckpointError(
                f"{path}: tensor {name!r} is compressed, but no config group of config.json's "
                f"quantization_config targets module {module!r} (or `ignore` lists it)"
            )
        compressor = BaseCompressor.get_value_from_registry(group.format)
        params = compressor.compression_param_names(group.scheme)
        stored = {}
        for param in params:
            full = f"{module}.{param}"
            if full not in self.headers:
                raise CheckpointError(
                    f"{path}: module {module!r} ({group.format}, config group {group.name!r}) "
                    f"has no tensor {full!r}; expected {[f'{module}.{p}' for p in params]}"
                )
            stored[param] = full
        if group.format == "pack-quantized":
            return Module(module, group, stored, *self._affine_spec(group, stored))
        return Module(module, group, stored, self._fp8_spec(group, stored))

    def _group(self, module: str) -> Group | None:
        """The config group of a checkpoint module, as compressed-tensors matches targets:
        exact names first, then regexes, then class names (any module here)."""
        if any(match_name(module, ignore) for ignore in self.config.ignore or ()):
            return None
        for kind in ("exact", "regex", "class"):
            for group in self.groups:
                for target in group.scheme.targets:
                    regex = target.startswith("re:")
                    if kind == "exact" and not regex and match_name(module, target):
                        return group
                    if kind == "regex" and regex and match_name(module, target):
                        return group
                    if kind == "class" and target == "Linear":
                        return group
        return None

    def _affine_spec(self, group: Group, stored: dict[str, str]) -> tuple[QuantSpec, int]:
        """pack-quantized: the group-affine spec the module becomes and how many of its groups
        each stored scale covers, the tensors' shapes checked."""
        args = group.scheme.weights
        packed_name, scale_name = stored["weight_packed"], stored["weight_scale"]
        (rows, words), _, path = self.headers[packed_name]
        if args.type != "int" or args.strategy not in ("group", "channel"):
            raise CheckpointError(
                f"{path}: tensor {packed_name!r}: {args.type} weights of strategy "
                f"{args.strategy!r}; Sparrow reads int weights per group or per channel"
            )
        cols = words * 32 // args.num_bits  # exact for rows of whole words (`weight_shape`)
        source = cols if args.strategy == "channel" else args.group_size  # a channel: the row
        size = next((g for g in KERNEL_GROUPS if source % g == 0), None)
        if size is None or args.num_bits not in (4, 8):
            what = "channels" if args.strategy == "channel" else "groups"
            raise CheckpointError(
                f"{path}: tensor {packed_name!r}: {args.num_bits}-bit in {what} of {source} "
                f"cannot become Sparrow's group-affine format (4 or 8 bits; the kernels take "
                f"groups of {', '.join(map(str, sorted(KERNEL_GROUPS)))}, or a multiple of one)"
            )
        self._check(scale_name, (rows, cols // source))
        return QuantSpec(args.num_bits, size), source // size

    def _fp8_spec(self, group: Group, stored: dict[str, str]) -> Fp8Spec:
        """float-quantized: the FP8 blocks the module becomes, the tensors' shapes checked."""
        args = group.scheme.weights
        weight, scale_name = stored["weight"], stored["weight_scale"]
        (rows, cols), dtype, path = self.headers[weight]
        if dtype != FP8 or args.type != "float" or args.num_bits != 8 or not args.symmetric:
            raise CheckpointError(
                f"{path}: tensor {weight!r} ({dtype}): float-quantized weights are read as "
                f"symmetric float8_e4m3fn only"
            )
        if args.strategy in ("tensor", "channel"):  # one scale, or one per row: [N, 1] or [N]
            grid = (1,) if args.strategy == "tensor" else (rows, 1)
            if math.prod(self.headers[scale_name][0]) != math.prod(grid):
                self._check(scale_name, grid)
            return Fp8Spec(1, None)
        if args.strategy == "group":
            spec = Fp8Spec(1, args.group_size)
        elif args.strategy == "block":
            spec = Fp8Spec(*args.block_structure)
        else:
            raise CheckpointError(
                f"{path}: tensor {weight!r}: FP8 strategy {args.strategy!r} is not supported"
            )
        self._check(scale_name, spec.grid(rows, cols))
        return spec

    def _check(self, name: str, expected: tuple[int, ...]) -> None:
        shape, _, path = self.headers[name]
        if tuple(shape) != tuple(expected):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(shape)}, expected {list(expected)}"
            )

    def _converted_headers(self, module: Module) -> list[tuple[str, tuple[int, ...], Any]]:
        """(local name, shape, dtype) of what the module becomes."""
        if module.group.format == "pack-quantized":
            scale_shape, scale_dtype, _ = self.headers[module.stored["weight_scale"]]
            rows, groups = scale_shape[0], scale_shape[1] * module.repeat
            spec = module.spec
            words = groups * spec.group_size // spec.per_word
            return [
                ("weight", (rows, words), torch.int32),
                ("scales", (rows, groups), scale_dtype),
                ("biases", (rows, groups), scale_dtype),
            ]
        (rows, cols), dtype, _ = self.headers[module.stored["weight"]]
        grid = module.spec.grid(rows, cols)
        return [("weight", (rows, cols), dtype), ("weight_scale_inv", grid, torch.float32)]

    def stored_spec(self, name: str, shape: tuple[int, ...], dtype, path: Path) -> Spec | None:
        module = self.modules.get(name)
        if module is not None:
            return module.spec
        if dtype == FP8:
            raise CheckpointError(
                f"{path}: tensor {name!r} is float8_e4m3fn, but its weight_scale is missing"
            )
        return None

    @contextlib.contextmanager
    def reader(self, device: torch.device) -> Iterator[Callable[[str, Cut | None], torch.Tensor]]:
        with super().reader(device) as read_stored:
            pending: dict[str, torch.Tensor] = {}  # converted, not yet read

            def read(name: str, cut: Cut | None = None) -> torch.Tensor:
                module = self.modules.get(name)
                if module is None:
                    return read_stored(name, cut)
                if name not in pending:
                    stored = {p: read_stored(n) for p, n in module.stored.items()}
                    converted = convert(module, stored)
                    pending.update({f"{module.name}.{k}": v for k, v in converted.items()})
                return pending.pop(name)

            yield read


def convert(module: Module, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One compressed module's tensors (by parameter name) -> Sparrow's (by local name)."""
    args = module.group.scheme.weights
    if module.group.format == "float-quantized":
        weight, scale = stored["weight"], stored["weight_scale"].float()
        if args.strategy == "tensor":
            scale = scale.reshape(1, 1).expand(weight.shape[0], 1)
        return {
            "weight": weight,
            "weight_scale_inv": scale.reshape(module.spec.grid(*weight.shape)),
        }
    return _to_affine(module, stored)


def _to_affine(module: Module, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """pack-quantized -> group-affine (MLX layout): the codes unpacked by compressed-tensors'
    own `unpack_from_int32`, as its `PackedQuantizationCompressor.decompress` unpacks them."""
    args, spec = module.group.scheme.weights, module.spec
    scale = stored["weight_scale"]
    shape = torch.Size(int(d) for d in stored["weight_shape"].tolist())
    source = spec.group_size * module.repeat
    expected = (scale.shape[0], scale.shape[1] * source)
    if tuple(shape) != expected:
        raise CheckpointError(
            f"tensor {module.stored['weight_shape']!r} says {list(shape)}, but the scales "
            f"give {list(expected)} (groups of {source})"
        )
    codes = unpack_from_int32(stored["weight_packed"], args.num_bits, shape)
    offset = 1 << (args.num_bits - 1)
    zero = torch.zeros((), device=scale.device)
    if not args.symmetric and args.strategy in PACK_ZP_STRATS:
        zp_shape = torch.Size((*shape[:-1], scale.shape[-1]))
        zero = unpack_from_int32(stored["weight_zero_point"], args.num_bits, zp_shape, 0)
    biases = -(scale.float() * (zero.float() + offset))
    return {
        "weight": pack(codes.to(torch.int32) + offset, spec.bits),
        "scales": scale.repeat_interleave(module.repeat, -1),
        "biases": biases.repeat_interleave(module.repeat, -1),
    }
