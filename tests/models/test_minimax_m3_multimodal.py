"""MiniMax M3 with an image through `LLM` on a checkpoint written by HF's
`MiniMaxM3SparseForConditionalGeneration.save_pretrained` (tower and projector attached on
load): greedy tokens equal HF's `generate` on the same pixels, grid and token ids (fp32,
CPU). One image per prompt: HF's tower attends across all images of a call, the engine
encodes each item on its own."""

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
    config = MiniMaxM3VLConfig(text_config=TEXT, vision_config=VISION, projector_hidden_size=44,
                               image_token_index=IMAGE_ID)  # fmt: skip
    hf = MiniMaxM3SparseForConditionalGeneration(config).eval()
    randomize(hf.model.vision_tower, 1)
    randomize(hf.model.multi_modal_projector, 2)
    path = tmp_path_factory.mktemp("m3vl")
    hf.save_pretrained(path)
    return path, hf


def test_image_prompt_equals_hf(checkpoint):
    path, hf = checkpoint
    grid = (1, 6, 8)
    pixels = torch.randn(6 * 8, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(3))
    n = 6 * 8 // 4
    prompt = [5, 9, START] + [IMAGE_ID] * n + [END] + list(range(20, 40))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), pixel_values=pixels,
                          image_grid_thw=torch.tensor([grid]), max_new_tokens=STEPS,
                          do_sample=False)[0, len(prompt):].tolist()  # fmt: skip
    llm = LLM(model=str(path), device="cpu", dtype=torch.float32, max_model_len=128,
              num_blocks=64)  # fmt: skip
    assert llm.info().media
    request = llm.add_request(prompt, SamplingParams(max_tokens=STEPS, ignore_eos=True),
                              media=[MediaItem((3,), pixels, grid, "img")])  # fmt: skip
    out = []
    while llm.has_unfinished():
        out += [t for o in llm.step() if o.request_id == request.request_id
                for t in o.new_token_ids]  # fmt: skip
    assert out == ref
