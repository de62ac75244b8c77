import json

import pytest

from sparrow.config import ConfigError, ModelConfig, load_model_config, parse_hf_config


def test_default_is_35b_a3b():
    cfg = ModelConfig()
    assert cfg.layer_types.count("full_attention") == 10
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"][:2] == [3, 7]
    assert cfg.rotary_dim == 64 and cfg.linear_conv_dim == 8192


def test_nested_and_bare_configs_agree():
    text = ModelConfig(num_layers=8).to_hf_text_config()
    nested = parse_hf_config({"model_type": "qwen3_5_moe", "text_config": text})
    bare = parse_hf_config(text)
    assert nested == bare == ModelConfig(num_layers=8)


def test_hf_round_trip():
    cfg = ModelConfig(hidden_size=256, num_experts=64, eos_token_ids=(1, 2))
    assert parse_hf_config(cfg.to_hf_config()) == cfg


def test_unknown_model_type():
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        parse_hf_config({"model_type": "llama"})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries"),
        ({"layer_types": ["mamba"] * 40}, "unknown layer types"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"linear_num_value_heads": 24}, "multiple of linear_num_key_heads"),
        ({"num_experts_per_tok": 300}, "exceeds num_experts"),
        ({"hidden_size": 0}, "hidden_size must be positive"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"vocab_size": "many"}, "malformed config"),
    ],
)
def test_inconsistent_configs(change, message):
    text = ModelConfig().to_hf_text_config() | change
    with pytest.raises(ConfigError, match=message):
        parse_hf_config(text)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe_text"}))
    assert load_model_config(tmp_path) == ModelConfig()
