"""The group-affine format against the MLX definition, written out element by element."""

import pytest
import torch

from sparrow.quant.affine import QuantSpec, dequantize, pack, quantize, unpack


def _mlx_dequant_reference(words, scales, biases, bits, group):
    """w[r, c] = scales[r, c // g] * ((W[r, c * bits // 32] >> (bits * (c % (32 // bits))))
    & mask) + biases[r, c // g], one element at a time (uint32 words)."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    rows, n_words = words.shape
    out = torch.empty(rows, n_words * per_word, dtype=torch.float64)
    w64 = words.to(torch.int64) & 0xFFFFFFFF
    for r in range(rows):
        for c in range(n_words * per_word):
            code = (int(w64[r, c // per_word]) >> (bits * (c % per_word))) & mask
            out[r, c] = float(scales[r, c // group]) * code + float(biases[r, c // group])
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64))
    words = pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, 5, 64 * bits // 32)
    assert torch.equal(unpack(words, bits), codes.to(torch.int32))


def test_first_element_in_lowest_bits():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    assert pack(codes, 4).view(torch.uint32).item() == 0xF7654321


@pytest.mark.parametrize(
    "bits, group, dtype", [(4, 64, torch.bfloat16), (8, 64, torch.float16), (4, 32, torch.float32)]
)
def test_dequantize_matches_mlx_definition(bits, group, dtype):
    spec = QuantSpec(bits, group)
    w = torch.randn(7, 3 * group) * torch.linspace(0.1, 3, 7)[:, None]
    words, scales, biases = quantize(w, spec, dtype)
    assert scales.dtype == biases.dtype == dtype and scales.shape == (7, 3)
    expected = _mlx_dequant_reference(words.view(torch.uint32), scales, biases, bits, group)
    # Same codes, scales and biases; only fp32 vs fp64 arithmetic differs.
    actual = dequantize(words, scales, biases, spec).double()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    # Quantisation error: at most half a step (+ storage rounding of scale and bias).
    step = scales.float().repeat_interleave(group, dim=1)
    err = (dequantize(words, scales, biases, spec) - w).abs()
    assert (err <= 0.5 * step + 1e-2 * w.abs().amax(1, keepdim=True)).all()


def test_constant_group_and_stacked_experts():
    spec = QuantSpec(4, 64)
    w = torch.randn(5, 6, 128)
    w[1, 2, :64] = 0.25  # a constant group: scale 0, exact
    words, scales, biases = quantize(w, spec, torch.float32)
    assert words.shape == (5, 6, 16) and scales.shape == (5, 6, 2)
    back = dequantize(words, scales, biases, spec)
    assert torch.equal(back[1, 2, :64], w[1, 2, :64])


def test_bad_specs():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        QuantSpec(3, 64)
    with pytest.raises(ValueError, match="not a multiple of group_size 64"):
        quantize(torch.randn(2, 96), QuantSpec(4, 64))
