import torch

from sparrow.config import QuantConfig
from sparrow.layers.quantized import QuantizedExperts, QuantizedLinear, quantized_copy
from sparrow.models.qwen3_5_moe import ModelArgs, sparse_moe

CFG = ModelArgs(
    hidden_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)


def test_quantized_copy_of_a_moe_layer():
    torch.manual_seed(0)
    layer = sparse_moe(CFG)
    for p in layer.parameters():
        p.requires_grad_(False).normal_(0, 0.05)
    q = quantized_copy(layer, QuantConfig.mlx_default(), torch.float32, prefix="layers.0.mlp.")
    assert isinstance(q.experts, QuantizedExperts) and isinstance(
        q.shared_expert.up_proj, QuantizedLinear
    )
    assert q.gate.spec.bits == 8 and q.experts.spec.bits == 4
    x = torch.randn(9, 64)
    with torch.no_grad():
        err = (q(x) - layer(x)).norm() / layer(x).norm()
    assert err < 0.2  # 4-bit noise on Gaussian weights, ~9% per matrix


def test_kernel_path_of_the_quantized_layer_matches_reference():
    """Decode sizes (expert GEMVs) and a prefill size (grouped GEMM; more than GEMV_TOKENS)
    through the kernels, the shared expert one more assignment in both, equal the reference
    path."""
    from sparrow.kernels import get_backend, set_backend
    from tests.conftest import rel_err

    torch.manual_seed(1)
    layer = sparse_moe(CFG)
    for p in layer.parameters():
        p.requires_grad_(False).normal_(0, 0.05)
    q = quantized_copy(layer, QuantConfig.mlx_default(), torch.float32, prefix="layers.0.mlp.")
    assert q.fused("gates") is not None and q.shared_expert.fused("gate_up") is not None
    previous = get_backend()
    try:
        for tokens in (1, 3, 12, 60):
            x = torch.randn(tokens, 64)
            set_backend("reference")
            expected = q(x)
            set_backend("triton")
            assert rel_err(q(x), expected) < 1e-5
    finally:
        set_backend(previous)
