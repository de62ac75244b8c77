"""Checkpoints Sparrow writes are laid out as each family's release: the names and config.json
of the release (float) and of mlx-lm (4-bit), read back by Sparrow bit for bit, and the float
ones read by HF transformers 5.17's `from_pretrained` with Sparrow's logits (fp32). Layouts
Sparrow reads besides (HF's own saves, HF-internal names) still load. mlx-lm reading these
files: `test_mlx_lm.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from sparrow.loader.random_checkpoint import random_model, write_random_checkpoint
from sparrow.loader.weights import load_checkpoint
from sparrow.loader.writer import ShardWriter
from tests.conftest import rel_err
from tests.loader.layouts import IDS, TINY, TOL, assert_same, logits, names

pytestmark = pytest.mark.usefixtures("hf_gdn_in_pytorch")

# What the release of each family holds (float), and mlx-lm's names (4-bit).
RELEASE_NAMES = {
    "qwen3_5_moe": (
        "lm_head.weight",
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        "model.language_model.layers.3.mlp.experts.down_proj",
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
    ),
    "qwen3_next": (
        "lm_head.weight",
        "model.layers.0.mlp.experts.7.up_proj.weight",
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
        "model.layers.3.mlp.shared_expert_gate.weight",
    ),
    "qwen3_moe": ("lm_head.weight", "model.layers.1.mlp.experts.7.down_proj.weight"),
    "minimax_m3": (
        "language_model.lm_head.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.0.mlp.gate_proj.weight",
        "language_model.model.layers.1.self_attn.index_q_proj.weight",
        "language_model.model.layers.1.self_attn.index_k_norm.weight",
        "language_model.model.layers.1.block_sparse_moe.gate.weight",
        "language_model.model.layers.1.block_sparse_moe.e_score_correction_bias",
        "language_model.model.layers.2.block_sparse_moe.experts.7.w3.weight",
        "language_model.model.layers.2.block_sparse_moe.shared_experts.up_proj.weight",
    ),
}
MLX_NAMES = {
    "qwen3_5_moe": (
        "language_model.lm_head.scales",
        "language_model.model.layers.0.mlp.switch_mlp.gate_proj.scales",
        "language_model.model.layers.0.mlp.gate.biases",
    ),
    "qwen3_next": ("lm_head.scales", "model.layers.0.mlp.switch_mlp.up_proj.biases"),
    "qwen3_moe": ("lm_head.scales", "model.layers.0.mlp.switch_mlp.down_proj.weight"),
    "minimax_m3": (
        "language_model.lm_head.scales",
        "language_model.model.layers.0.mlp.up_proj.scales",
        "language_model.model.layers.1.self_attn.index_k_proj.scales",
        "language_model.model.layers.1.block_sparse_moe.gate.weight",
        "language_model.model.layers.2.block_sparse_moe.switch_mlp.gate_proj.biases",
        "language_model.model.layers.2.block_sparse_moe.shared_experts.gate_proj.scales",
    ),
}


def test_float_release_names_and_config(written):
    name, model, path = written.name, written.model, written.path
    assert set(RELEASE_NAMES[name]) <= names(path)
    config = json.loads((path / "config.json").read_text())
    if name == "minimax_m3":
        assert not any(".mlp.experts." in n or "indexer" in n for n in names(path))
        text = config["text_config"]
        assert config["model_type"] == "minimax_m3_vl"
        assert config["moe_layer_freq"] == text["moe_layer_freq"] == [0, 1, 1, 0]
        sparse = config["sparse_attention_config"]
        assert sparse == text["sparse_attention_config"]
        assert sparse["sparse_attention_freq"] == [0, 1, 1, 0]
        assert sparse["sparse_block_size"] == 16 and sparse["sparse_topk_blocks"] == 2
        assert text["rotary_dim"] == 16 and text["partial_rotary_factor"] == 0.5
        assert text["scoring_func"] == "sigmoid" and text["n_shared_experts"] == 1
    elif name == "qwen3_5_moe":
        assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
        assert config["model_type"] == "qwen3_5_moe"
        assert config["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert "vision_config" not in config  # the file holds no tower
    assert_same(load_checkpoint(path, progress=False), model)


def test_mlx_names_and_round_trip(written):
    assert set(MLX_NAMES[written.name]) <= names(written.mlx)
    assert_same(load_checkpoint(written.mlx, progress=False), written.quantized, atol=1e-7)


def test_quantization_block_describes_the_stored_tensors(written):
    """Every module with a stored matrix is declared as stored: packed at the default width
    or as its entry says, or `false` and in float."""
    block = json.loads((written.mlx / "config.json").read_text())["quantization"]
    stored = {}
    for file in written.mlx.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            stored |= {n: f.get_slice(n) for n in f.keys()}
    modules = {n.removesuffix(".weight") for n in stored if n.endswith(".weight")}
    entries = {k: v for k, v in block.items() if k not in ("group_size", "bits", "mode")}
    assert set(entries) <= modules
    for module in modules:
        weight = stored[f"{module}.weight"]
        declared = entries.get(module, {"bits": block["bits"], "group_size": block["group_size"]})
        packed = f"{module}.scales" in stored
        assert packed == (f"{module}.biases" in stored), module
        if declared is False:
            assert not packed and weight.get_dtype() != "U32", module
        elif packed:
            assert weight.get_dtype() == "U32", module
            scales = stored[f"{module}.scales"].get_shape()
            in_features = weight.get_shape()[-1] * 32 // declared["bits"]
            assert scales[-1] * declared["group_size"] == in_features, module
        else:  # only the float matrices that mlx-lm cannot quantise go undeclared
            assert len(weight.get_shape()) < 2 or "conv1d" in module, module


def test_m3_routers_are_declared_float(m3):
    block = json.loads((m3.mlx / "config.json").read_text())["quantization"]
    for i in (1, 2):
        assert block[f"language_model.model.layers.{i}.block_sparse_moe.gate"] is False


CAUSAL_LM = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _hf_model(name: str, path: Path) -> torch.nn.Module:
    """HF 5.17 reading the release checkpoint with the release's class (a small vision tower
    for the multimodal classes: the file holds none)."""
    import transformers as tf

    if name == "qwen3_5_moe":
        config = tf.AutoConfig.from_pretrained(path)
        config.vision_config = tf.Qwen3_5MoeVisionConfig(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64
        )
        cls, kw = tf.Qwen3_5MoeForConditionalGeneration, {"config": config}
    elif name == "minimax_m3":
        config = tf.AutoConfig.from_pretrained(path)
        config.vision_config = tf.MiniMaxM3VLVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
        config.projector_hidden_size = 64
        cls, kw = tf.MiniMaxM3SparseForConditionalGeneration, {"config": config}
    else:
        cls, kw = getattr(tf, CAUSAL_LM[name]), {}
    hf, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True, **kw)
    tower = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith(tower) for k in info["missing_keys"]), info["missing_keys"]
    return hf.eval()


def test_hf_reads_the_float_release(written):
    hf = _hf_model(written.name, written.path)
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    err = rel_err(logits(written.model, IDS), expected)
    assert err < TOL, f"rel err {err:.2e}"


@pytest.mark.parametrize("name", sorted(TINY))
def test_random_checkpoint_is_the_release_layout(tmp_path, name):
    """`write_random_checkpoint` writes the release's names and config (keeping the family's
    vision_config) and loads as the same weights drawn on the device."""
    path = write_random_checkpoint(
        tmp_path, TINY[name], seed=4, dtype=torch.float32, tokenizer=False, progress=False
    )
    assert set(RELEASE_NAMES[name]) <= names(path)
    config = json.loads((path / "config.json").read_text())
    assert config == TINY[name].to_hf_config() | {"dtype": "float32"}
    drawn = random_model(TINY[name], seed=4, dtype=torch.float32)
    assert_same(load_checkpoint(path, progress=False), drawn)


def test_m3_hf_internal_names_still_load(tmp_path, m3):
    """M3 in HF-internal names under `language_model.model.` (`mlp.experts` stacked as
    `switch_mlp`, `self_attn.indexer.*`, fused `gate_up_proj`), float and 4-bit."""
    sources = ((m3.model, tmp_path / "float"), (m3.quantized, tmp_path / "4bit"))
    for source, out in sources:
        with ShardWriter(out) as writer:
            for param, t in source.state_dict().items():
                t = t.view(torch.uint32) if t.dtype == torch.int32 else t
                mlp, _, rest = param.partition(".experts.")
                if not rest:
                    head = param.startswith("lm_head.")
                    writer.add(("language_model." if head else "language_model.model.") + param, t)
                    continue
                fused, _, kind = rest.partition("_proj")
                kind = kind.lstrip("_") or "weight"
                if fused == "gate_up":
                    gate, up = t.chunk(2, dim=-2)
                    writer.add(f"language_model.model.{mlp}.switch_mlp.gate_proj.{kind}", gate)
                    writer.add(f"language_model.model.{mlp}.switch_mlp.up_proj.{kind}", up)
                else:
                    writer.add(f"language_model.model.{mlp}.switch_mlp.down_proj.{kind}", t)
        config = source.config.to_hf_config()
        if source.config.quantization is not None:
            config["quantization"] = {"group_size": 64, "bits": 4}
        (out / "config.json").write_text(json.dumps(config))
        assert_same(load_checkpoint(out, progress=False), source)
