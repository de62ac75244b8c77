"""The MoE layer on the kernel path (4-bit kernels, or bf16 grouped GEMMs) never synchronises
with the host: it is captured in a CUDA graph and replayed (any sync inside would make the
capture fail)."""

import pytest
import torch

from sparrow.config import QuantConfig
from sparrow.kernels import get_backend, set_backend
from sparrow.layers.quantized import quantized_copy
from sparrow.models.qwen3_5_moe import ModelArgs, sparse_moe
from tests.conftest import rel_err


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("tokens", [1, 8, 100])
def test_moe_layer_is_capturable(tokens, quantized):
    cfg = ModelArgs()  # full-size layer: hidden 2048, 256 experts, top-8
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = sparse_moe(cfg).to(torch.bfloat16)
    for p in layer.parameters():
        p.requires_grad_(False).normal_(0, 0.02)
    moe = layer
    if quantized:
        moe = quantized_copy(layer, QuantConfig.mlx_default(), torch.bfloat16, "layers.0.mlp.")
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
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
