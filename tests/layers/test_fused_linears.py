"""Projections fused into one matmul: same outputs, same parameter names, weights shared."""

import torch
from torch import nn

from sparrow.config import QuantConfig
from sparrow.layers.linear import fuse_linears
from sparrow.layers.quantized import QuantizedLinear
from sparrow.loader.random_checkpoint import PRESETS, random_model
from sparrow.quant.affine import QuantSpec


def test_fused_outputs_equal_separate_ones():
    torch.manual_seed(0)
    mods = [nn.Linear(64, n, bias=False) for n in (32, 8, 1)]
    x = torch.randn(3, 64)
    expected = [m(x) for m in mods]
    fused = fuse_linears(mods)
    for out, ref, m in zip(fused(x), expected, mods, strict=True):
        assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(m(x), ref, atol=1e-6)
    # the modules' weights are views of the fused weight, padded with zero rows to 48 outputs
    assert mods[1].weight.data_ptr() == fused.whole.weight.data_ptr() + 32 * 64 * 4
    assert fused.whole.out_features == 48 and fused.pad == 7
    assert not fused.whole.weight[41:].any()


def test_quantized_fusion_with_padding():
    """Odd total widths (the router + shared gate: 257) are padded in the packed format too."""
    spec = QuantSpec(8, 64)
    torch.manual_seed(1)
    mods = [QuantizedLinear(64, n, spec, torch.float32) for n in (9, 1)]
    for m in mods:
        m.weight.copy_(torch.randint(-(2**31), 2**31 - 1, m.weight.shape, dtype=torch.int32))
        m.scales.copy_(torch.rand(m.scales.shape) * 0.01)
        m.biases.copy_(torch.randn(m.biases.shape) * 0.1)
    x = torch.randn(2, 64)
    expected = [m(x) for m in mods]
    fused = fuse_linears(mods)
    assert fused.whole.weight.shape[0] == 16
    for out, ref in zip(fused(x), expected, strict=True):
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5)


def test_mixed_formats_are_not_fused():
    q = QuantizedLinear(64, 16, QuantSpec(4, 64), torch.float32)
    assert fuse_linears([nn.Linear(64, 16, bias=False), q]) is None


def test_loaded_model_is_fused_with_unchanged_names():
    cfg = PRESETS["qwen3.6-tiny"].replace(vocab_size=256)
    model = random_model(cfg, dtype=torch.float32, quantize=QuantConfig.from_name("4bit"))
    layer = model.layers[0].linear_attn
    assert layer.__dict__.get("_fused_in") is not None
    names = set(model.state_dict())
    assert "layers.0.linear_attn.in_proj_qkv.weight" in names
    assert not any("whole" in n or "_fused" in n for n in names)


def test_replaced_weights_unfuse():
    """After a parameter is replaced (not a view any more) the group runs module by module."""
    cfg = PRESETS["qwen3.6-tiny"].replace(vocab_size=256)
    model = random_model(cfg, dtype=torch.float32)
    attn = model.layers[3].self_attn
    x = torch.randn(2, cfg.hidden_size)
    assert attn.__dict__["_fused_qkv"].intact()
    attn.k_proj.weight = nn.Parameter(torch.zeros_like(attn.k_proj.weight), requires_grad=False)
    q, k, v = attn.project("qkv", x)
    assert not attn.__dict__["_fused_qkv"].intact() and torch.equal(k, torch.zeros_like(k))
