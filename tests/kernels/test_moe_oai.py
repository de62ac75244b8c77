"""The fused expert kernels with MiniMax M3's routing and activation (`moe_experts_routed`: the
routing given, SwiGLU-OAI in the gate_up epilogue, the routed scale and an ungated shared
output in the combine) against `naive.moe_experts` with the same activation."""

import pytest
import torch

from sparrow.kernels.activations import Glu
from sparrow.kernels.moe import naive
from sparrow.kernels.moe.experts import GEMV_TOKENS, moe_experts, moe_experts_routed
from sparrow.kernels.moe.grouped_gemm import GemmTiles
from sparrow.kernels.moe.routing import topk_route
from sparrow.layers.sigmoid_moe import SigmoidRouter, swiglu_oai
from sparrow.quant.affine import QuantSpec, dequantize
from tests.conftest import rel_err

ALPHA, LIMIT = 1.702, 7.0
OAI = Glu.swiglu_oai(ALPHA, LIMIT)
SPEC = QuantSpec(4, 64)
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _oai(gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu_oai(gate_up, ALPHA, LIMIT)


def random_quantized(e: int, rows: int, cols: int, std: float, dtype, gen) -> tuple:
    """(packed, scales, biases) of [e, rows, cols] group-affine weights: random codes, scales
    around std / 4.6 (the codes' std), biases centring each group near 0. Built without a
    float original (M3's experts would take 29 GB in fp32)."""
    dev = gen.device
    packed = torch.randint(
        -(2**31),
        2**31,
        SPEC.packed_shape((e, rows, cols)),
        generator=gen,
        dtype=torch.int32,
        device=dev,
    )
    shape = SPEC.group_shape((e, rows, cols))
    scales = std / 4.6 * (0.5 + torch.rand(shape, generator=gen, device=dev))
    biases = -7.5 * scales + 0.1 * std * torch.randn(shape, generator=gen, device=dev)
    return packed, scales.to(dtype), biases.to(dtype)


def m3_routing(x: torch.Tensor, e: int, k: int, gen, hot: int = 0) -> tuple:
    """(weights [T, k] fp32, ids [T, k] int64) from M3's sigmoid router with random weights;
    hot > 0: the correction bias sends every token to the first `hot` experts only."""
    router = SigmoidRouter(x.shape[1], e).to(x.device)
    router.weight.copy_(torch.randn(e, x.shape[1], generator=gen, device=x.device) * 0.1)
    bias = torch.randn(e, generator=gen, device=x.device) * 0.1
    if hot:
        bias[:hot] += 10.0
    router.e_score_correction_bias.copy_(bias)
    return router(x, k)


def _case(t, e, k, d, inter, dtype, device="cpu", seed=0, hot=0):
    """x [T, D], the routing, the experts: gate and up of std ~8 for x of std 1, so both
    sides of the clamps occur."""
    gen = torch.Generator(device).manual_seed(seed)
    gate_up = random_quantized(e, 2 * inter, d, 8.0 / d**0.5, dtype, gen)
    down = random_quantized(e, d, inter, 0.05, dtype, gen)
    x = torch.randn(t, d, generator=gen, device=device).to(dtype)
    weights, ids = m3_routing(x.float(), e, k, gen, hot)
    return x, weights, ids, gate_up, down


def _check(x, weights, ids, gate_up, down, tiles=None, scale=1.0, shared=None):
    out = moe_experts_routed(x, weights, ids, gate_up, down, SPEC, OAI, scale, shared, tiles)
    expected = naive.moe_experts(x, weights, ids, gate_up, down, SPEC, act=_oai).float() * scale
    if shared is not None:
        expected = expected + shared.float()
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, expected) < TOL[x.dtype]


# CPU: the interpreter, fp16 and fp32 (bf16 tl.dot is wrong under the interpreter).
@pytest.mark.parametrize("t", [1, 5, GEMV_TOKENS + 1, 70])  # GEMV, GEMV, GEMM, GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_oai_experts(t, dtype):
    _check(*_case(t, e=16, k=4, d=128, inter=64, dtype=dtype, seed=t))


