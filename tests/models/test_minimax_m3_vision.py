"""The MiniMax M3 vision tower + projector in fp32 against HF's
`MiniMaxM3SparseForConditionalGeneration.model.get_image_features` on the same weights: one
image, three images of different grids, a 2-frame video beside an image; weights from the
in-memory state dict (HF names) and from a `save_pretrained` checkpoint (the original
MiniMax names HF writes). Pins HF 5.17's RoPE axes and its attention over the whole call.

The tiny tower has 3 heads of 20 and an MLP of 52; all parameters are redrawn."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    MiniMaxM3SparseForConditionalGeneration,
    MiniMaxM3VLConfig,
)
from transformers.vision_utils import get_vision_position_ids

from sparrow.loader.vision import load_vision_checkpoint, load_vision_tensors
from sparrow.models.vision import minimax_m3_vision
from sparrow.models.vision.common import axial_rotary, grids_of, patch_positions
from sparrow.models.vision.minimax_m3_vision import MiniMaxM3VisionArgs
from tests.conftest import randomize, rel_err

TOL = 1e-4
# fmt: off
VISION = dict(num_hidden_layers=2, hidden_size=60, intermediate_size=52, num_attention_heads=3,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
TEXT = dict(vocab_size=64, hidden_size=36, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, index_n_heads=1, index_head_dim=8,
            num_local_experts=2, num_experts_per_tok=1, intermediate_size=8,
            dense_intermediate_size=8, shared_intermediate_size=8, bos_token_id=1,
            eos_token_id=2)
# fmt: on
CONFIG = {
    "model_type": "minimax_m3_vl",
    "vision_config": VISION,
    "text_config": TEXT,
    "projector_hidden_size": 44,
}
PATCH_DIM = 3 * 2 * 4 * 4


@pytest.fixture(scope="module")
def models():
    """(HF VL model, ours from its in-memory state dict)."""
    torch.manual_seed(0)
    config = MiniMaxM3VLConfig(text_config=TEXT, vision_config=VISION, projector_hidden_size=44)
    hf = MiniMaxM3SparseForConditionalGeneration(config).eval()
    randomize(hf.model.vision_tower, 1)
    randomize(hf.model.multi_modal_projector, 2)
    return hf, load_vision_tensors(CONFIG, hf.state_dict())


def patches_for(grids: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, ...]:
    rows = sum(t * h * w for t, h, w in grids)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, PATCH_DIM, generator=g), torch.tensor(grids)


@torch.no_grad()
def hf_tokens(hf: torch.nn.Module, patches: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return hf.model.get_image_features(pixel_values=patches, image_grid_thw=grid).pooler_output


def hf_values(config: MiniMaxM3VLConfig) -> dict:
    """The HF config's values of the MiniMaxM3VisionArgs fields."""
    v = config.vision_config
    return dict(
        num_layers=v.num_hidden_layers,
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_heads=v.num_attention_heads,
        hidden_act=v.hidden_act,
        num_channels=v.num_channels,
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        spatial_merge_size=v.spatial_merge_size,
        layer_norm_eps=v.layer_norm_eps,
        rope_theta=v.rope_parameters["rope_theta"],
        projector_hidden_size=config.projector_hidden_size,
        text_hidden_size=config.text_config.hidden_size,
    )


