"""Fused-dequant GEMV against its reference (Triton interpreter on CPU, real sizes on GPU)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from sparrow.kernels.causal_conv1d.conv import state_pool
from sparrow.kernels.causal_conv1d.naive import causal_conv1d
from sparrow.kernels.quant_gemv.gdn import quant_gemv_conv, quant_gemv_rms_scaled
from sparrow.kernels.quant_gemv.gemv import GemvTiles, fused_pays, launch_gemv, quant_gemv
from sparrow.kernels.quant_gemv.mma import MmaTiles, quant_mma
from sparrow.kernels.quant_gemv.naive import quant_matmul
from sparrow.layers.norms import GatedRMSNorm
from sparrow.quant.affine import QuantSpec, quantize
from tests.conftest import rel_err


def _case(m, n, k, spec, dtype, device):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    packed, scales, biases = (t.to(device) for t in quantize(w, spec, dtype))
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    return x, packed, scales, biases


# Awkward on purpose: N not a multiple of the row block, K not a multiple of BLOCK_K (256)
# nor of the split ranges, one output row, 8-bit words, 16 rows (the most the GEMV takes).
CPU_SHAPES = [
    (1, 37, 192, 4),
    (3, 16, 64, 4),
    (8, 5, 320, 8),
    (2, 1, 128, 8),
    (1, 64, 512, 4),
    (16, 33, 448, 4),
    (5, 70, 1024, 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, bits", CPU_SHAPES)
def test_gemv_matches_reference(m, n, k, bits, dtype):
    spec = QuantSpec(bits, 64)
    x, packed, scales, biases = _case(m, n, k, spec, dtype, "cpu")
    y = quant_gemv(x, packed, scales, biases, spec)
    expected = quant_matmul(x.float(), packed, scales.float(), biases.float(), spec)
    assert y.dtype == dtype
    assert rel_err(y, expected) < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize(
    "config",
    [
        dict(split=1, block_n=16, num_warps=1),
        dict(split=2, block_n=32, block_k=128, num_warps=2),
        dict(split=4, block_n=16, num_warps=4),
    ],
)
def test_mma_configs_match_reference(config):
    """Every code path of the few-rows kernel, whatever shape picks it by default."""
    spec = QuantSpec(4, 64)
    x, packed, scales, biases = _case(6, 40, 768, spec, torch.float16, "cpu")
    y = quant_mma(x, packed, scales, biases, spec, replace(MmaTiles.for_shape(40, 768), **config))
    expected = quant_matmul(x.float(), packed, scales.float(), biases.float(), spec)
    assert rel_err(y, expected) < 2e-3


@pytest.mark.parametrize("m, split", [(17, 1), (40, 2), (64, 1)])
def test_mma_takes_up_to_64_rows(m, split):
    """Rows padded to 32 or 64, both kernels."""
    spec = QuantSpec(4, 64)
    x, packed, scales, biases = _case(m, 24, 256, spec, torch.float16, "cpu")
    tiles = MmaTiles(block_n=16, block_k=128, split=split, num_warps=2)
    y = quant_mma(x, packed, scales, biases, spec, tiles)
    expected = quant_matmul(x.float(), packed, scales.float(), biases.float(), spec)
    assert rel_err(y, expected) < 2e-3
    with pytest.raises(ValueError, match="at most 64 rows"):
        quant_mma(x[:1].expand(65, -1), packed, scales, biases, spec)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [24, 32, 64])
@pytest.mark.parametrize("n, k", [(12352, 2048), (2048, 4096), (248320, 2048), (2048, 512)])
def test_mma_many_rows_real_sizes_gpu(m, n, k):
    spec = QuantSpec(4, 64)
    x, packed, scales, biases = _case(m, n, k, spec, torch.bfloat16, "cuda")
    y = quant_mma(x, packed, scales, biases, spec)
    assert rel_err(y, quant_matmul(x, packed, scales, biases, spec)) < 1e-2


@pytest.mark.parametrize(
    "n, k, bits, block_k, gated",
    [(37, 320, 4, 128, False), (21, 448, 8, 64, True), (16, 128, 4, 128, False)],
)
def test_weight_prefetch_matches(n, k, bits, block_k, gated):
    """The prefetching loop (used with programmatic dependent launch: each weight tile loaded
    one step ahead, the first before the wait) gives the plain loop's result, over several
    K steps and a single one."""
    spec = QuantSpec(bits, 64)
    x, packed, scales, biases = _case(1, 2 * n if gated else n, k, spec, torch.float32, "cpu")
    outs = []
    for prefetch in (False, True):
        y = torch.empty(1, n)
        launch_gemv(
            x,
            (packed, scales, biases),
            y,
            spec,
            GemvTiles(8, block_k, 1, prefetch=prefetch),
            gated=gated,
        )
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    full = quant_matmul(x, packed, scales, biases, spec)
    expected = F.silu(full[:, :n]) * full[:, n:] if gated else full
    assert rel_err(outs[1], expected) < 1e-5


@pytest.mark.parametrize("m, bits", [(1, 4), (1, 8), (3, 4)])
def test_gated_gemv_matches_reference(m, bits):
    """A fused gate_up [2I, K]: silu(gate) * up in the GEMV's epilogue (one row), else after."""
    spec = QuantSpec(bits, 64)
    x, packed, scales, biases = _case(m, 2 * 21, 192, spec, torch.float32, "cpu")
    y = quant_gemv(x, packed, scales, biases, spec, gated=True)
    full = quant_matmul(x, packed, scales, biases, spec)
    assert y.shape == (m, 21)
    assert rel_err(y, F.silu(full[:, :21]) * full[:, 21:]) < 1e-5


