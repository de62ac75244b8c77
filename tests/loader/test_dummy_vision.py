"""`load_format="dummy"` draws the vision tower too when the config names one."""

import json

import torch

from sparrow.engine.llm import LLM
from sparrow.loader.random_checkpoint import PRESETS
from sparrow.loader.vision import names_vision


def test_dummy_weights_include_the_tower(tmp_path):
    config = PRESETS["qwen3.6-tiny"].to_hf_config()
    assert names_vision(config) and not names_vision(config["text_config"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", dtype="float32", max_model_len=64)
    tower = llm.model.visual
    params = dict(tower.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    matrices = [p for p in params.values() if p.ndim > 1]
    assert 0.015 < torch.cat([m.flatten()[:1000] for m in matrices]).std() < 0.025
    norms = [p for n, p in params.items() if "norm" in n and n.endswith("weight")]
    assert norms and all((p == 1).all() for p in norms)
