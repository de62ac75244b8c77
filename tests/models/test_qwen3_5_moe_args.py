"""ModelArgs of Qwen3.5/3.6 MoE parsed from HF config dicts, against HF 5.17's own configs."""

import json

import pytest
import torch

from sparrow.config import ConfigError
from sparrow.layers.rotary import YarnScaling
from sparrow.models import load_model_args, model_args_from_hf
from sparrow.models.qwen3_5_moe import ModelArgs


def test_default_is_35b_a3b():
    cfg = ModelArgs()
    assert cfg.layer_types.count("full_attention") == 10
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"][:2] == [3, 7]
    assert cfg.rotary_dim == 64 and cfg.linear_conv_dim == 8192


def test_nested_and_bare_configs_agree():
    text = ModelArgs(num_layers=8).to_hf_text_config()
    nested = model_args_from_hf({"model_type": "qwen3_5_moe", "text_config": text})
    bare = model_args_from_hf(text)
    assert nested == bare == ModelArgs(num_layers=8)


def test_hf_round_trip():
    cfg = ModelArgs(hidden_size=256, num_experts=64, eos_token_ids=(1, 2))
    assert model_args_from_hf(cfg.to_hf_config()) == cfg


def test_unknown_model_type():
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        model_args_from_hf({"model_type": "llama"})


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
    text = ModelArgs().to_hf_text_config() | change
    with pytest.raises(ConfigError, match=message):
        model_args_from_hf(text)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_args(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_args(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe_text"}))
    # keys left out take HF's defaults, which differ from the released checkpoint's here
    assert load_model_args(tmp_path) == ModelArgs(
        rope_theta=10_000.0, max_position_embeddings=32768
    )


@pytest.mark.parametrize("head_dim, factor", [(48, 0.25), (24, 0.5), (256, 0.25)])
def test_hf_configs_without_mrope_section_load(head_dim, factor):
    """HF writes rope_parameters without mrope_section; it defaults to [11, 11, 10] and is
    sliced to the rotary width (6 frequencies for head_dim 48), so such configs must load
    and rotate text exactly like HF."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeTextRotaryEmbedding,
    )

    from sparrow.layers.rotary import RotaryEmbedding

    hf = Qwen3_5MoeTextConfig(
        head_dim=head_dim,
        num_hidden_layers=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": factor,
        },
    )
    raw = json.loads(hf.to_json_string())
    assert "mrope_section" not in raw["rope_parameters"]
    args = model_args_from_hf(raw)
    assert args.rotary_dim == int(head_dim * factor) and args.rope_theta == 1e6
    positions = torch.arange(37)
    ours = RotaryEmbedding(args.rotary_dim, args.rope_theta, args.mrope_section)
    cos, sin = ours.cos_sin(positions, torch.float32)
    want_cos, want_sin = Qwen3_5MoeTextRotaryEmbedding(hf)(
        torch.zeros(1, dtype=torch.float32), positions.expand(3, 1, -1)
    )
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=0)


def test_full_attention_interval_lays_out_layers():
    raw = ModelArgs(num_layers=6).to_hf_text_config()
    del raw["layer_types"]
    raw["full_attention_interval"] = 3
    assert (
        model_args_from_hf(raw).layer_types
        == ("linear_attention", "linear_attention", "full_attention") * 2
    )


def _yarn_text(**rope) -> dict:
    text = ModelArgs().to_hf_text_config()
    text["rope_parameters"] |= {"rope_type": "yarn"} | rope
    return text


def test_yarn_parses_with_hf_defaults():
    """Qwen3.6's 1M recipe: factor 4 over the native 262,144 positions."""
    args = model_args_from_hf(_yarn_text(factor=4.0, original_max_position_embeddings=262144))
    assert args.rope_scaling == YarnScaling(4.0, 262144)
    yarn = args.rope_scaling
    assert (yarn.beta_fast, yarn.beta_slow, yarn.truncate) == (32.0, 1.0, True)
    assert yarn.mscale is yarn.mscale_all_dim is yarn.attention_factor is None
    assert args.max_position_embeddings == 262144 and args.max_context == 1_048_576
    assert ModelArgs().max_context == 262144


def test_yarn_round_trips_through_hf_configs():
    from transformers import Qwen3_5MoeConfig

    yarn = YarnScaling(
        3.0,
        64,
        beta_fast=8.0,
        beta_slow=2.0,
        mscale=0.7,
        mscale_all_dim=0.3,
        attention_factor=1.2,
        truncate=False,
    )
    cfg = ModelArgs(num_layers=4, max_position_embeddings=192, rope_scaling=yarn)
    assert model_args_from_hf(cfg.to_hf_config()) == cfg
    hf = Qwen3_5MoeConfig(**cfg.to_hf_config())  # HF reads the same keys back
    assert model_args_from_hf(json.loads(hf.to_json_string())) == cfg


@pytest.mark.parametrize(
    "rope, text, expected",
    [
        # original_max_position_embeddings left out: HF takes max_position_embeddings
        ({"factor": 2.0}, {}, YarnScaling(2.0, 262144)),
        # a null factor: max_position_embeddings / original
        ({"factor": None, "original_max_position_embeddings": 65536}, {}, YarnScaling(4.0, 65536)),
        # 0 or null betas take HF's 32 and 1
        (
            {
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 0,
                "beta_slow": None,
            },
            {},
            YarnScaling(2.0, 64),
        ),
        # a text-config original_max_position_embeddings wins over rope_parameters' (HF)
        (
            {"factor": 2.0, "original_max_position_embeddings": 64},
            {"original_max_position_embeddings": 128},
            YarnScaling(2.0, 128),
        ),
    ],
)
def test_yarn_fills_what_hf_fills(rope, text, expected):
    assert model_args_from_hf(_yarn_text(**rope) | text).rope_scaling == expected


def test_legacy_rope_scaling_block():
    """HF reads `rope_scaling` (with `type`) in place of rope_parameters; rope_theta and
    partial_rotary_factor may then sit in the text config."""
    text = ModelArgs().to_hf_text_config()
    del text["rope_parameters"]
    text |= {
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        "rope_theta": 5e5,
        "partial_rotary_factor": 0.5,
    }
    args = model_args_from_hf(text)
    assert args.rope_scaling == YarnScaling(4.0, 4096)
    assert (args.rope_theta, args.partial_rotary_factor) == (5e5, 0.5)


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "linear", "factor": 2.0}, "rope_type 'linear' is not supported"),
        ({"rope_type": "longrope"}, r"expected one of 'default', 'yarn'"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "need a 'factor'"),
        ({"rope_type": "yarn", "factor": "big"}, "malformed config"),
        ({"rope_type": "yarn", "factor": 0}, "factor > 0"),
    ],
)
def test_bad_rope_parameters(rope, message):
    text = ModelArgs().to_hf_text_config()
    text["rope_parameters"] |= rope
    with pytest.raises(ConfigError, match=message):
        model_args_from_hf(text)