def test_both_clamps_take_effect():
    """The test weights put gate above LIMIT and up beyond +-LIMIT for some rows, so the
    clamps are exercised; without them the result moves far beyond the tolerance."""
    x, weights, ids, gate_up, down = _case(2, e=16, k=4, d=128, inter=64, dtype=torch.float32)
    gate, up = (x @ dequantize(*(w[0] for w in gate_up), SPEC).t()).chunk(2, dim=-1)
    assert (gate > LIMIT).any() and (gate < -LIMIT).any() and (up.abs() > LIMIT).any()
    out = moe_experts_routed(x, weights, ids, gate_up, down, SPEC, OAI)
    unclamped = Glu.swiglu_oai(ALPHA, 1e9)
    assert rel_err(moe_experts_routed(x, weights, ids, gate_up, down, SPEC, unclamped), out) > 1e-2


@pytest.mark.parametrize(("t", "d", "inter"), [(3, 128, 64), (60, 192, 128)])  # GEMV, GEMM
def test_most_experts_get_no_rows(t, d, inter):
    """The correction bias sends every token to 5 of 16 experts: 11 receive no rows, the
    other 5 most of the tokens each."""
    x, weights, ids, gate_up, down = _case(
        t, e=16, k=4, d=d, inter=inter, dtype=torch.float32, seed=3, hot=5
    )
    assert ids.max() < 5
    _check(x, weights, ids, gate_up, down)


@pytest.mark.parametrize(
    "tiles",
    [
        GemmTiles(block_m=16),
        GemmTiles(block_m=32, down_block_n=128, small=GemmTiles(block_m=16, block_n=32)),
    ],
)
def test_grouped_gemm_tiles(tiles):
    """Other tiles, and an expert's last rows in a block of their own (small)."""
    _check(*_case(61, e=16, k=4, d=128, inter=128, dtype=torch.float32, seed=4), tiles=tiles)


@pytest.mark.parametrize("t", [3, 50])
def test_routed_scale_and_shared_output(t):
    """scale * the routed sum + the shared expert's output, in the combine kernel."""
    x, weights, ids, gate_up, down = _case(
        t, e=16, k=4, d=128, inter=64, dtype=torch.float32, seed=5
    )
    shared = torch.randn(t, 128, generator=torch.Generator().manual_seed(6))
    _check(x, weights, ids, gate_up, down, scale=2.0, shared=shared)


@pytest.mark.parametrize("t", [2, 60])
def test_given_routing_with_silu_equals_the_logits_path(t):
    """With silu(gate) * up (the default) and the routing `moe_experts` computes itself, the
    routed entry point gives the same output to the bit."""
    x, _, _, gate_up, down = _case(t, e=16, k=4, d=128, inter=64, dtype=torch.float32, seed=7)
    logits = torch.randn(t, 16, generator=torch.Generator().manual_seed(8))
    weights, ids = topk_route(logits, 4)
    expected = moe_experts(x, logits, 4, gate_up, down, SPEC)
    assert torch.equal(moe_experts_routed(x, weights, ids, gate_up, down, SPEC), expected)


def test_bad_routing_is_refused():
    x, weights, ids, gate_up, down = _case(3, e=16, k=4, d=128, inter=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="fp32"):
        moe_experts_routed(x, weights.half(), ids, gate_up, down, SPEC, OAI)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts_routed(x, weights[:, :2], ids, gate_up, down, SPEC, OAI)
    with pytest.raises(ValueError, match="gated activation"):
        Glu("gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 300])  # GEMV (1: chained under PDL), GEMV, GEMM
def test_real_m3_sizes_gpu(t):
    """MiniMax M3's experts: hidden 6144, expert width 3072, 128 experts, top-4, bf16."""
    _check(
        *_case(t, e=128, k=4, d=6144, inter=3072, dtype=torch.bfloat16, device="cuda", seed=t),
        scale=2.0,
    )
