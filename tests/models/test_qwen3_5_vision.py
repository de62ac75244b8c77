"""The Qwen3.5/3.6-MoE vision tower in fp32 against HF's `Qwen3_5MoeVisionModel` on the same
weights: one image, three images of different grids, a 2-frame video beside an image, patches
from `sparrow.multimodal`, a checkpoint written by `save_pretrained`; bad configs, inputs
and checkpoints fail with errors naming what is wrong.

The tiny tower has 3 heads of 20, an MLP of 52 and a 6x6 position table, so grids both
smaller and larger than the table resample it; all parameters are redrawn (`randomize`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeVisionConfig,
    Qwen3_5MoeVisionModel,
)

from sparrow.config import ConfigError
from sparrow.loader.vision import load_vision_checkpoint, load_vision_tensors
from sparrow.loader.weights import CheckpointError
from sparrow.models.vision import qwen3_5_vision
from sparrow.models.vision.qwen3_5_vision import Qwen3_5VisionArgs
from sparrow.multimodal import ImageSpec, preprocess_image
from tests.conftest import randomize, rel_err

TOL = 1e-4
# fmt: off
VISION = dict(depth=2, hidden_size=60, intermediate_size=52, num_heads=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=44,
              num_position_embeddings=36)
TEXT = dict(vocab_size=64, hidden_size=44, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
            shared_expert_intermediate_size=8, layer_types=["full_attention"])
# fmt: on
CONFIG = {"model_type": "qwen3_5_moe", "vision_config": VISION}
PATCH_DIM = 3 * 2 * 4 * 4


def hf_tower(seed: int = 0) -> Qwen3_5MoeVisionModel:
    torch.manual_seed(seed)
    hf = Qwen3_5MoeVisionModel(Qwen3_5MoeVisionConfig(**VISION)).eval()
    randomize(hf, seed)
    return hf


def ours_from(hf: torch.nn.Module) -> torch.nn.Module:
    return load_vision_tensors(CONFIG, {f"model.visual.{k}": v for k, v in hf.state_dict().items()})


@pytest.fixture(scope="module")
def towers():
    hf = hf_tower()
    return hf, ours_from(hf)


def patches_for(grids: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, ...]:
    rows = sum(t * h * w for t, h, w in grids)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, PATCH_DIM, generator=g), torch.tensor(grids)


@torch.no_grad()
def hf_tokens(hf: torch.nn.Module, patches: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return hf(patches, grid_thw=grid).pooler_output


def hf_values(config: Qwen3_5MoeVisionConfig) -> dict:
    """The HF config's values of the Qwen3_5VisionArgs fields."""
    values = {f.name: getattr(config, f.name, None) for f in dataclasses.fields(Qwen3_5VisionArgs)}
    return values | {"rope_theta": config.rope_parameters["rope_theta"]}


def test_args_follow_hf_config():
    args = Qwen3_5VisionArgs.from_hf(CONFIG)
    assert dataclasses.asdict(args) == hf_values(Qwen3_5MoeVisionConfig(**VISION))
    # Keys a config leaves out take HF's defaults; those are the checkpoint's but for the
    # output width (3584 in HF, the text width 2048 in the checkpoint).
    defaults = Qwen3_5VisionArgs.from_hf({"model_type": "qwen3_5_moe"})
    assert dataclasses.asdict(defaults) == hf_values(Qwen3_5MoeVisionConfig())
    assert dataclasses.replace(defaults, out_hidden_size=2048) == Qwen3_5VisionArgs()


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 6)],
        [(1, 4, 6), (1, 10, 8), (1, 2, 14)],
        [(2, 6, 4), (1, 8, 8)],
    ],
    ids=["one image", "three images", "video and image"],
)
@torch.no_grad()
def test_matches_hf(towers, grids):
    hf, ours = towers
    patches, grid = patches_for(grids, seed=len(grids))
    got = ours(patches, grid)
    assert got.shape == (patches.shape[0] // 4, VISION["out_hidden_size"])
    assert rel_err(got, hf_tokens(hf, patches, grid)) < TOL


@torch.no_grad()
def test_attention_stays_within_each_frame(towers):
    """Three grids in one call give each grid's tokens alone, frames of a video included."""
    _, ours = towers
    grids = [(2, 6, 4), (1, 4, 6), (1, 2, 2)]
    patches, grid = patches_for(grids, seed=5)
    together = ours(patches, grid)
    alone, start = [], 0
    for t, h, w in grids:
        alone.append(ours(patches[start : start + t * h * w], torch.tensor([[t, h, w]])))
        start += t * h * w
    assert rel_err(together, torch.cat(alone)) < 1e-5
    # Frame 1 of the video alone equals its half of the video's output.
    video = ours(patches[:48], torch.tensor([[2, 6, 4]]))
    frame = ours(patches[24:48], torch.tensor([[1, 6, 4]]))
    assert rel_err(video[6:], frame) < 1e-5


@torch.no_grad()
def test_patches_from_the_multimodal_pipeline(towers):
    hf, ours = towers
    spec = ImageSpec(
        patch_size=4,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=64,
        max_pixels=48 * 48,
        image_mean=(0.5,) * 3,
        image_std=(0.5,) * 3,
        image_token_id=1,
        start_token_id=2,
        end_token_id=3,
    )
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in ((37, 50), (20, 20))
    ]
    processed = [preprocess_image(image, spec) for image in images]
    patches = torch.cat([p.pixel_values for p in processed])
    grid = torch.tensor([p.grid_thw for p in processed])
    got = ours(patches, grid)
    assert got.shape[0] == sum(p.num_tokens for p in processed)
    assert rel_err(got, hf_tokens(hf, patches, grid)) < TOL


