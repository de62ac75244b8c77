"""MLX checkpoints of mlx-lm's mixed recipes: `mlx_lm.convert` with a `quant_predicate` that
picks each module's width and group (4-bit experts, 8-bit routers, embedding and lm_head,
other groups of 32 and 128) and keeps some modules in float (the predicate's False: no entry
in the quantization block, a float `.weight`). Sparrow loads each module as stored; in
float32 its logits and greedy tokens are mlx-lm's on the same bytes (Qwen3.5/3.6 MoE: the
built-in model; MiniMax M3: the tiny preset, whose routers mlx-lm quantises). Sparrow's MLX
writer gives the mixed model back with a block that declares exactly what it stores; bad
blocks and tensors are errors that name the tensor and the expected shape."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sparrow.assets import default_checkpoint
from sparrow.config import ConfigError
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.eval.mlx_reference import mlx_lm_logits, write_mlx_checkpoint
from sparrow.layers.quantized import QuantizedLinear, QuantizedSigmoidRouter
from sparrow.loader.mlx_writer import save_mlx_checkpoint
from sparrow.loader.random_checkpoint import write_random_checkpoint
from sparrow.loader.weights import CheckpointError, load_checkpoint
from sparrow.models import PRESETS
from sparrow.quant.affine import QuantSpec, dequantize, quantize
from tests.conftest import rel_err
from tests.loader.layouts import assert_same, logits

mx = pytest.importorskip("mlx.core")
mlx_convert = pytest.importorskip("mlx_lm.convert")
mlx_generate = pytest.importorskip("mlx_lm.generate")
mlx_utils = pytest.importorskip("mlx_lm.utils")

TOL = 1e-4  # fp32 logits, relative to the largest
M3 = PRESETS["minimax-m3-tiny"].replace(vocab_size=512, initializer_range=0.1)
M3_ROUTER = "language_model.model.layers.1.block_sparse_moe.gate"
PROMPTS = {
    "qwen": [(37 * i + 5) % 4096 for i in range(40)],
    "m3": [(7 * i + 3) % 512 for i in range(40)],
}


def _width(bits: int, group: int) -> dict:
    return {"group_size": group, "bits": bits}


def qwen_recipe(path: str, module) -> bool | dict:
    """The built-in model (hidden 128): what mlx-lm's mixed recipes vary, at widths Sparrow's
    kernels take."""
    if path.endswith(
        ("mlp.gate", "shared_expert_gate", "embed_tokens", "layers.3.self_attn.v_proj")
    ):
        return _width(8, 64)
    if path.endswith(("lm_head", "layers.2.linear_attn.out_proj")):
        return _width(8, 128)
    if path.endswith("layers.0.linear_attn.in_proj_qkv"):
        return _width(4, 32)
    if ".layers.2.mlp.switch_mlp." in path:
        return _width(8, 64)
    return not path.endswith(
        ("layers.3.self_attn.o_proj", "layers.1.mlp.shared_expert.down_proj", "in_proj_a")
    )


def m3_recipe(path: str, module) -> bool | dict:
    """MiniMax M3 tiny (hidden 64): layer 1's router at 8 bits (mlx-lm's own M3 policy),
    layer 2's in float."""
    if path == M3_ROUTER or path.endswith(("embed_tokens", "layers.1.self_attn.index_q_proj")):
        return _width(8, 64)
    if path.endswith(("lm_head", "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj")):
        return _width(8, 32)
    if ".layers.2.block_sparse_moe.switch_mlp." in path:
        return _width(4, 32)
    return not path.endswith(
        (
            "layers.2.block_sparse_moe.gate",
            "layers.1.block_sparse_moe.shared_experts.down_proj",
            "layers.2.self_attn.o_proj",
        )
    )


def _convert(src: Path, out: Path, recipe) -> Path:
    mlx_convert.convert(
        str(src),
        str(out),
        quantize=True,
        q_group_size=64,
        q_bits=4,
        dtype="float32",
        quant_predicate=recipe,
    )
    return out


@pytest.fixture(scope="module")
def m3_float(tmp_path_factory) -> Path:
    """MiniMax M3 tiny in MiniMax's release layout (fp32)."""
    path = tmp_path_factory.mktemp("m3-float")
    return write_random_checkpoint(path, M3, seed=3, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, m3_float) -> dict[str, Path]:
    """family -> its mixed checkpoint, as mlx_lm.convert writes it."""
    root = tmp_path_factory.mktemp("mixed")
    return {
        "qwen": _convert(default_checkpoint(), root / "qwen", qwen_recipe),
        "m3": _convert(m3_float, root / "m3", m3_recipe),
    }


