"""The rotary tables against HF 5.17's `Qwen3_5MoeTextRotaryEmbedding`, bit for bit: plain
RoPE and YaRN (every optional key), partial rotary widths, positions up to 1,010,000."""

import json

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

from sparrow.layers.rotary import RotaryEmbedding
from sparrow.models import model_args_from_hf

YARN = {
    "qwen-1m": {"factor": 4.0, "original_max_position_embeddings": 262144},
    "small-original": {"factor": 4, "original_max_position_embeddings": 64},
    "factor-null": {"factor": None, "original_max_position_embeddings": 100},
    "mscales-untruncated": {
        "factor": 3.5,
        "original_max_position_embeddings": 64,
        "mscale": 0.7,
        "mscale_all_dim": 0.3,
        "truncate": False,
        "beta_fast": 8,
        "beta_slow": 2,
    },
    "attention-factor": {
        "factor": 2.0,
        "original_max_position_embeddings": 48,
        "attention_factor": 0.9,
        "beta_fast": 0,
    },
    "no-original": {"factor": 8.0},
}
# (head_dim, partial_rotary_factor, rope_theta): the real block, and awkward widths.
WIDTHS = [(256, 0.25, 1e7), (48, 0.25, 1e4), (24, 0.5, 5e5), (60, 1.0, 1e6)]


def _pair(rope: dict, head_dim: int, partial: float, theta: float):
    hf = Qwen3_5MoeTextConfig(
        head_dim=head_dim,
        num_hidden_layers=4,
        rope_parameters=rope | {"partial_rotary_factor": partial, "rope_theta": theta},
    )
    args = model_args_from_hf(json.loads(hf.to_json_string()))
    ours = RotaryEmbedding(args.rotary_dim, args.rope_theta, args.mrope_section, args.rope_scaling)
    return ours, Qwen3_5MoeTextRotaryEmbedding(hf)


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"d{w[0]}x{w[1]}")
@pytest.mark.parametrize("name", list(YARN) + ["default"])
def test_cos_sin_match_hf_exactly(name, width):
    rope = {"rope_type": "default"} if name == "default" else {"rope_type": "yarn"} | YARN[name]
    ours, hf = _pair(rope, *width)
    assert torch.equal(ours.inv_freq, hf.inv_freq)
    assert ours.attention_scaling == hf.attention_scaling
    positions = torch.cat([torch.arange(300), torch.arange(300, 1_010_001, 9973)])
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = ours.cos_sin(positions, dtype)
        want_cos, want_sin = hf(torch.zeros(1, dtype=dtype), positions.expand(3, 1, -1))
        torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=0)
        torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=0)


def test_yarn_scales_cos_and_sin():
    """The attention factor multiplies cos and sin (so rotated dims grow by it)."""
    rope = {"rope_type": "yarn"} | YARN["small-original"]
    ours, _ = _pair(rope, 48, 0.25, 1e4)
    cos, sin = ours.cos_sin(torch.arange(1000), torch.float32)
    norm = (cos**2 + sin**2).sqrt()
    torch.testing.assert_close(norm, torch.full_like(norm, ours.attention_scaling))
    assert ours.attention_scaling > 1.1


def test_tables_do_not_grow_with_the_context():
    """cos and sin are computed for the step's positions only: nothing is built for the
    1,010,000 positions of the context."""
    ours, _ = _pair({"rope_type": "yarn"} | YARN["qwen-1m"], 256, 0.25, 1e7)
    cos, _ = ours.cos_sin(torch.tensor([1_009_999]), torch.bfloat16)
    assert cos.shape == (1, 64)
    held = [ours.inv_freq, ours.axis, *(t for pair in ours._tables.values() for t in pair)]
    assert sum(t.numel() for t in held) <= 4 * 32
