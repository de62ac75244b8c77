"""MiniMax M3's MoE layer in 4 bits: with the Triton backend (the interpreter on a CPU) the
fused expert kernels, fed by the sigmoid router, equal the reference path."""

import pytest
import torch

from sparrow.config import QuantConfig
from sparrow.kernels import get_backend, set_backend
from sparrow.layers.quantized import QuantizedOAIExperts, quantized_copy
from sparrow.layers.sigmoid_moe import SigmoidMoE
from tests.conftest import rel_err


@pytest.fixture(scope="module")
def layer():
    """16 experts, top-4, hidden 128, expert and shared width 64; M3's scale and
    activation; router bias random (0 would hide a bias applied to the weights)."""
    torch.manual_seed(0)
    moe = SigmoidMoE(128, 16, 4, 64, 64, routed_scale=2.0, alpha=1.702, limit=7.0)
    for p in moe.parameters():
        p.requires_grad_(False).normal_(0, 0.3)
    q = quantized_copy(moe, QuantConfig.mlx_default(), torch.float32, prefix="layers.1.mlp.")
    assert isinstance(q.experts, QuantizedOAIExperts)
    return q


@pytest.mark.parametrize("tokens", [1, 4, 60])  # expert GEMVs, GEMVs, grouped GEMMs
def test_kernel_path_matches_reference(layer, tokens):
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(tokens))
    previous = get_backend()
    try:
        set_backend("reference")
        expected = layer(x)
        set_backend("triton")
        got = layer(x)
    finally:
        set_backend(previous)
    assert got.shape == expected.shape and rel_err(got, expected) < 1e-5