Q4 = QuantSpec(4, 64)  # the model's format


def _conv_case(n, k, channels, dtype, device, spec=Q4):
    """A GDN in-projection's one-row case: weights, x, conv weight [C, 4] and a conv-state
    pool of 3 slots (random windows), slot 2 in use."""
    x, packed, scales, biases = _case(1, n, k, spec, dtype, device)
    gen = torch.Generator().manual_seed(n + channels)
    weight = torch.randn(channels, 4, generator=gen).to(device, dtype)
    pool = state_pool(3, channels, 4, device, dtype)
    pool.copy_(torch.randn(pool.shape, generator=gen))
    return spec, x, (packed, scales, biases), weight, pool, torch.tensor([2], device=device)


def _conv_reference(x, w, spec, weight, pool, slot):
    """quant_matmul, then the layer's reference conv on the first C outputs."""
    y = quant_matmul(x.float(), *(t.float() if t.is_floating_point() else t for t in w), spec)
    y = y.to(x.dtype)
    conv, state = causal_conv1d(y[:, : weight.shape[0]], pool[slot].clone(), weight)
    return torch.cat((conv, y[:, weight.shape[0] :]), dim=1), state


@pytest.mark.parametrize(
    "n, k, channels, bits, group",
    [(70, 192, 40, 4, 64), (37, 256, 37, 8, 32), (16, 128, 5, 4, 128)],
)
def test_gemv_conv_matches_reference(n, k, channels, bits, group):
    """The in-projection with the GDN conv step in its epilogue: outputs (conv'd channels
    and plain ones, straddling row blocks) and the moved window in the pool."""
    spec, x, w, weight, pool, slots = _conv_case(
        n, k, channels, torch.float32, "cpu", QuantSpec(bits, group)
    )
    expected, state = _conv_reference(x, w, spec, weight, pool, 2)
    others = pool[:2].clone()
    y = quant_gemv_conv(x, *w, spec, weight, pool, slots)
    assert rel_err(y, expected) < 1e-5 and rel_err(pool[2], state) < 1e-5
    assert torch.equal(pool[:2], others)


def _norm_case(heads, d, parts, n, dtype, device, spec=Q4):
    """A GDN out-projection's one-row case: the step's o * w * silu(z) (in dtype) and its sums
    of o^2 in `parts` column blocks per head, and the layer's norm of o for the reference."""
    gen = torch.Generator().manual_seed(heads * d + n)
    o = torch.randn(1, heads, d, generator=gen).to(device, dtype)
    z = torch.randn(1, heads, d, generator=gen).to(device, dtype)
    norm = GatedRMSNorm(d, 1e-6).to(device, dtype)
    norm.weight.data = (torch.rand(d, generator=gen) + 0.5).to(device, dtype)
    gated = (o.float() * norm.weight.float() * F.silu(z.float())).to(dtype)
    sq_sums = (o.float() ** 2).unflatten(-1, (parts, -1)).sum(-1)
    _, packed, scales, biases = _case(1, n, heads * d, spec, dtype, device)
    return spec, (gated, sq_sums, norm.eps), norm(o, z), (packed, scales, biases)


@pytest.mark.parametrize(
    "heads, d, parts, n, bits, group",
    [(3, 64, 4, 37, 4, 64), (2, 128, 8, 70, 4, 64), (6, 128, 1, 8, 8, 32), (2, 128, 2, 16, 4, 128)],
)
def test_gemv_rms_scaled_matches_reference(heads, d, parts, n, bits, group):
    """The out-projection finishing the GDN gated norm (each head scaled by its 1 / rms from
    partial sums of squares) vs the layer's norm, then the reference matmul; heads of one,
    two and four quantisation groups, 4- and 8-bit."""
    spec, step_parts, normed, w = _norm_case(
        heads, d, parts, n, torch.float32, "cpu", QuantSpec(bits, group)
    )
    y = quant_gemv_rms_scaled(*step_parts, *w, spec)
    assert rel_err(y, quant_matmul(normed.flatten(1), *w, spec)) < 1e-5


