"""Fused-dequant GEMV against its reference (Triton interpreter on CPU, real sizes on GPU)."""

import pytest
import torch

from sparrow.kernels.quant_gemv.gemv import quant_gemv
from sparrow.kernels.quant_gemv.naive import quant_matmul
from sparrow.quant.affine import QuantSpec, quantize
from tests.conftest import rel_err


def _case(m, n, k, spec, dtype, device):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    packed, scales, biases = (t.to(device) for t in quantize(w, spec, dtype))
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    return x, packed, scales, biases


# Awkward on purpose: N not a multiple of the row block, K not a multiple of BLOCK_K (256),
# one output row, 8-bit words.
CPU_SHAPES = [(1, 37, 192, 4), (3, 16, 64, 4), (8, 5, 320, 8), (2, 1, 128, 8), (1, 64, 512, 4)]


@pytest.mark.parametrize("unpack", ["magic", "mantissa"])
@pytest.mark.parametrize("m, n, k, bits", CPU_SHAPES)
def test_gemv_matches_reference(m, n, k, bits, unpack):
    spec = QuantSpec(bits, 64)
    x, packed, scales, biases = _case(m, n, k, spec, torch.float16, "cpu")
    y = quant_gemv(x.float(), packed, scales.float(), biases.float(), spec, unpack=unpack)
    expected = quant_matmul(x.float(), packed, scales, biases, spec)
    assert rel_err(y, expected) < 1e-5


def test_gemv_rejects_bad_shapes():
    spec = QuantSpec(4, 64)
    x, packed, scales, biases = _case(2, 8, 128, spec, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        quant_gemv(x[:, :64], packed, scales, biases, spec)
    with pytest.raises(ValueError, match="at most 8 rows"):
        quant_gemv(x.repeat(5, 1), packed, scales, biases, spec)


@pytest.mark.gpu
@pytest.mark.parametrize("unpack", ["magic", "mantissa"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k", [(8192, 2048), (2048, 4096), (248320, 2048), (32, 2048)])
def test_gemv_real_sizes_gpu(m, n, k, unpack):
    spec = QuantSpec(4, 64)
    x, packed, scales, biases = _case(m, n, k, spec, torch.bfloat16, "cuda")
    y = quant_gemv(x, packed, scales, biases, spec, unpack=unpack)
    expected = quant_matmul(x, packed, scales, biases, spec)
    assert rel_err(y, expected) < 1e-2  # bf16 output rounding