@torch.no_grad()
def test_loads_a_save_pretrained_checkpoint(tmp_path):
    torch.manual_seed(0)
    hf = Qwen3_5MoeForConditionalGeneration(
        Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION)
    ).eval()
    randomize(hf.model.visual, 1)
    hf.save_pretrained(tmp_path)
    ours = load_vision_checkpoint(tmp_path)
    patches, grid = patches_for([(1, 6, 8), (2, 4, 4)], seed=7)
    assert rel_err(ours(patches, grid), hf_tokens(hf.model.visual, patches, grid)) < TOL


def test_checkpoint_names():
    name = qwen3_5_vision.checkpoint_name
    assert name("model.visual.blocks.1.attn.qkv.weight") == "blocks.1.attn.qkv.weight"
    assert name("visual.pos_embed.weight") == "pos_embed.weight"
    for other in ("model.language_model.embed_tokens.weight", "mtp.fc.weight", "lm_head.weight"):
        assert name(other) is None


def test_bad_state_dicts_name_the_tensor(towers):
    hf, _ = towers
    good = {f"model.visual.{k}": v for k, v in hf.state_dict().items()}
    good["model.language_model.norm.weight"] = torch.ones(3)  # not the tower's: skipped
    load_vision_tensors(CONFIG, good)
    qkv = "model.visual.blocks.1.attn.qkv.weight"
    cases = [
        ({qkv: torch.zeros(180, 59)}, rf"'{qkv}' has shape \[180, 59\], expected \[180, 60\]"),
        ({"model.visual.deepstack_merger_list.0.norm.weight": torch.ones(60)}, "does not belong"),
        ({qkv: torch.zeros(180, 60, dtype=torch.int32)}, "dtype torch.int32"),
        ({"visual.pos_embed.weight": torch.ones(36, 60)}, "already filled"),
    ]
    for change, message in cases:
        with pytest.raises(CheckpointError, match=message):
            load_vision_tensors(CONFIG, good | change)
    del good["model.visual.merger.linear_fc2.bias"]
    with pytest.raises(CheckpointError, match=r"merger.linear_fc2.bias \(expected shape \[44\]"):
        load_vision_tensors(CONFIG, good)


def test_bad_inputs_and_configs(towers):
    _, ours = towers
    patches, grid = patches_for([(1, 4, 6)], seed=0)
    with pytest.raises(ValueError, match=r"expected \[24, 96\]"):
        ours(patches[:-1], grid)
    with pytest.raises(ValueError, match="multiples of the merge size 2"):
        ours(patches[:20], torch.tensor([[1, 4, 5]]))
    bad = [
        ({"num_heads": 4}, "head dim 15 must be a multiple of 4"),
        ({"num_position_embeddings": 40}, "not a square"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"patch_size": [4, 4]}, "patch_size must be a positive integer"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message):
            Qwen3_5VisionArgs.from_hf({"vision_config": VISION | change})
