"""Routing kernels vs their reference, on awkward routings."""

import pytest
import torch

from sparrow.kernels.moe import naive
from sparrow.kernels.moe.routing import align, topk_route

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "t, e, k", [(1, 256, 8), (3, 16, 4), (17, 60, 8), (64, 8, 1), (5, 64, 6), (2, 12, 3)]
)
def test_topk_route(device, t, e, k):
    # a view with strided rows, as the layer passes it (the fused router + shared-gate output)
    fused = torch.randn(t, e + 1, generator=torch.Generator().manual_seed(t)).to(device)
    logits = fused[:, :e]
    weights, ids = topk_route(logits, k)
    ref_w, ref_ids = naive.route(logits, k)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_w.float().cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_topk_route_16bit_logits(dtype):
    """16-bit logits take int32 keys (value and index in one word): the same choices as
    torch's top-k on the softmax, up to the order of equal logits (bf16 rounding makes ties
    common), and the same weights."""
    logits = (torch.randn(6, 256, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    weights, ids = topk_route(logits, 8)
    ref_w, ref_ids = naive.route(logits.float(), 8)
    chosen = logits.gather(1, ids.long()).float().sort(1).values
    assert torch.equal(chosen, logits.gather(1, ref_ids).float().sort(1).values)
    torch.testing.assert_close(
        weights.sort(1).values, ref_w.float().sort(1).values, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("device", DEVICES)
def test_topk_route_with_a_shared_column(device):
    fused = torch.randn(5, 17, generator=torch.Generator().manual_seed(4)).to(device)
    logits, gate = fused[:, :16], fused[:, 16:]
    weights, ids = topk_route(logits, 4, shared_gate=gate)
    ref_w, ref_ids = naive.route(logits, 4)
    assert weights.shape == ids.shape == (5, 5)
    assert torch.equal(ids[:, :4].long().cpu(), ref_ids.cpu()) and (ids[:, 4] == 0).all()
    torch.testing.assert_close(weights[:, :4].cpu(), ref_w.float().cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights[:, 4:].cpu(), gate.sigmoid().cpu(), rtol=1e-6, atol=0)


def _expert_rows(blocks, size, e):
    return [r for s in blocks.start[blocks.expert == e].tolist() for r in range(s, s + size)]


def _check_align(ids, num_experts, block_m, small_m=0):
    got = align(ids, num_experts, block_m, small_m)
    want = naive.align(ids.cpu(), num_experts, block_m, small_m)
    sorted_got = got.sorted_ids.cpu()
    assert sorted_got.shape == want.sorted_ids.shape
    kinds = [(got.blocks, want.blocks, block_m)]
    if small_m:
        kinds.append((got.small, want.small, small_m))
    else:
        assert got.small is None
    for g, w, _ in kinds:
        assert torch.equal(g.start.cpu(), w.start) and torch.equal(g.expert.cpu(), w.expert)
    # Within an expert's rows (its blocks of both sizes) the order of assignments is free
    # (atomics): compare as sets.
    for e in range(num_experts):
        rows = [r for _, w, size in kinds for r in _expert_rows(w, size, e)]
        assert sorted(sorted_got[rows].tolist()) == sorted(want.sorted_ids[rows].tolist())
    # every assignment once, the rest padding
    used = sorted_got[sorted_got < ids.numel()]
    assert torch.equal(used.sort().values, torch.arange(ids.numel(), dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "t, k, block_m", [(1, 8, 16), (3, 2, 16), (17, 4, 32), (100, 8, 64), (300, 8, 16)]
)  # the last: 3 programs of the count and of the scan
def test_align_random(device, t, k, block_m):
    e = 24
    gen = torch.Generator().manual_seed(t * k)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)
    _check_align(ids, e, block_m)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "t, k, block_m, small_m", [(1, 8, 32, 16), (60, 8, 32, 16), (100, 8, 64, 32), (300, 8, 16, 16)]
)
def test_align_two_sizes(device, t, k, block_m, small_m):
    """An expert's last rows in a small block when they fit in one (rests of 0, <= small_m and
    > small_m all occur at these sizes)."""
    e = 24
    gen = torch.Generator().manual_seed(t * k + 1)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)
    _check_align(ids, e, block_m, small_m)


@pytest.mark.parametrize("t", [1, 5, 17, 33])
def test_align_blocks_are_16_byte_aligned(t):
    """Every block table starts 16-byte aligned whatever the token count: Triton specialises
    a kernel on its pointers' alignment and would compile again mid-serving."""
    ids = torch.arange(t * 8).reshape(t, 8) % 24
    routing = align(ids, 24, 16, 16)
    for table in (*routing.blocks, *routing.small, routing.sorted_ids):
        assert table.data_ptr() % 16 == 0


def test_group_blocks():
    assert naive.group_blocks(0, 64, 32) == (0, 0)
    assert naive.group_blocks(64, 64, 32) == (1, 0)
    assert naive.group_blocks(70, 64, 32) == (1, 1)
    assert naive.group_blocks(96, 64, 32) == (1, 1)
    assert naive.group_blocks(97, 64, 32) == (2, 0)
    assert naive.group_blocks(97, 64, 0) == (2, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("small_m", [0, 16])
def test_align_skewed(device, small_m):
    """Most experts get no rows; one expert gets every token."""
    t, e = 37, 16  # top-2
    ids = torch.stack([torch.zeros(t, dtype=torch.long), torch.arange(t) % 3 + 5], 1)
    _check_align(ids.to(device), e, 32 if small_m else 16, small_m)
