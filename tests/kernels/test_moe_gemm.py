"""Grouped fused-dequant expert GEMMs vs the reference, on awkward routings and sizes."""

import pytest
import torch

from sparrow.kernels.moe import naive
from sparrow.kernels.moe.expert_gemv import ExpertGemvTiles
from sparrow.kernels.moe.experts import moe_experts
from sparrow.kernels.moe.grouped_gemm import GemmTiles
from sparrow.kernels.moe.shared import Shared
from sparrow.quant.affine import QuantSpec, quantize
from tests.conftest import rel_err


def _weights(e, d, inter, spec, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = quantize(torch.randn(e, 2 * inter, d, generator=gen) * 0.05, spec, dtype)
    down = quantize(torch.randn(e, d, inter, generator=gen) * 0.05, spec, dtype)
    return tuple(t.to(device) for t in gate_up), tuple(t.to(device) for t in down)


def _run(t, e, k, d, inter, dtype, device, logits=None, tol=1e-3, tiles=None):
    spec = QuantSpec(4, 64)
    gate_up, down = _weights(e, d, inter, spec, dtype, device, seed=t)
    gen = torch.Generator().manual_seed(t + 1)
    x = torch.randn(t, d, generator=gen).to(device, dtype)
    if logits is None:
        logits = torch.randn(t, e, generator=gen)
    logits = logits.to(device)
    out = moe_experts(x, logits, k, gate_up, down, spec, tiles=tiles)
    weights, ids = naive.route(logits.float(), k)
    expected = naive.moe_experts(x, weights, ids, gate_up, down, spec)
    assert out.shape == expected.shape and out.dtype == x.dtype
    assert rel_err(out, expected) < tol


# CPU: the interpreter, fp16 and fp32 operands (bf16 tl.dot is wrong under the interpreter).
@pytest.mark.parametrize("t", [1, 3, 8, 17, 64])  # <= GEMV_TOKENS (64): the GEMV path
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_random_routing(t, dtype):
    _run(
        t,
        e=12,
        k=4,
        d=128,
        inter=64,
        dtype=dtype,
        device="cpu",
        tol=1e-5 if dtype == torch.float32 else 2e-3,
    )


@pytest.mark.parametrize("t", [1, 70])  # GEMV, grouped GEMM
def test_top_k_not_a_power_of_two(t):
    _run(t, e=12, k=6, d=128, inter=64, dtype=torch.float32, device="cpu", tol=1e-5)


def test_grouped_gemm_path_for_one_token():
    _run(
        1,
        e=12,
        k=4,
        d=128,
        inter=64,
        dtype=torch.float32,
        device="cpu",
        tol=1e-5,
        tiles=GemmTiles(block_m=16),
    )


def test_one_expert_takes_all_and_most_get_none():
    t, e = 40, 16
    logits = torch.full((t, e), -10.0)
    logits[:, 3] = 5.0  # every token's first choice is expert 3
    logits[:, 7] = 4.0 + torch.linspace(0, 1, t)  # second choice 7
    _run(
        t,
        e,
        k=2,
        d=64,
        inter=64,
        dtype=torch.float32,
        device="cpu",
        logits=logits,
        tiles=GemmTiles(block_m=16),
        tol=1e-5,
    )


def test_128_row_tiles():
    _run(
        70,
        e=4,
        k=2,
        d=128,
        inter=64,
        dtype=torch.float16,
        device="cpu",
        tol=2e-3,
        tiles=GemmTiles(block_m=128, num_warps=8, down_block_n=128),
    )


@pytest.mark.parametrize("t", [60, 61])
def test_two_block_sizes(t):
    """Each expert's last rows in a block of 16 when at most 16 remain after its blocks of 32,
    else in one more block of 32 (about 20 rows per expert: both occur)."""
    small = GemmTiles(block_m=16, block_n=32)
    _run(
        t,
        e=12,
        k=4,
        d=128,
        inter=64,
        dtype=torch.float32,
        device="cpu",
        tol=1e-5,
        tiles=GemmTiles(block_m=32, down_block_n=128, small=small),
    )


def test_default_tiles_from_64_rows_per_expert():
    """About 150 rows per expert: `GemmTiles.for_shape` takes 128-row blocks and a 64-row
    block for the rest of each expert."""
    assert GemmTiles.for_shape(300 * 2, 4).small is not None
    _run(300, e=4, k=2, d=128, inter=64, dtype=torch.float16, device="cpu", tol=2e-3)


def test_down_tiles_of_their_own():
    # gate_up on 32-column tiles, down on 128 (N = 192: its last tile is half empty)
    _run(
        9,
        e=6,
        k=2,
        d=192,
        inter=64,
        dtype=torch.float32,
        device="cpu",
        tol=1e-5,
        tiles=GemmTiles(block_m=16, block_n=32, down_block_n=128),
    )


def test_sizes_not_multiples_of_the_tiles():
    # N (192 and 192) is not a multiple of BLOCK_N = 128.
    _run(
        5,
        e=6,
        k=2,
        d=192,
        inter=192,
        dtype=torch.float32,
        device="cpu",
        tol=1e-5,
        tiles=GemmTiles(block_m=16, block_n=128),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 1000, 2048, 8192])  # 8,192: 128-row tiles, 8 warps
