"""Whole-prompt attention through SDPA (the fast path for steps with no cached prefix)
against the per-sequence reference, GQA and prompts back to back."""

import pytest
import torch

from sparrow.kernels.attention.naive import causal_attention
from sparrow.layers.attention import prompt_attention
from tests.conftest import rel_err


def test_prompt_attention_matches_reference():
    gen = torch.Generator().manual_seed(3)
    seq_lens = [1, 37, 64]
    t = sum(seq_lens)
    q = torch.randn(t, 8, 32, generator=gen)
    k, v = torch.randn(t, 2, 32, generator=gen), torch.randn(t, 2, 32, generator=gen)
    out = prompt_attention(q, k, v, seq_lens, 32**-0.5)
    bounds = [0, 1, 38, 102]
    expected = torch.cat(
        [
            causal_attention(q[a:b], k[a:b], v[a:b], 32**-0.5)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    )
    assert out.shape == q.shape
    assert rel_err(out, expected) < 1e-5


@pytest.mark.gpu
def test_prompt_attention_real_size_gpu():
    """bf16 at the model's head shape (16 q heads, 2 KV heads, D 256), one 4K prompt and a
    short one: FlashAttention through SDPA (pinned: a fallback to the math path fails here)
    against the fp32 reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    seq_lens = [4096, 77]
    t = sum(seq_lens)
    q = torch.randn(t, 16, 256, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(t, 2, 256, device="cuda", generator=gen).bfloat16() for _ in range(2))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = prompt_attention(q, k, v, seq_lens, 256**-0.5)
    expected = torch.cat(
        [
            causal_attention(q[a:b].float(), k[a:b].float(), v[a:b].float(), 256**-0.5)
            for a, b in ((0, 4096), (4096, t))
        ]
    )
    assert rel_err(out, expected) < 2e-2
