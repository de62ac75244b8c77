"""MiniMax M3 checkpoints written by HF's `save_pretrained` load through `LLM`, and greedy
decoding gives HF's tokens, in every name layout: `MiniMaxM3VLForCausalLM` (HF-native fused
names), `MiniMaxM3SparseForConditionalGeneration` (HF writes the original MiniMax names:
`block_sparse_moe`, per-expert w1/w3/w2, `index_q_proj`), and those names with the dense
layers spelled `mlp.*` as the released checkpoint has them. Bad checkpoints and configs fail
with errors that name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models
from transformers import (
    MiniMaxM3SparseForConditionalGeneration,
    MiniMaxM3VLConfig,
    MiniMaxM3VLForCausalLM,
    MiniMaxM3VLTextConfig,
)

from sparrow.config import ConfigError
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.loader.weights import CheckpointError
from sparrow.worker.cache import ModelCache
from tests.models.test_hf_checkpoints import STEPS, tie_free_references

FULL, SPARSE = "full_attention", "minimax_m3_sparse"
# fmt: off
TEXT = dict(
    vocab_size=203, hidden_size=40, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=20, index_n_heads=2, index_head_dim=12,
    index_block_size=4, index_topk_blocks=3, num_local_experts=5, num_experts_per_tok=2,
    intermediate_size=16, dense_intermediate_size=24, shared_intermediate_size=8,
    layer_types=[FULL, SPARSE, SPARSE], mlp_layer_types=["dense", "sparse", "sparse"],
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    initializer_range=0.1, eos_token_id=202,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
# fmt: on
LENGTHS = (9, 47, 70)  # 70 tokens: 18 blocks of 4, 3 selected per query


def save(path: Path, layout: str, text: dict = TEXT) -> torch.nn.Module:
    """Build, seed and `save_pretrained` an HF M3 model of `layout` ("text" or "vlm"), with
    random router correction biases and a word-level tokenizer."""
    torch.manual_seed(0)
    if layout == "text":
        hf = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**text))
    else:
        config = MiniMaxM3VLConfig(
            text_config=text, vision_config=VISION, projector_hidden_size=text["hidden_size"]
        )
        hf = MiniMaxM3SparseForConditionalGeneration(config)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    hf.eval().save_pretrained(path)
    words = {f"t{i}": i for i in range(text["vocab_size"])}
    Tokenizer(models.WordLevel(words, unk_token="t0")).save(str(path / "tokenizer.json"))
    return hf


def rewrite(path: Path, change) -> None:
    """Rewrite model.safetensors with change(dict of tensors) applied."""
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def original_dense_names(tensors: dict) -> None:
    """Dense layers as the released checkpoint spells them: `mlp.{gate,up,down}_proj`."""
    for name in [n for n in tensors if ".layers.0.block_sparse_moe." in n]:
        tensors[name.replace(".block_sparse_moe.", ".mlp.")] = tensors.pop(name)


@pytest.fixture(scope="module", params=["text", "vlm", "original"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save(path, "text" if request.param == "text" else "vlm")
    if request.param == "original":
        rewrite(path, original_dense_names)
    return path, tie_free_references(hf, TEXT["vocab_size"], LENGTHS), request.param


def names(path: Path) -> list[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    return [c.token_ids for c in llm.generate(prompts, params)]


def test_files_have_the_layout_of_the_case(checkpoint):
    path, _, layout = checkpoint
    written = names(path)
    native = "model.layers.1.mlp.experts.gate_up_proj"
    original = "language_model.model.layers.1.block_sparse_moe.experts.4.w3.weight"
    assert (native in written) == (layout == "text")
    assert (original in written) == (layout != "text")
    dense = "language_model.model.layers.0.mlp.gate_proj.weight"
    assert (dense in written) == (layout == "original")
    assert any(n.startswith("vision_tower.") for n in written) == (layout != "text")


def test_greedy_tokens_match_hf(checkpoint):
    """One prompt alone, then all three (different lengths) batched, through the scheduler."""
    path, refs, _ = checkpoint
    llm = LLM(model=str(path), device="cpu", dtype=torch.float32)
    assert llm.cache_config.block_size == TEXT["index_block_size"]
    assert greedy(llm, [refs[1].prompt]) == [refs[1].tokens]
    assert greedy(llm, [r.prompt for r in refs]) == [r.tokens for r in refs]


def test_chunked_prefill_through_the_scheduler(checkpoint):
    path, refs, _ = checkpoint
    llm = LLM(model=str(path), device="cpu", dtype=torch.float32, max_num_batched_tokens=16)
    assert greedy(llm, [refs[2].prompt]) == [refs[2].tokens]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad")
    save(path, "vlm")
    return path


def test_wrong_shape_names_file_tensor_and_shape(vlm_dir, tmp_path):
    name = "language_model.model.layers.2.self_attn.index_q_proj.weight"
    for f in ("config.json", "tokenizer.json"):
        (tmp_path / f).write_bytes((vlm_dir / f).read_bytes())
    (tmp_path / "model.safetensors").write_bytes((vlm_dir / "model.safetensors").read_bytes())
    rewrite(tmp_path, lambda t: t.__setitem__(name, torch.zeros(23, 40)))
    with pytest.raises(CheckpointError) as e:
        LLM(model=str(tmp_path), device="cpu", dtype=torch.float32)
    message = str(e.value)
    assert "model.safetensors" in message and name in message
    assert "[23, 40]" in message and "expected [24, 40]" in message


def test_missing_expert_piece_is_named(vlm_dir, tmp_path):
    for f in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / f).write_bytes((vlm_dir / f).read_bytes())
    rewrite(
        tmp_path,
        lambda t: t.pop("language_model.model.layers.1.block_sparse_moe.experts.3.w3.weight"),
    )
    with pytest.raises(
        CheckpointError,
        match=r"layers\.1\.mlp\.experts\.gate_up_proj "
        r"\(expert 3, up_proj",
    ):
        LLM(model=str(tmp_path), device="cpu", dtype=torch.float32)


def test_unknown_layer_type_is_rejected(tmp_path):
    raw = {"model_type": "minimax_m3_vl_text"} | TEXT | {"layer_types": [FULL, "sliding", SPARSE]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config\.json.*unknown layer_types \['sliding'\]"):
        LLM(model=str(tmp_path), device="cpu", dtype=torch.float32)


def test_page_size_other_than_the_msa_block_is_rejected(vlm_dir):
    with pytest.raises(
        ConfigError, match="block_size 16 does not match the model's MSA block of 4 tokens"
    ):
        LLM(model=str(vlm_dir), device="cpu", dtype=torch.float32, block_size=16)
    llm = LLM(model=str(vlm_dir), device="cpu", dtype=torch.float32, block_size=4)
    with pytest.raises(
        ValueError, match="cache block size 8 does not match the model's MSA block of 4 tokens"
    ):
        ModelCache(llm.model.cache_specs(), 8, 8, 1, "cpu", torch.float32)