def _block(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization"]


def test_m3_as_mlx_lm_quantises_it_matches_mlx_lm(m3_float, tmp_path):
    """`mlx_lm.convert` at 4 bits with mlx-lm's own M3 policy (every router at 8 bits)."""
    out = write_mlx_checkpoint(m3_float, tmp_path / "4bit", "mlx-lm", "4bit", "cpu", torch.float32)
    model = load_checkpoint(out, progress=False)
    assert all(isinstance(model.layers[i].mlp.gate, QuantizedSigmoidRouter) for i in (1, 2))
    ids = PROMPTS["m3"]
    assert rel_err(logits(model, ids[:-1]), mlx_lm_logits(out, ids, 1, "float32")) < TOL


def test_the_recipes_write_what_they_ask(mixed):
    """The blocks as mlx-lm writes them: an entry per module the predicate gave a width, none
    for those it kept in float (their `.weight` is float, with no scales)."""
    block = _block(mixed["m3"])
    assert block[M3_ROUTER] == _width(8, 64)
    assert "language_model.model.layers.2.block_sparse_moe.gate" not in block
    assert _block(mixed["qwen"])["language_model.lm_head"] == _width(8, 128)


@pytest.mark.parametrize("family", ["qwen", "m3"])
def test_mixed_checkpoint_loads_as_stored_and_matches_mlx_lm(mixed, family):
    model = load_checkpoint(mixed[family], progress=False)
    ids = PROMPTS[family]
    ours = logits(model, ids[:-1])
    ref = mlx_lm_logits(mixed[family], ids, 1, "float32")
    err = rel_err(ours, ref)
    assert err < TOL, f"rel err {err:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    kl = torch.nn.functional.kl_div(
        ours.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    assert kl.max() < 1e-5


def test_each_module_takes_its_stored_width(mixed):
    m3 = load_checkpoint(mixed["m3"], progress=False)
    router = m3.layers[1].mlp.gate
    assert isinstance(router, QuantizedSigmoidRouter) and router.spec == QuantSpec(8, 64)
    assert router.e_score_correction_bias.dtype == torch.float32
    assert m3.layers[2].mlp.gate.weight.dtype == torch.float32  # the predicate's False
    assert m3.layers[2].mlp.experts.spec == QuantSpec(4, 32)
    assert m3.layers[0].mlp.gate_up_proj.spec == QuantSpec(8, 32)
    assert type(m3.layers[2].self_attn.o_proj) is torch.nn.Linear
    qwen = load_checkpoint(mixed["qwen"], progress=False)
    assert qwen.embed_tokens.spec == QuantSpec(8, 64) and qwen.lm_head.spec == QuantSpec(8, 128)
    assert qwen.layers[0].linear_attn.in_proj_qkv.spec == QuantSpec(4, 32)
    assert type(qwen.layers[1].linear_attn.in_proj_a) is torch.nn.Linear
    assert isinstance(qwen.layers[3].self_attn.v_proj, QuantizedLinear)
    assert qwen.layers[3].self_attn.v_proj.spec == QuantSpec(8, 64)
    assert qwen.layers[2].mlp.experts.spec == QuantSpec(8, 64)


def _mlx_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's greedy tokens (generate_step, no sampler: argmax) in float32."""
    model, _ = mlx_utils.load_model(path)
    model.set_dtype(mx.float32)
    steps = mlx_generate.generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(np.array(token)) for token, _ in steps]


@pytest.mark.parametrize("family", ["qwen", "m3"])
def test_greedy_tokens_match_mlx_lm(mixed, family):
    prompt = PROMPTS[family][:24]
    llm = LLM(mixed[family], device="cpu", dtype="float32")
    out = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.token_ids == _mlx_greedy(mixed[family], prompt, 10)