def test_real_sizes_gpu(t):
    _run(t, e=256, k=8, d=2048, inter=512, dtype=torch.bfloat16, device="cuda", tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1000, 8192])
def test_two_block_sizes_gpu(t):
    small = GemmTiles(block_m=64, down_block_n=128)
    _run(
        t,
        e=256,
        k=8,
        d=2048,
        inter=512,
        dtype=torch.bfloat16,
        device="cuda",
        tol=2e-2,
        tiles=GemmTiles(block_m=128, num_warps=8, down_block_n=128, small=small),
    )


@pytest.mark.parametrize("t", [2, 70])  # GEMV and grouped GEMM paths
def test_combine_with_shared_expert(t):
    """The shared expert's output and gate logit: the layer's output in the combine kernel."""
    spec = QuantSpec(4, 64)
    e, k, d, inter = 8, 2, 128, 64
    gate_up, down = _weights(e, d, inter, spec, torch.float32, "cpu", seed=5)
    gen = torch.Generator().manual_seed(6)
    x, fused = torch.randn(t, d, generator=gen), torch.randn(t, e + 1, generator=gen)
    logits, gate = fused[:, :e], fused[:, e:]  # views of the fused router output, as in the layer
    shared = torch.randn(t, d, generator=gen)
    out = moe_experts(x, logits, k, gate_up, down, spec, shared=Shared(gate, output=shared))
    weights, ids = naive.route(logits, k)
    routed = naive.moe_experts(x, weights, ids, gate_up, down, spec)
    assert rel_err(out, routed + torch.sigmoid(gate) * shared) < 1e-5


@pytest.mark.parametrize("t", [1, 5, 70])  # GEMV, GEMV, grouped GEMM
def test_shared_expert_as_one_more_assignment(t):
    """The shared expert's weights run as a (k + 1)-th assignment per token (in the grouped
    GEMM: a group of rows of its own, expert id E)."""
    spec = QuantSpec(4, 64)
    e, k, d, inter = 8, 2, 128, 64
    gate_up, down = _weights(e, d, inter, spec, torch.float32, "cpu", seed=7)
    s_gate_up, s_down = (
        tuple(x[0] for x in w) for w in _weights(1, d, inter, spec, torch.float32, "cpu", seed=8)
    )
    gen = torch.Generator().manual_seed(9)
    x, fused = torch.randn(t, d, generator=gen), torch.randn(t, e + 1, generator=gen)
    logits, gate = fused[:, :e], fused[:, e:]
    out = moe_experts(
        x, logits, k, gate_up, down, spec, shared=Shared(gate, weights=(s_gate_up, s_down))
    )
    weights, ids = naive.route(logits, k)
    routed = naive.moe_experts(x, weights, ids, gate_up, down, spec)
    one = torch.ones(t, 1)
    shared = naive.moe_experts(
        x,
        one,
        torch.zeros(t, 1, dtype=torch.long),
        *(tuple(p[None] for p in w) for w in (s_gate_up, s_down)),
        spec,
    )
    assert rel_err(out, routed + torch.sigmoid(gate) * shared) < 1e-5


def test_chained_expert_gemvs():
    """The expert GEMVs as they run at one token with programmatic dependent launch
    (`ExpertGemvTiles.chained`): gate_up waits, then lets the down GEMV launch, and
    prefetches its weight tiles within the loop; the down GEMV reads ids and weights before
    its wait. (No PDL under the interpreter: the loops and reads are what is checked.) K
    spans two weight tiles in both GEMVs."""
    tiles = ExpertGemvTiles.for_shape(1, pdl=True)
    assert tiles.chained and not ExpertGemvTiles.for_shape(2, pdl=True).chained
    _run(2, e=4, k=2, d=2048, inter=1024, dtype=torch.float32, device="cpu", tol=1e-5, tiles=tiles)
