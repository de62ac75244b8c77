"""FP8 block-scaled checkpoints (HF `quant_method: "fp8"`, as Qwen3.6's and MiniMax M2's FP8
releases ship) load in Sparrow with their weights kept FP8, for both families and every
expert layout (Qwen's fused release, HF's per-expert names, MiniMax's w1 / w3 / w2 and HF's
fused M3 experts and gate_up projections), and give the logits and greedy tokens of HF 5.17
running HF's own dequantisation of the same files. The files are written as HF's FP8
quantiser writes them: its `Fp8Quantize` op on each weight of a module it converts
(`should_convert_module` against the release's `modules_to_not_convert`).
`quantization="fp8"` quantises a float checkpoint on load to the same bytes. Bad files fail
naming the tensor."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from sparrow.assets import default_checkpoint
from sparrow.config import ConfigError, QuantConfig
from sparrow.layers.fp8 import Fp8Experts, Fp8Linear
from sparrow.loader.weights import CheckpointError, load_checkpoint
from sparrow.models import load_model_args
from sparrow.quant import fp8
from sparrow.quant.fp8 import FP8, Fp8Spec
from tests.loader.layouts import logits
from tests.loader.quantized_checkpoints import (
    FAMILIES,
    Reference,
    assert_matches_hf,
    config_of,
    float_release,
    fused,
    per_expert,
    read_tensors,
    write,
)

pytestmark = pytest.mark.usefixtures("hf_gdn_in_pytorch")

# What each release keeps in float (Qwen3.6-FP8's list; MiniMax's `gate`: the routers)
SKIP = {
    "qwen3_5_moe": [
        "lm_head",
        "embed_tokens",
        "mlp.gate",
        "mlp.shared_expert_gate",
        "linear_attn.in_proj_a",
        "linear_attn.in_proj_b",
    ],
    "minimax_m3": ["gate", "e_score_correction_bias", "lm_head"],
}


def quantizer(block: list[int], skip: list[str]) -> FineGrainedFP8HfQuantizer:
    config = FineGrainedFP8Config(weight_block_size=block, modules_to_not_convert=skip)
    return FineGrainedFP8HfQuantizer(config)


def _module(name: str) -> str:
    return name.removesuffix(".weight")


def _converted(name: str, t: torch.Tensor, skip: list[str]) -> bool:
    """Whether HF's FP8 quantiser converts the tensor's module: linear layers and routed
    experts (matrices), not the embedding, unless `modules_to_not_convert` names it."""
    return (
        t.dim() >= 2 and "embed_tokens" not in name and should_convert_module(_module(name), skip)
    )


def write_fp8(src: Path, dst: Path, block: list[int], skip: list[str], layout=None) -> Path:
    """`src` (a float release) as HF writes it FP8, its tensors first laid out by `layout`
    (`per_expert`: Qwen's fused experts as HF's `save_pretrained` names them; `fused`:
    MiniMax's in HF's fused M3 names)."""
    tensors = read_tensors(src)
    if layout is not None:
        tensors = layout(tensors)
    op = Fp8Quantize(quantizer(block, skip))
    out = {}
    for name, t in tensors.items():
        if _converted(name, t, skip):
            out |= op.convert({name: t})  # matrices not of whole blocks: left float
        else:
            out[name] = t
    block_config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
        "modules_to_not_convert": skip,
    }
    return write(dst, config_of(src) | {"quantization_config": block_config}, out, src)


def dequantized(src: Path, dst: Path) -> Path:
    """An FP8 checkpoint as float32, by HF's `Fp8Dequantize` pair by pair, without the
    quantization block: what HF runs as the reference."""
    tensors = read_tensors(src)
    op = Fp8Dequantize(quantizer(config_of(src)["quantization_config"]["weight_block_size"], []))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = t if scale is None else op._dequantize_one(t, scale, torch.float32)
    config = config_of(src)
    del config["quantization_config"]
    return write(dst, config, out, src)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {family: float_release(family, root) for family in FAMILIES}


# (family, layout, a scale the files hold)
CASES = {
    "qwen-fused": ("qwen3_5_moe", None, "layers.1.mlp.experts.gate_up_proj_scale_inv"),
    "qwen-hf": ("qwen3_5_moe", per_expert, "layers.1.mlp.experts.0.gate_proj.weight_scale_inv"),
    "m3": ("minimax_m3", None, "layers.1.block_sparse_moe.experts.0.w1.weight_scale_inv"),
    "m3-fused": ("minimax_m3", fused, "layers.1.block_sparse_moe.experts.gate_up_proj_scale_inv"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_matches_hf(releases, tmp_path, case):
    family, layout, scale = CASES[case]
    path = write_fp8(releases[family], tmp_path / "fp8", [32, 32], SKIP[family], layout)
    assert any(n.endswith(scale) for n in read_tensors(path))
    model = load_checkpoint(path, progress=False)
    assert isinstance(model.layers[1].mlp.experts, Fp8Experts)
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == FP8
    assert not isinstance(model.lm_head, Fp8Linear)
    assert_matches_hf(path, Reference(dequantized(path, tmp_path / "reference")))


def test_default_model_in_blocks_of_128(tmp_path):
    """The built-in model (128 wide, a trained vocabulary) at the release's block size:
    matrices of fewer than 128 rows (k / v projections) stay float, as HF writes them. The
    weights stay FP8 through a forward (each layer dequantises as it runs)."""
    skip = SKIP["qwen3_5_moe"]
    path = write_fp8(default_checkpoint(), tmp_path / "fp8", [128, 128], skip)
    model = load_checkpoint(path, progress=False)
    attention = model.layers[3].self_attn
    assert isinstance(attention.q_proj, Fp8Linear)
    assert attention.k_proj.weight.dtype == torch.float32
    held = {n: (t.dtype, t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    logits(model, list(range(1, 40)))
    assert {n: (t.dtype, t.shape) for n, t in model.state_dict(keep_vars=True).items()} == held
    assert_matches_hf(path, Reference(dequantized(path, tmp_path / "reference")))


@pytest.mark.parametrize("case", [*FAMILIES, "default-128"])
def test_quantized_on_load_is_what_hf_writes(releases, tmp_path, case):
    """`fp8_default` on a float checkpoint holds the bytes HF's quantiser writes (same
    modules kept float, those of partial blocks among them, same codes and scales): the tiny
    models in blocks of 32, the built-in one in the release's 128 (k / v: 64 rows)."""
    family, block = (case, 32) if case in FAMILIES else ("qwen3_5_moe", 128)
    src = releases[family] if case in FAMILIES else default_checkpoint()
    hf = load_checkpoint(
        write_fp8(src, tmp_path / "fp8", [block] * 2, SKIP[family]), progress=False
    )
    ours = load_checkpoint(src, quantize=QuantConfig.fp8_default((block, block)), progress=False)
    assert ours.weight_format["quantized_on_load"]
    assert ours.weight_format["quantized"] == hf.weight_format["quantized"]
    a, b = ours.state_dict(), hf.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        same = a[k].view(torch.uint8) if a[k].dtype == FP8 else a[k]
        assert torch.equal(same, b[k].view(torch.uint8) if b[k].dtype == FP8 else b[k]), k


