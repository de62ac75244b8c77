"""`python -m sparrow.train` on a slice of the corpus for two steps: it writes a checkpoint
in the Qwen3.5/3.6 release layout (bf16 weights, tokenizer.json with Qwen's special tokens,
the chat template) that the engine loads and decodes greedily as HF transformers does."""

import json

import pytest
import torch
from safetensors import safe_open

from sparrow import LLM, SamplingParams
from sparrow.train import SPECIAL, main

transformers = pytest.importorskip("transformers")


def test_two_steps_give_a_checkpoint_the_engine_runs_as_hf(tmp_path):
    out = main(
        [
            "--out",
            str(tmp_path),
            "--steps",
            "2",
            "--max-files",
            "60",
            "--vocab",
            "600",
            "--batch",
            "2",
            "--length",
            "64",
        ]
    )
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 2 and info["vocab"] <= 600 and info["held_out_loss"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["dtype"] == "bfloat16"
    assert config["text_config"]["model_type"] == "qwen3_5_moe_text"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    assert (out / "generation_config.json").is_file()
    llm = LLM(model=str(out), dtype="float32", max_model_len=256)
    assert all(llm.tokenizer.token_id(t) is not None for t in SPECIAL)
    prompt = llm.tokenizer.encode("def fibonacci(n):\n    ")
    ours = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    assert ours == ref
