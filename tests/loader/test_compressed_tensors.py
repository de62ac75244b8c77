"""compressed-tensors checkpoints (llm-compressor's `quant_method: "compressed-tensors"`) load
in Sparrow: `pack-quantized` int4 (symmetric or with zero points, groups of 32 / 64 / 128, or
per channel: split into groups of 128) as group-affine 4-bit, `float-quantized` FP8 (per
tensor, per channel, or in blocks that the matrices do not fill) as FP8 blocks, for both
families, and give the logits and greedy tokens of HF 5.17 on
compressed-tensors' own decompression of the same files. The files are written as
llm-compressor writes them: Linear modules (experts one per expert, as llm-compressor
linearises them) compressed by the format's compressor from the scheme's min-max qparams
(`calculate_qparams`), config.json's block by `ModelCompressor.update_config`. Bad files fail
naming the tensor, the group size or the format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.model_compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from compressed_tensors.utils.match import match_name

from sparrow.assets import default_checkpoint
from sparrow.config import ConfigError
from sparrow.layers.fp8 import Fp8Experts, Fp8Linear
from sparrow.layers.quantized import QuantizedExperts, QuantizedLinear
from sparrow.loader.weights import CheckpointError, load_checkpoint
from sparrow.quant.affine import QuantSpec
from sparrow.quant.fp8 import Fp8Spec
from tests.loader.quantized_checkpoints import (
    FAMILIES,
    Reference,
    assert_matches_hf,
    config_of,
    float_release,
    per_expert,
    read_tensors,
    write,
)

pytestmark = pytest.mark.usefixtures("hf_gdn_in_pytorch")

# llm-compressor's usual ignore lists: the lm_head, routers, the shared expert's gate, GDN's a/b
IGNORE = [
    "lm_head",
    "re:.*lm_head$",
    "re:.*mlp\\.gate$",
    "re:.*block_sparse_moe\\.gate$",
    "re:.*shared_expert_gate$",
    "re:.*in_proj_[ab]$",
]


def int_scheme(group_size: int, symmetric: bool) -> QuantizationScheme:
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def _qparams(w: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's min-max observer on a weight, by the strategy's granularity."""
    if args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        n, k = -(-w.shape[0] // bn), -(-w.shape[1] // bk)
        padded = torch.zeros(n * bn, k * bk).index_put_(
            (torch.arange(w.shape[0])[:, None], torch.arange(w.shape[1])), w
        )
        blocks = padded.unflatten(1, (k, bk)).unflatten(0, (n, bn))
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:  # one scale for the tensor, stored [1]
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    return calculate_qparams(lo, hi, args)


def _compressed(module: str, t: torch.Tensor, ignore: list[str]) -> bool:
    """A Linear module llm-compressor quantises: a matrix, not the embedding, not ignored."""
    return (
        t.dim() == 2
        and "embed_tokens" not in module
        and not any(match_name(module, i) for i in ignore)
    )


def write_compressed(src: Path, dst: Path, scheme: QuantizationScheme, fmt: str) -> Path:
    """`src` (a float release, experts split per expert) compressed as llm-compressor saves
    it with `scheme` in format `fmt`."""
    compressor = BaseCompressor.get_value_from_registry(fmt)
    out = {}
    for name, t in per_expert(read_tensors(src)).items():
        module, _, param = name.rpartition(".")
        if param != "weight" or not _compressed(module, t, IGNORE):
            out[name] = t
            continue
        scale, zero = _qparams(t, scheme.weights)
        state = {"weight": t, "weight_scale": scale, "weight_zero_point": zero}
        out |= {f"{module}.{k}": v for k, v in compressor.compress(state, scheme).items()}
    write(dst, config_of(src), out, src)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        ignore=IGNORE,
        quantization_status="compressed",
    )
    ModelCompressor(quantization_config=config).update_config(str(dst))
    return dst


def decompressed(src: Path, dst: Path) -> Path:
    """A compressed-tensors checkpoint decompressed by its format's own `decompress`, module
    by module, without the quantization block: what HF runs as the reference. The scales go
    in as float32, so the weights come out exact (`decompress` computes in the scales'
    dtype: bf16 scales would round every weight to bf16)."""
    config = config_of(src)
    block = QuantizationConfig.model_validate(config.pop("quantization_config"))
    scheme = block.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(block.format)
    params = compressor.compression_param_names(scheme)
    tensors = read_tensors(src)
    out = {}
    for name in list(tensors):
        module, _, param = name.rpartition(".")
        if param != params[0] or f"{module}.weight_scale" not in tensors:
            continue
        state = {p: tensors.pop(f"{module}.{p}") for p in params}
        state["weight_scale"] = state["weight_scale"].float()
        out[f"{module}.weight"] = compressor.decompress(state, scheme)["weight"].float()
    return write(dst, config, tensors | out, src)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    return {family: float_release(family, root) for family in FAMILIES}


INT4 = {
    "qwen-asym-32": ("qwen3_5_moe", int_scheme(32, symmetric=False), QuantSpec(4, 32)),
    "qwen-sym-64": ("qwen3_5_moe", int_scheme(64, symmetric=True), QuantSpec(4, 64)),
    "m3-asym-32": ("minimax_m3", int_scheme(32, symmetric=False), QuantSpec(4, 32)),
}