def test_args_follow_hf_config():
    args = MiniMaxM3VisionArgs.from_hf(CONFIG)
    hf = MiniMaxM3VLConfig(text_config=TEXT, vision_config=VISION, projector_hidden_size=44)
    assert dataclasses.asdict(args) == hf_values(hf)
    defaults = MiniMaxM3VisionArgs.from_hf({"model_type": "minimax_m3_vl"})
    assert defaults == MiniMaxM3VisionArgs()
    assert dataclasses.asdict(defaults) == hf_values(MiniMaxM3VLConfig())
    assert defaults.head_dim == 80


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
def test_matches_hf(models, grids):
    hf, ours = models
    patches, grid = patches_for(grids, seed=len(grids))
    got = ours(patches, grid)
    assert got.shape == (patches.shape[0] // 4, TEXT["hidden_size"])
    assert rel_err(got, hf_tokens(hf, patches, grid)) < TOL


@torch.no_grad()
def test_rotary_is_hfs_frame_and_row(models):
    """HF's position ids are (frame, row, col); its rotary uses the first two only."""
    hf, _ = models
    grid = torch.tensor([[2, 4, 6], [1, 6, 2]])
    hf_positions = get_vision_position_ids(grid, 2, include_temporal=True)
    positions = patch_positions(grids_of(grid, 2), 2)
    assert torch.equal(positions, hf_positions)
    hf_cos, hf_sin = hf.model.vision_tower.rotary_emb(torch.zeros(1), hf_positions)
    cos, sin = axial_rotary(positions[:, 0], positions[:, 1], 20, 10_000.0)
    assert cos.shape == (positions.shape[0], 20)  # the whole head
    assert rel_err(cos, hf_cos) < 1e-6 and rel_err(sin, hf_sin) < 1e-6
    # Patches 0 and 1 share frame and row, not column: the same angles.
    assert torch.equal(positions[:2, :2], torch.zeros(2, 2, dtype=torch.long))
    assert torch.equal(hf_cos[0], hf_cos[1]) and not torch.equal(hf_cos[0], hf_cos[2])


@torch.no_grad()
def test_attention_spans_the_call(models):
    """As in HF, an image's tokens change when another image is passed with it."""
    hf, ours = models
    patches, grid = patches_for([(1, 4, 6), (1, 6, 6)], seed=3)
    alone = ours(patches[:24], grid[:1])
    together = ours(patches, grid)[:6]
    assert rel_err(together, alone) > 1e-2
    assert rel_err(hf_tokens(hf, patches, grid)[:6], together) < TOL


@torch.no_grad()
def test_loads_a_save_pretrained_checkpoint(models, tmp_path):
    hf, _ = models
    hf.save_pretrained(tmp_path)
    ours = load_vision_checkpoint(tmp_path)
    patches, grid = patches_for([(1, 6, 8), (2, 4, 4)], seed=7)
    assert rel_err(ours(patches, grid), hf_tokens(hf, patches, grid)) < TOL


def test_checkpoint_names():
    name = minimax_m3_vision.checkpoint_name
    layer = "vision_tower.vision_model.encoder.layers.3"
    pairs = {
        "vision_tower.vision_model.embeddings.patch_embedding.weight": (
            "vision_tower.embeddings.proj.weight"
        ),
        "vision_tower.vision_model.pre_layrnorm.bias": "vision_tower.pre_layrnorm.bias",
        f"{layer}.block_sparse_moe.fc1.weight": "vision_tower.layers.3.mlp.fc1.weight",
        f"{layer}.mlp.fc2.bias": "vision_tower.layers.3.mlp.fc2.bias",
        f"{layer}.self_attn.out_proj.weight": "vision_tower.layers.3.self_attn.out_proj.weight",
        "multi_modal_projector.linear_2.weight": "multi_modal_projector.linear_2.weight",
        "patch_merge_mlp.linear_1.bias": "multi_modal_projector.merge_linear_1.bias",
        "model.vision_tower.layers.0.layer_norm1.weight": (
            "vision_tower.layers.0.layer_norm1.weight"
        ),
        "model.multi_modal_projector.merge_linear_2.weight": (
            "multi_modal_projector.merge_linear_2.weight"
        ),
    }
    for checkpoint, ours in pairs.items():
        assert name(checkpoint) == ours, checkpoint
    for other in (
        "language_model.model.layers.0.block_sparse_moe.gate.weight",
        "model.language_model.embed_tokens.weight",
        "lm_head.weight",
    ):
        assert name(other) is None
