"""One-pass dequantisation kernel vs the PyTorch definition: awkward N, K of 1-4 groups,
4 and 8 bits, fp32/fp16 outputs."""

import pytest
import torch

from sparrow.kernels.dequant import naive
from sparrow.kernels.dequant.dequant import dequantize
from sparrow.quant.affine import QuantSpec, quantize
from tests.conftest import rel_err

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


CASES = [
    (37, 192, 4, torch.float32),
    (5, 64, 8, torch.float32),
    (64, 512, 4, torch.float16),
    (1, 320, 8, torch.float16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, k, bits, dtype", CASES)
def test_dequantize_matches_reference(device, n, k, bits, dtype):
    spec = QuantSpec(bits, 64)
    gen = torch.Generator().manual_seed(n + k)
    packed, scales, biases = quantize(torch.randn(n, k, generator=gen), spec, torch.float16)
    args = [t.to(device) for t in (packed, scales, biases)]
    out = dequantize(*args, spec, dtype)
    expected = naive.dequantize(*args, spec, dtype)
    assert out.shape == (n, k) and out.dtype == dtype
    assert rel_err(out, expected) < (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.gpu
def test_dequantize_real_size_gpu():
    spec = QuantSpec(4, 64)
    packed, scales, biases = quantize(torch.randn(8192, 2048, device="cuda"), spec)
    out = dequantize(packed, scales, biases, spec, torch.bfloat16)
    expected = naive.dequantize(packed, scales, biases, spec, torch.bfloat16)
    assert rel_err(out, expected) < 4e-3  # fused multiply-add may round once differently
