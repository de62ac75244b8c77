"""A prompt with an image and one with a video through `LLM` on a checkpoint written by HF's
`Qwen3_5MoeForConditionalGeneration.save_pretrained` (tower attached on load): greedy tokens
equal HF's `generate` on the same pixels, grids and token ids (fp32, CPU)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.multimodal import QWEN3_5_MOE, preprocess_image
from sparrow.multimodal.items import MediaItem
from tests.conftest import randomize

pytestmark = pytest.mark.usefixtures("hf_gdn_in_pytorch")

IMAGE_ID, VIDEO_ID, START, END = 60, 61, 62, 63
VOCAB = 64
STEPS = 5
# fmt: off
VISION = dict(depth=2, hidden_size=60, intermediate_size=52, num_heads=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48,
              num_position_embeddings=36)
TEXT = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
            shared_expert_intermediate_size=8, initializer_range=0.1, eos_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True})
# fmt: on
SPEC = dataclasses.replace(
    QWEN3_5_MOE,
    patch_size=4,
    min_pixels=64,
    max_pixels=4096,
    image_token_id=IMAGE_ID,
    start_token_id=START,
    end_token_id=END,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3_5MoeConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    hf = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    randomize(hf.model.visual, 1)
    path = tmp_path_factory.mktemp("vlm")
    hf.save_pretrained(path)
    return path, hf


def image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def run_both(checkpoint, prompt, items, types, **hf_inputs):
    path, hf = checkpoint
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            mm_token_type_ids=torch.tensor([types]),
            max_new_tokens=STEPS,
            do_sample=False,
            **hf_inputs,
        )
    ref = ref[0, len(prompt) :]
    llm = LLM(
        model=str(path),
        device="cpu",
        dtype=torch.float32,
        max_model_len=256,
        block_size=16,
        num_blocks=32,
    )
    request = llm.add_request(
        prompt, SamplingParams(max_tokens=STEPS, ignore_eos=True), media=items
    )
    out = []
    while llm.has_unfinished():
        out += [
            t for o in llm.step() if o.request_id == request.request_id for t in o.new_token_ids
        ]
    return out, ref.tolist()


def test_image_prompt_equals_hf(checkpoint):
    processed = preprocess_image(image(37, 53, 0), SPEC)
    n = processed.num_tokens
    prompt = [5, 9, START] + [IMAGE_ID] * n + [END, 11, 12, 13]
    types = [1 if t == IMAGE_ID else 0 for t in prompt]
    item = MediaItem((3,), processed.pixel_values, processed.grid_thw, "img")
    ours, ref = run_both(
        checkpoint,
        prompt,
        [item],
        types,
        pixel_values=processed.pixel_values,
        image_grid_thw=torch.tensor([processed.grid_thw]),
    )
    assert ours == ref


def test_video_prompt_equals_hf(checkpoint):
    """Two temporal groups, each after its own timestamp tokens (as the processor writes)."""
    gen = torch.Generator().manual_seed(3)
    grid = (2, 4, 6)
    pixels = torch.randn(2 * 4 * 6, 3 * 2 * 4 * 4, generator=gen)
    per_frame = 4 * 6 // 4
    prompt = (
        [5, 20, 21, START]
        + [VIDEO_ID] * per_frame
        + [END, 22, 23, START]
        + [VIDEO_ID] * per_frame
        + [END, 11, 12]
    )
    types = [2 if t == VIDEO_ID else 0 for t in prompt]
    item = MediaItem((4, 4 + per_frame + 4), pixels, grid, "vid", video=True)
    ours, ref = run_both(
        checkpoint,
        prompt,
        [item],
        types,
        pixel_values_videos=pixels,
        video_grid_thw=torch.tensor([grid]),
    )
    assert ours == ref
