"""MiniMax M3 with an image through `LLM` on a checkpoint written by HF's
`MiniMaxM3SparseForConditionalGeneration.save_pretrained` (tower and projector attached on
load): greedy tokens equal HF's `generate` on the same pixels, grid and token ids (fp32,
CPU), for one image and for two (HF's tower attends across all the images of a call: the
engine encodes a prompt's media together for M3)."""

from __future__ import annotations

import pytest
import torch
from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.multimodal.items import MediaItem
from tests.conftest import randomize

IMAGE_ID, START, END = 60, 61, 62
STEPS = 5
# fmt: off
VISION = dict(num_hidden_layers=2, hidden_size=60, intermediate_size=52, num_attention_heads=3,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
TEXT = dict(vocab_size=64, hidden_size=36, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, index_n_heads=1, index_head_dim=8,
            index_block_size=4, index_topk_blocks=2, num_local_experts=4, num_experts_per_tok=2,
            intermediate_size=8, dense_intermediate_size=16, shared_intermediate_size=8,
            layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
            mlp_layer_types=["dense", "sparse", "sparse"], initializer_range=0.1,
            bos_token_id=1, eos_token_id=2)
# fmt: on


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = MiniMaxM3VLConfig(
        text_config=TEXT, vision_config=VISION, projector_hidden_size=44, image_token_index=IMAGE_ID
    )
    hf = MiniMaxM3SparseForConditionalGeneration(config).eval()
    randomize(hf.model.vision_tower, 1)
    randomize(hf.model.multi_modal_projector, 2)
    path = tmp_path_factory.mktemp("m3vl")
    hf.save_pretrained(path)
    return path, hf


def run_both(checkpoint, prompt, pixels, grids, runs):
    path, hf = checkpoint
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            pixel_values=torch.cat(pixels),
            image_grid_thw=torch.tensor(grids),
            max_new_tokens=STEPS,
            do_sample=False,
        )[0, len(prompt) :].tolist()
    llm = LLM(
        model=str(path),
        device="cpu",
        dtype=torch.float32,
        max_model_len=256,
        num_blocks=128,
        max_num_batched_tokens=16,
    )
    assert llm.info().media
    media = [MediaItem((r,), p, g, f"img{r}") for r, p, g in zip(runs, pixels, grids, strict=True)]
    request = llm.add_request(
        prompt, SamplingParams(max_tokens=STEPS, ignore_eos=True), media=media
    )
    # every cached block of the prompt depends on all its images: one key for all of them
    assert {s.digest for s in request.media} == {"+".join(m.digest for m in media)}
    out = []
    while llm.has_unfinished():
        out += [
            t for o in llm.step() if o.request_id == request.request_id for t in o.new_token_ids
        ]
    return out, ref


def patches(grid, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(grid[1] * grid[2], 3 * 2 * 4 * 4, generator=gen)


def test_image_prompts_equal_hf(checkpoint):
    a, b = (1, 6, 8), (1, 4, 4)
    one = [5, 9, START] + [IMAGE_ID] * 12 + [END] + list(range(20, 40))
    ours, ref = run_both(checkpoint, one, [patches(a, 3)], [a], [3])
    assert ours == ref
    two = one[:16] + [7, START] + [IMAGE_ID] * 4 + [END] + one[16:]
    ours, ref = run_both(checkpoint, two, [patches(a, 3), patches(b, 4)], [a, b], [3, 18])
    assert ours == ref