@pytest.mark.parametrize(("n", "k", "block"), [(100, 70, (32, 32)), (63, 130, (16, 64))])
def test_partial_blocks_take_the_amax_they_hold(n, k, block):
    """A matrix that does not fill whole blocks: each block as HF's `Fp8Quantize` quantises the
    matrix padded with zeros to whole blocks; the ceil grid dequantises back."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 3
    codes, scales = fp8.quantize(w, Fp8Spec(*block))
    padded = torch.zeros(-(-n // block[0]) * block[0], -(-k // block[1]) * block[1])
    padded[:n, :k] = w
    hf = Fp8Quantize(quantizer(list(block), [])).convert({"w.weight": padded})
    assert torch.equal(codes.view(torch.uint8), hf["w.weight"][:n, :k].view(torch.uint8))
    assert torch.equal(scales, hf["w.weight_scale_inv"])
    back = fp8.dequantize(codes, scales, Fp8Spec(*block))
    reference = Fp8Dequantize(quantizer(list(block), []))._dequantize_one(
        hf["w.weight"], scales, torch.float32
    )
    assert torch.equal(back, reference[:n, :k])


def _rewrite(path: Path, change) -> None:
    tensors = read_tensors(path)
    change(tensors)
    write(path, config_of(path), tensors, path)


@pytest.fixture
def qwen_fp8(releases, tmp_path):
    return write_fp8(releases["qwen3_5_moe"], tmp_path / "fp8", [32, 32], SKIP["qwen3_5_moe"])


def test_missing_scale_names_the_tensor(qwen_fp8):
    name = "model.language_model.layers.3.self_attn.o_proj.weight_scale_inv"
    _rewrite(qwen_fp8, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"layers\.3\.self_attn\.o_proj\.weight_scale_inv"):
        load_checkpoint(qwen_fp8, progress=False)


def test_scale_of_another_grid_names_the_tensor(qwen_fp8):
    name = "model.language_model.layers.0.linear_attn.out_proj.weight_scale_inv"

    def finer(tensors):
        tensors[name] = tensors[name].repeat_interleave(2, dim=0)

    _rewrite(qwen_fp8, finer)
    with pytest.raises(CheckpointError, match=rf"{name}.* has shape \[4, 2\], expected \[2, 2\]"):
        load_checkpoint(qwen_fp8, progress=False)


def test_fp8_weight_without_the_fp8_block_is_refused(qwen_fp8):
    config = config_of(qwen_fp8)
    del config["quantization_config"]
    (qwen_fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.language_model\.layers\.\d"):
        load_checkpoint(qwen_fp8, progress=False)


def test_unknown_quant_method_is_named(qwen_fp8):
    config = config_of(qwen_fp8)
    config["quantization_config"]["quant_method"] = "awq"
    (qwen_fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quantization method 'awq' is not supported"):
        load_model_args(qwen_fp8)


def test_static_activation_scales_are_refused(qwen_fp8):
    config = config_of(qwen_fp8)
    config["quantization_config"]["activation_scheme"] = "static"
    (qwen_fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="fp8 activation_scheme 'static' is not supported"):
        load_model_args(qwen_fp8)


def test_flag_config_and_v1_models(caplog):
    """`--quantization fp8` (and its alias `--quantize`) and `LLM(quantization="fp8")`
    quantise on load; the format is logged once and /v1/models shows it."""
    from fastapi.testclient import TestClient

    from sparrow.cli.args import build_parser, engine_config
    from sparrow.engine.async_engine import AsyncEngine
    from sparrow.engine.llm import LLM
    from sparrow.server.app import build_app

    for flag in ("--quantization", "--quantize"):
        args = build_parser().parse_args(["generate", "--prompt", "x", flag, "fp8"])
        assert engine_config(args).quantization == QuantConfig.fp8_default()
    with caplog.at_level(logging.INFO, logger="sparrow.loader.model"):
        llm = LLM(device="cpu", dtype=torch.float32, quantization="fp8")
    assert caplog.text.count("weights: float checkpoint, quantised on load; fp8 e4m3") == 1
    with TestClient(build_app(AsyncEngine(llm), llm.tokenizer, "default")) as http:
        card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == "default"
    quantization = card["quantization"]
    assert quantization["quantized_on_load"]
    assert quantization["quantized"] == [
        {"format": "fp8", "fmt": "e4m3", "bits": 8, "block": [128, 128], "modules": 27}
    ]
    kept = {"lm_head", "embed_tokens", "layers.*.mlp.gate", "layers.*.self_attn.k_proj"}
    assert kept <= set(quantization["float"])  # k_proj: 64 rows, not whole blocks of 128