def _headers(path: Path) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape, whether it holds packed words)."""
    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors |= {
            n: (tuple(t.shape), t.dtype == torch.uint32) for n, t in load_file(file).items()
        }
    return tensors


def _declared(block: dict, module: str, packed: bool) -> QuantSpec | None:
    """What an MLX block makes of one stored module, as mlx-lm reads it: its entry, else the
    default where the weight is packed, else float."""
    entry = block.get(module)
    if entry is False or (entry is None and not packed):
        return None
    entry = entry or block
    return QuantSpec(entry["bits"], entry["group_size"])


@pytest.mark.parametrize("family", ["qwen", "m3"])
def test_sparrow_rewrites_a_mixed_model_with_an_exact_block(mixed, family, tmp_path):
    """Loaded from mlx-lm's mixed checkpoint and written by `save_mlx_checkpoint`: the same
    tensors (names, shapes, which are packed), a block that gives every module the width it
    is stored at (`false` for each float matrix), the same model back in Sparrow, the same
    logits in mlx-lm. (Float dtypes may differ: mlx-lm keeps Qwen's `A_log` as the source
    stores it.)"""
    model = load_checkpoint(mixed[family], progress=False)
    out = save_mlx_checkpoint(model, tmp_path / "rewritten", tokenizer_dir=mixed[family])
    theirs, ours = _headers(mixed[family]), _headers(out)
    assert ours == theirs
    block, mlx_block = _block(out), _block(mixed[family])
    assert {k: block[k] for k in ("group_size", "bits", "mode")} == _width(4, 64) | {
        "mode": "affine"
    }
    for name, (shape, packed) in ours.items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or len(shape) < 2 or "conv1d" in name:
            continue
        assert _declared(block, module, packed) == _declared(mlx_block, module, packed), module
        assert packed or block.get(module) is False, module
    assert_same(load_checkpoint(out, progress=False), model)
    ids = PROMPTS[family]
    assert rel_err(mlx_lm_logits(out, ids, 1, "float32"), logits(model, ids[:-1])) < TOL


def _rewrite(src: Path, dst: Path, tensors=None, block=None) -> Path:
    """A copy of checkpoint `src` with some tensors changed (name -> tensor, None: removed)
    and quantization block entries changed (module -> entry)."""
    shutil.copytree(src, dst)
    (file,) = dst.glob("*.safetensors")
    state = load_file(file)
    for name, t in (tensors or {}).items():
        if t is None:
            del state[name]
        else:
            state[name] = t
    save_file(state, file, metadata={"format": "mlx"})
    config = json.loads((dst / "config.json").read_text())
    for module, entry in (block or {}).items():
        config["quantization"][module] = config["quantization_config"][module] = entry
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_scales_name_the_tensor_and_shape(mixed, tmp_path):
    """The 8-bit router's packed words without their scales."""
    bad = _rewrite(mixed["m3"], tmp_path / "bad", {f"{M3_ROUTER}.scales": None})
    with pytest.raises(
        CheckpointError,
        match=r"missing tensors: layers\.1\.mlp\.gate\.scales \(expected shape \[8, 1\]\)",
    ):
        load_checkpoint(bad, progress=False)


def test_scales_on_another_group_grid_name_the_tensor_and_shape(mixed, tmp_path):
    """The router's scales and biases in groups of 32 where the block declares 64."""
    w = torch.randn(8, 64)
    _, scales, biases = quantize(w, QuantSpec(8, 32), torch.float32)
    grid = {f"{M3_ROUTER}.scales": scales, f"{M3_ROUTER}.biases": biases}
    bad = _rewrite(mixed["m3"], tmp_path / "bad", grid)
    with pytest.raises(
        CheckpointError,
        match=rf"'{M3_ROUTER}.(scales|biases)' has shape \[8, 2\], expected \[8, 1\] "
        r"\(8-bit, group_size 64\)",
    ):
        load_checkpoint(bad, progress=False)


def test_a_block_that_contradicts_the_tensors_is_an_error(mixed, tmp_path):
    float_router = "language_model.model.layers.2.block_sparse_moe.gate"
    declared = _rewrite(mixed["m3"], tmp_path / "declared", block={float_router: _width(8, 64)})
    with pytest.raises(
        CheckpointError,
        match=rf"'{float_router}.weight' is stored in float .* expected uint32 packed words "
        r"with shape \[8, 16\]",
    ):
        load_checkpoint(declared, progress=False)
    unquantised = _rewrite(mixed["m3"], tmp_path / "false", block={M3_ROUTER: False})
    with pytest.raises(CheckpointError, match=rf"'{M3_ROUTER}.weight' holds packed words"):
        load_checkpoint(unquantised, progress=False)


def test_pieces_of_one_module_at_two_widths_are_an_error(mixed, tmp_path):
    """Layer 1's routed down projections at 8 bits, gate and up at 4: Sparrow's experts take
    one width for all three."""
    down = "language_model.model.layers.1.block_sparse_moe.switch_mlp.down_proj"
    state = load_file(next(mixed["m3"].glob("*.safetensors")))
    w = dequantize(*(state[f"{down}.{k}"] for k in ("weight", "scales", "biases")), QuantSpec())
    words, scales, biases = quantize(w, QuantSpec(8, 64), torch.float32)
    eight = {f"{down}.weight": words.view(torch.uint32), f"{down}.scales": scales}
    bad = _rewrite(
        mixed["m3"],
        tmp_path / "bad",
        eight | {f"{down}.biases": biases},
        block={down: _width(8, 64)},
    )
    with pytest.raises(CheckpointError, match=r"both fill layers.1.mlp.experts") as e:
        load_checkpoint(bad, progress=False)
    assert f"'{down}.weight'" in str(e.value) and "switch_mlp.gate_proj.weight'" in str(e.value)
    assert "at 8 bits in groups of 64" in str(e.value) and "at 4 bits" in str(e.value)


def test_widths_the_kernels_do_not_take_are_a_config_error(mixed, tmp_path):
    """mlx-lm's `mixed_4_6` recipe stores some modules at 6 bits."""
    bad = _rewrite(mixed["m3"], tmp_path / "bad", block={M3_ROUTER: _width(6, 64)})
    with pytest.raises(
        ConfigError, match=r"config.json: bad quantization block: bits must be 4 or 8, got 6"
    ):
        load_checkpoint(bad, progress=False)