@pytest.mark.parametrize("case", list(INT4))
def test_int4_becomes_group_affine_and_matches_hf(releases, tmp_path, case):
    family, scheme, spec = INT4[case]
    path = write_compressed(releases[family], tmp_path / "ct", scheme, "pack-quantized")
    assert config_of(path)["quantization_config"]["format"] == "pack-quantized"
    model = load_checkpoint(path, progress=False)
    experts = model.layers[1].mlp.experts
    assert isinstance(experts, QuantizedExperts) and experts.spec == spec
    assert model.weight_format["checkpoint"] == "compressed-tensors (pack-quantized)"
    assert "lm_head" in model.weight_format["float"]
    assert_matches_hf(path, Reference(decompressed(path, tmp_path / "reference")))


CHANNEL = QuantizationScheme(
    targets=["Linear"],
    weights=QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="channel"),
)
DEFAULT_INT4 = {  # llm-compressor's W4A16 presets (groups of 128), and a scale per row
    "w4a16": preset_name_to_scheme("W4A16", ["Linear"]),
    "w4a16-asym": preset_name_to_scheme("W4A16_ASYM", ["Linear"]),
    "channel-asym": CHANNEL,
}


@pytest.mark.parametrize("case", list(DEFAULT_INT4))
def test_default_model_int4(tmp_path, case):
    """The built-in model (128 wide): a channel of a 256-wide row becomes two groups of 128."""
    scheme = DEFAULT_INT4[case]
    path = write_compressed(default_checkpoint(), tmp_path / "ct", scheme, "pack-quantized")
    layers = load_checkpoint(path, progress=False).layers
    for proj in (layers[3].self_attn.o_proj, layers[0].linear_attn.out_proj):
        assert isinstance(proj, QuantizedLinear) and proj.spec == QuantSpec(4, 128)
    assert_matches_hf(path, Reference(decompressed(path, tmp_path / "reference")))


# FP8 weights, activations dynamic per token (as FP8_DYNAMIC), one weight scale per tensor
PER_TENSOR = QuantizationScheme(
    targets=["Linear"],
    weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor"),
    input_activations=QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True
    ),
)
FP8 = {  # FP8_DYNAMIC: per channel; FP8_BLOCK: blocks of 128 over 64-wide matrices
    "qwen-channel": ("qwen3_5_moe", preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])),
    "m3-block": ("minimax_m3", preset_name_to_scheme("FP8_BLOCK", ["Linear"])),
    "m3-tensor": ("minimax_m3", PER_TENSOR),
}
FP8_SPECS = {"qwen-channel": Fp8Spec(1, None), "m3-block": Fp8Spec(128, 128)}


@pytest.mark.parametrize("case", list(FP8))
def test_fp8_becomes_fp8_blocks_and_matches_hf(releases, tmp_path, case):
    family, scheme = FP8[case]
    spec = FP8_SPECS.get(case, Fp8Spec(1, None))  # a tensor's scale: repeated on every row
    path = write_compressed(releases[family], tmp_path / "ct", scheme, "float-quantized")
    model = load_checkpoint(path, progress=False)
    experts = model.layers[1].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.spec == spec
    assert isinstance(model.layers[3].self_attn.o_proj, Fp8Linear)
    assert_matches_hf(path, Reference(decompressed(path, tmp_path / "reference")))


@pytest.fixture
def qwen_int4(releases, tmp_path):
    scheme = int_scheme(32, symmetric=False)
    return write_compressed(releases["qwen3_5_moe"], tmp_path / "ct", scheme, "pack-quantized")


def _rewrite(path: Path, change) -> None:
    tensors = read_tensors(path)
    change(tensors)
    write(path, config_of(path), tensors, path)


def test_missing_scale_names_the_tensor(qwen_int4):
    module = "model.language_model.layers.1.mlp.experts.3.up_proj"
    _rewrite(qwen_int4, lambda t: t.pop(f"{module}.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"has no tensor '{module}\.weight_scale'"):
        load_checkpoint(qwen_int4, progress=False)


def test_scale_of_another_group_grid_names_the_tensor(qwen_int4):
    name = "model.language_model.layers.3.self_attn.o_proj.weight_scale"

    def coarser(tensors):
        tensors[name] = tensors[name][:, ::2].contiguous()

    _rewrite(qwen_int4, coarser)
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \[64, 2\], expected \[64, 4\]"):
        load_checkpoint(qwen_int4, progress=False)


def test_fp8_weight_without_its_scale_names_the_tensor(releases, tmp_path):
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    path = write_compressed(releases["minimax_m3"], tmp_path / "ct", scheme, "float-quantized")
    name = "language_model.model.layers.0.self_attn.o_proj"
    _rewrite(path, lambda t: t.pop(f"{name}.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"'{name}\.weight' is float8_e4m3fn, but its"):
        load_checkpoint(path, progress=False)


def test_group_size_the_kernels_do_not_take_is_named(releases, tmp_path):
    scheme = int_scheme(16, symmetric=True)
    path = write_compressed(releases["qwen3_5_moe"], tmp_path / "ct", scheme, "pack-quantized")
    with pytest.raises(CheckpointError, match=r"weight_packed'.*in groups of 16 cannot .* 32, 64"):
        load_checkpoint(path, progress=False)


def test_unsupported_format_is_named(qwen_int4):
    config = config_of(qwen_int4)
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (qwen_int4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="format 'nvfp4-pack-quantized'.* is not supported"):
        load_checkpoint(qwen_int4, progress=False)


def test_compressed_module_no_group_targets_is_named(qwen_int4):
    config = config_of(qwen_int4)
    config["quantization_config"]["ignore"].append("re:.*experts.*")
    (qwen_int4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"no config group .* targets module '.*experts\."):
        load_checkpoint(qwen_int4, progress=False)
