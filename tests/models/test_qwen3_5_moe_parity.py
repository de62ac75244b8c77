"""Logits parity with the HF oracle (transformers.Qwen3_5MoeForCausalLM), fp32 on CPU."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from sparrow.loader.random_checkpoint import write_random_checkpoint
from sparrow.loader.weights import load_checkpoint
from sparrow.models.qwen3_5_moe import ModelArgs
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err

pytestmark = pytest.mark.usefixtures("hf_gdn_in_pytorch")

TOL = 1e-4
DECODE_STEPS = 8

# Small, but every mechanism of the real model: GQA 2:1, partial mRoPE, GDN with 2 v-heads
# per k-head, top-4 of 16 experts, and a layer_types list that is not the default pattern.
SMALL = ModelArgs(
    vocab_size=300,
    hidden_size=64,
    num_layers=5,
    layer_types=(
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ),
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mrope_section=(2, 1, 1),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    # Larger init than HF's default 0.02 so every layer moves the logits measurably.
    cfg = SMALL.replace(initializer_range=0.1)
    return write_random_checkpoint(
        path, cfg, seed=1, dtype=torch.float32, tokenizer=False, progress=False
    )


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def models(request, checkpoint):
    """(ours, HF, device): both in fp32 from the same checkpoint."""
    device = request.param
    if device == "cuda":  # cuDNN convs default to TF32; the tolerance is for fp32
        torch.backends.cudnn.allow_tf32 = False
    ours = load_checkpoint(checkpoint, device, torch.float32, progress=False)
    hf_cfg = Qwen3_5MoeTextConfig(**ours.config.to_hf_text_config())
    hf = Qwen3_5MoeForCausalLM(hf_cfg).eval()
    weights = load_file(str(checkpoint / "model.safetensors"))
    weights = {k.replace("model.language_model.", "model."): v for k, v in weights.items()}
    hf.load_state_dict(weights, strict=True)
    return ours, hf.to(device), device


def _hf_run(hf, prompt, decode_tokens, device):
    """Prefill logits [L, V] and the logits of each teacher-forced decode step [N, V]."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt], device=device), use_cache=True)
        steps, cache = [], out.past_key_values
        for tok in decode_tokens:
            step = hf(torch.tensor([[tok]], device=device), past_key_values=cache, use_cache=True)
            steps.append(step.logits[0, -1])
            cache = step.past_key_values
    return out.logits[0], torch.stack(steps)


@pytest.mark.parametrize("lengths", [(37, 64), (130, 1)])
def test_batched_prefill_and_decode_match_hf(models, lengths):
    ours, hf, device = models
    gen = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    decode = torch.randint(0, SMALL.vocab_size, (DECODE_STEPS, len(lengths)), generator=gen)
    decode = decode.to(device)

    batch = SequenceBatch(ours, len(prompts), max(lengths) + DECODE_STEPS)
    with torch.no_grad():
        prefill = ours.logits(batch.forward(prompts)).split(list(lengths))
        steps = [ours.logits(batch.forward(decode[i, :, None])) for i in range(DECODE_STEPS)]

    for b, prompt in enumerate(prompts):
        hf_prefill, hf_steps = _hf_run(hf, prompt, decode[:, b].tolist(), device)
        err = rel_err(prefill[b], hf_prefill)
        assert err < TOL, f"prefill of sequence {b}: rel err {err:.2e}"
        err = rel_err(torch.stack([s[b] for s in steps]), hf_steps)
        assert err < TOL, f"decode of sequence {b}: rel err {err:.2e}"


def test_chunked_prefill_matches_hf_single_pass(models):
    """A prompt fed in three chunks (state carried across) gives HF's full-sequence logits."""
    ours, hf, device = models
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, SMALL.vocab_size, (150,), generator=gen).to(device)
    batch = SequenceBatch(ours, 1, 150)
    with torch.no_grad():
        chunks = [ours.logits(batch.forward([c])) for c in prompt.split([63, 1, 86])]
        expected = hf(prompt[None]).logits[0]
    assert batch.computed == [150]
    err = rel_err(torch.cat(chunks), expected)
    assert err < TOL, f"rel err {err:.2e}"
