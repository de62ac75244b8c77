"""Qwen3.5/3.6 mRoPE positions of prompts with images and videos against HF 5.17's
`get_rope_index` (the model's own method, on a tiny config)."""

import pytest
import torch
from transformers import Qwen3_5MoeConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel

from sparrow.layers.rotary import mrope_positions

IMAGE, VIDEO = 1, 2


def hf_positions(types: list[int], images: list, videos: list) -> tuple[torch.Tensor, int]:
    config = Qwen3_5MoeConfig()
    this = type("M", (), {"config": config})()  # get_rope_index reads config and one method
    this.get_vision_position_ids = Qwen3_5MoeModel.get_vision_position_ids.__get__(this)
    ids = torch.zeros(1, len(types), dtype=torch.long)
    pos, delta = Qwen3_5MoeModel.get_rope_index(
        this,
        ids,
        torch.tensor([types]),
        torch.tensor(images) if images else None,
        torch.tensor(videos) if videos else None,
    )
    return pos[:, 0], int(delta)


def layout(parts: list) -> tuple[list[int], list, list, list]:
    """parts: ints (text tokens) or ("image"|"video", (t, h, w)); a video's frames are split
    by 3 text tokens (timestamp, end, start) as the processor writes them."""
    types, images, videos, runs = [], [], [], []
    for part in parts:
        if isinstance(part, int):
            types += [0] * part
            continue
        kind, (t, h, w) = part
        per_frame = h * w // 4
        (images if kind == "image" else videos).append([t, h, w])
        for frame in range(t if kind == "video" else 1):
            if frame:
                types += [0] * 3
            runs.append((len(types), (1 if kind == "video" else t, h, w)))
            types += [IMAGE if kind == "image" else VIDEO] * (
                per_frame * (1 if kind == "video" else t)
            )
    return types, images, videos, runs


@pytest.mark.parametrize(
    "parts",
    [
        [7],
        [3, ("image", (1, 4, 6)), 5],
        [("image", (1, 6, 2)), 2, ("image", (1, 2, 2)), 4],
        [2, ("video", (3, 4, 4)), 3, ("image", (1, 8, 4)), 1],
        [1, ("video", (2, 2, 6))],
    ],
)
def test_positions_equal_hf(parts):
    types, images, videos, runs = layout(parts)
    ref, ref_delta = hf_positions(types, images, videos)
    ours, delta = mrope_positions(len(types), runs, merge=2)
    assert torch.equal(ours, ref) and delta == ref_delta


def test_overlapping_runs_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        mrope_positions(20, [(2, (1, 4, 4)), (4, (1, 4, 4))], merge=2)
    with pytest.raises(ValueError, match="passes"):
        mrope_positions(5, [(2, (1, 4, 4))], merge=2)
