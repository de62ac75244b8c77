"""The MoE layer on the kernel path (4-bit kernels, or bf16 grouped GEMMs) never synchronises
with the host: it is captured in a CUDA graph and replayed (any sync inside would make the
capture fail). Qwen's layer, and MiniMax M3's (sigmoid router in torch ops, SwiGLU-OAI
experts, ungated shared expert)."""

import pytest
import torch

from sparrow.config import QuantConfig
from sparrow.kernels import get_backend, set_backend
from sparrow.layers.quantized import quantized_copy
from sparrow.layers.sigmoid_moe import SigmoidMoE
from sparrow.models.qwen3_5_moe import ModelArgs, sparse_moe
from tests.conftest import rel_err


def _random_layer(layer: torch.nn.Module, quantized: bool, prefix: str) -> torch.nn.Module:
    layer = layer.to(torch.bfloat16)
    for p in layer.parameters():
        p.requires_grad_(False).normal_(0, 0.02)
    if not quantized:
        return layer
    return quantized_copy(layer, QuantConfig.mlx_default(), torch.bfloat16, prefix)


def _check_capturable(moe: torch.nn.Module, x: torch.Tensor) -> None:
    """The kernel path equals the reference eagerly, is captured, and its replay on new
    inputs equals an eager run on them."""
    previous = get_backend()
    set_backend("reference")
    with torch.inference_mode():
        reference = moe(x)
    set_backend("triton")
    try:
        with torch.inference_mode():
            eager = moe(x)
            assert rel_err(eager, reference) < 3e-2
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                moe(x)  # warm-up outside capture (kernel compilation)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = moe(x)
            x.copy_(torch.randn_like(x))
            graph.replay()
            expected = moe(x)
    finally:
        set_backend(previous)
    assert rel_err(out, expected) < 1e-2 and not torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("tokens", [1, 8, 100])
def test_moe_layer_is_capturable(tokens, quantized):
    cfg = ModelArgs()  # full-size layer: hidden 2048, 256 experts, top-8
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = sparse_moe(cfg)
    moe = _random_layer(layer, quantized, "layers.0.mlp.")
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    _check_capturable(moe, x)


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("tokens", [1, 8, 100])
def test_m3_moe_layer_is_capturable(tokens, quantized):
    """M3's widths (hidden 6144, experts and shared expert 3072, top-4) over 32 of its 128
    experts (the float layer would take 14 GB)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = SigmoidMoE(6144, 32, 4, 3072, 3072, routed_scale=2.0, alpha=1.702, limit=7.0)
    moe = _random_layer(layer, quantized, "layers.3.mlp.")
    x = torch.randn(tokens, 6144, device="cuda", dtype=torch.bfloat16)
    _check_capturable(moe, x)