def test_gemv_fusions_reject_bad_inputs():
    spec, (gated, sq_sums, eps), _, w = _norm_case(2, 32, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="whole groups"):  # heads of 32: half a group
        quant_gemv_rms_scaled(gated, sq_sums, eps, *w, spec)
    with pytest.raises(ValueError, match="expected"):
        quant_gemv_rms_scaled(gated, sq_sums[:, :1], eps, *w, spec)
    spec, x, w, weight, pool, slots = _conv_case(16, 128, 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        quant_gemv_conv(x, *w, spec, weight[:4], pool, slots)
    with pytest.raises(ValueError, match="one row"):
        quant_gemv_conv(x.repeat(2, 1), *w, spec, weight, pool, slots)


@pytest.mark.gpu
def test_gemv_fusions_real_sizes_gpu():
    """The GDN layer's shapes: in-projection 2048 -> 12352 with the conv on 8192 channels,
    out-projection 4096 -> 2048 finishing the norm over 32 heads of 128 (8 parts), bf16."""
    spec, x, w, weight, pool, slots = _conv_case(12352, 2048, 8192, torch.bfloat16, "cuda")
    expected, state = _conv_reference(x, w, spec, weight, pool, 2)
    y = quant_gemv_conv(x, *w, spec, weight, pool, slots)
    assert rel_err(y, expected) < 1e-2 and rel_err(pool[2], state) < 1e-2
    spec, step_parts, normed, w = _norm_case(32, 128, 8, 2048, torch.bfloat16, "cuda")
    y = quant_gemv_rms_scaled(*step_parts, *w, spec)
    assert rel_err(y, quant_matmul(normed.flatten(1), *w, spec)) < 1e-2


def test_gemv_rejects_bad_shapes():
    spec = QuantSpec(4, 64)
    x, packed, scales, biases = _case(2, 8, 128, spec, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        quant_gemv(x[:, :64], packed, scales, biases, spec)
    with pytest.raises(ValueError, match="at most 64 rows"):
        quant_gemv(x.repeat(33, 1), packed, scales, biases, spec)


def test_fused_or_dequantised_by_shape():
    """Wide matrices fused up to 64 rows, 4096 -> 2048 dequantised from 8, others to 16."""
    assert fused_pays(1, 2048, 4096) and fused_pays(64, 248320, 2048)
    assert not fused_pays(65, 12352, 2048)
    assert fused_pays(4, 2048, 4096) and not fused_pays(8, 2048, 4096)
    assert fused_pays(16, 1024, 2048) and not fused_pays(17, 1024, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize(
    "n, k", [(12352, 2048), (2048, 4096), (248320, 2048), (32, 2048), (2048, 512), (1024, 2048)]
)
def test_gemv_real_sizes_gpu(m, n, k, dtype):
    spec = QuantSpec(4, 64)
    x, packed, scales, biases = _case(m, n, k, spec, dtype, "cuda")
    y = quant_gemv(x, packed, scales, biases, spec)
    expected = quant_matmul(x, packed, scales, biases, spec)
    assert rel_err(y, expected) < 1e-2  # bf16 output rounding


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n, k, block_n, block_k, warps",
    [
        (8192, 2048, 16, 2048, 2),
        (37, 2048, 8, 1024, 2),
        (1000, 4096, 16, 2048, 2),
        (300, 512, 8, 512, 1),
    ],
)
def test_gemv_x_in_place_gpu(n, k, block_n, block_k, warps, dtype):
    """x loaded straight into the fp16-pair products' layout (one power of two per 16 values)
    against x loaded whole and moved there (one per group of 64), with x spread over nine
    orders of magnitude, one K step and several, with and without the weight prefetch; an x
    that is not 16-byte aligned takes the second path."""
    spec = QuantSpec(4, 64)
    x, packed, scales, biases = _case(1, n, k, spec, dtype, "cuda")
    spread = torch.logspace(-6, 3, k, device="cuda")[torch.randperm(k, device="cuda")]
    x = (x.float() * spread).to(dtype)
    expected = quant_matmul(x, packed, scales, biases, spec)
    for prefetch in (False, True):
        ys = []
        for in_place in (False, True):
            y = torch.empty(1, n, device="cuda", dtype=dtype)
            tiles = GemvTiles(
                block_n, block_k, warps, f16_dot=True, prefetch=prefetch, x_in_place=in_place
            )
            launch_gemv(x, (packed, scales, biases), y, spec, tiles)
            ys.append(y)
        errors = rel_err(ys[0], expected), rel_err(ys[1], expected)  # bf16 rounding: 2^-8
        assert errors[0] < 1e-2 and errors[1] <= errors[0] + 2**-8, (prefetch, errors)
    shifted = torch.empty(1, k + 1, device="cuda", dtype=dtype)[:, 1:]
    shifted.copy_(x)
    y = torch.empty(1, n, device="cuda", dtype=dtype)
    launch_gemv(
        shifted,
        (packed, scales, biases),
        y,
        spec,
        GemvTiles(block_n, block_k, warps, f16_dot=True, x_in_place=True),
    )
    assert rel_err(y, expected) < 1e-2 and rel_err(y, ys[0]) <= 2**-8


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_gated_gemv_real_size_gpu(m):
    spec = QuantSpec(4, 64)
    x, packed, scales, biases = _case(m, 1024, 2048, spec, torch.bfloat16, "cuda")
    y = quant_gemv(x, packed, scales, biases, spec, gated=True)
    full = quant_matmul(x, packed, scales, biases, spec).float()
    assert rel_err(y, F.silu(full[:, :512]) * full[:, 512:]) < 1e-2
