"""Media through the engine, the tower stood in by a fixed function: the placeholder rows take
its embeddings, Qwen's mRoPE positions follow HF's `get_rope_index` through prefill chunks
and decode (CUDA-graph decode included on a GPU), and the greedy tokens equal HF's fed the
same embeddings and positions (fp32)."""

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.layers.rotary import mrope_positions
from sparrow.loader.random_checkpoint import random_model
from sparrow.loader.weights import load_tensors
from sparrow.models.qwen3_5_moe import ModelArgs
from sparrow.multimodal.items import MediaItem

pytestmark = pytest.mark.usefixtures("hf_gdn_in_pytorch")

CFG = ModelArgs(
    vocab_size=300,
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mrope_section=(2, 1, 1),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    initializer_range=0.1,
)
PAD = 7
STEPS = 6


def fake_tower(pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
    """[patches, dim] -> [patches / 4, hidden]: a fixed function of the pixels."""
    merged = pixel_values.reshape(-1, 4 * pixel_values.shape[1])
    weight = torch.linspace(-1, 1, merged.shape[1] * CFG.hidden_size).reshape(merged.shape[1], -1)
    return torch.tanh(merged @ weight.to(merged)) * 0.5


def media_prompt():
    """Text, an image (grid 1 x 4 x 6: 6 tokens), text, a 2-frame video (grid 2 x 4 x 4: 4
    tokens a frame, 3 text tokens between the frames), text."""
    gen = torch.Generator().manual_seed(0)
    text = [int(x) for x in torch.randint(10, 300, (30,), generator=gen)]
    prompt = text[:5] + [PAD] * 6 + text[5:12] + [PAD] * 4 + text[12:15] + [PAD] * 4 + text[15:]
    image = MediaItem((5,), torch.randn(24, 8, generator=gen), (1, 4, 6), "img")
    video = MediaItem((18, 25), torch.randn(32, 8, generator=gen), (2, 4, 4), "vid", video=True)
    return prompt, [image, video]


class FakeTower(torch.nn.Module):
    """`fake_tower` as a module: where the engine expects `model.visual`."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)  # its dtype

    def forward(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return fake_tower(pixels.cpu(), grid).to(pixels.device)


@torch.no_grad()
def hf_greedy(hf, prompt, items, steps):
    embeds = hf.model.embed_tokens(torch.tensor([prompt]))
    for item in items:
        out = fake_tower(item.pixel_values, item.grid_thw)
        per_run = out.shape[0] // len(item.runs)
        for r, start in enumerate(item.runs):
            embeds[0, start : start + per_run] = out[r * per_run : (r + 1) * per_run]
    runs = [r for item in items for r in item.run_grids()]
    positions, delta = mrope_positions(len(prompt), runs, 2)
    out = hf(inputs_embeds=embeds, position_ids=positions[:, None], use_cache=True)
    tokens, cache = [int(out.logits[0, -1].argmax())], out.past_key_values
    for i in range(steps - 1):
        pos = torch.full((3, 1, 1), len(prompt) + i + delta)
        out = hf(
            torch.tensor([[tokens[-1]]]), position_ids=pos, past_key_values=cache, use_cache=True
        )
        tokens.append(int(out.logits[0, -1].argmax()))
        cache = out.past_key_values
    return tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_media_embeddings_and_positions_match_hf(device):
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**CFG.to_hf_text_config())).eval()
    prompt, items = media_prompt()
    expected = hf_greedy(hf, prompt, items, STEPS)
    model = load_tensors(CFG, hf.state_dict(), device, torch.float32, where="HF state dict")
    model.visual = FakeTower()
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    for chunk in (64, 8):  # whole prompt; chunks that split the image and the video
        llm = LLM(
            model,
            max_model_len=128,
            block_size=16,
            num_blocks=32,
            max_num_batched_tokens=chunk,
            enable_prefix_caching=False,
        )
        request = llm.add_request(prompt, params, media=items)
        assert [s.length for s in request.media] == [6, 11]
        out = {}
        while llm.has_unfinished():
            for o in llm.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert out[request.request_id] == expected, f"chunk {chunk}"
        assert not llm.runner.media.requests  # freed with the request


def test_text_only_models_refuse_media():
    llm = LLM(
        random_model(CFG, 0, "cpu", torch.float32), max_model_len=64, block_size=16, num_blocks=8
    )
    prompt, items = media_prompt()
    with pytest.raises(ValueError, match="no vision tower"):
        llm.add_request(prompt, SamplingParams(max_tokens=2), media=items)
