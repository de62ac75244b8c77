"""Paged attention kernel vs reference: contexts around the block size, out-of-order block
tables, chunked prefill on a cached prefix, decode, GQA, the output gate."""

from dataclasses import replace

import pytest
import torch

from sparrow.kernels.attention import naive
from sparrow.kernels.attention.paged import DecodeTiles, paged_attention, paged_decode_attention
from tests.conftest import rel_err


def _case(ctx_lens, q_lens, hq, hkv, d, block, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block) for n in ctx_lens)
    num_blocks = len(ctx_lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)[: len(ctx_lens) * max_blocks]
    tables = perm.view(len(ctx_lens), max_blocks).to(torch.int32)  # out of order
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=gen)
    gate = torch.randn(t, hq, d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    tensors = (q, k_cache, v_cache, tables, cu, ctx, gate)
    return [x.to(device, dtype) if x.is_floating_point() else x.to(device) for x in tensors]


def _check(ctx_lens, q_lens, hq, hkv, d, block, device, dtype, tol, with_gate=True, splits=None):
    q, k_cache, v_cache, tables, cu, ctx, gate = _case(
        ctx_lens, q_lens, hq, hkv, d, block, device, dtype
    )
    gate = gate if with_gate else None
    scale = d**-0.5
    expected = naive.paged_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        tables,
        cu,
        ctx,
        scale,
        None if gate is None else gate.float(),
    )
    if splits is None:
        out = paged_attention(q, k_cache, v_cache, tables, cu, ctx, scale, gate)
    else:  # the split-K decode kernel (one query per sequence); its gate as the layer
        # passes it, a view of the q projection (rows [q | gate] per head)
        if gate is not None:
            gate = torch.cat([q, gate], dim=-1)[..., q.shape[-1] :]
        tiles = DecodeTiles.for_shape(len(ctx_lens), hkv, d)
        tiles = replace(tiles, splits=splits) if splits else tiles  # 0: chosen by batch
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, gate, tiles)
    assert rel_err(out.float(), expected) < tol


CPU = dict(hq=4, hkv=2, d=32, block=16, device="cpu", dtype=torch.float16, tol=5e-3)


@pytest.mark.parametrize("ctx_lens", [[1], [15], [16], [17], [40, 1, 16, 33]])
def test_decode(ctx_lens):
    _check(ctx_lens, [1] * len(ctx_lens), **CPU)


@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("ctx_lens", [[1], [17], [40, 1, 16, 33, 95]])
def test_split_decode(ctx_lens, splits):
    """More splits than key blocks leaves some empty; the merge must ignore them."""
    _check(ctx_lens, [1] * len(ctx_lens), **CPU, splits=splits)


@pytest.mark.parametrize(
    "ctx_lens, q_lens", [([37], [37]), ([70, 16], [20, 16]), ([33, 5, 90], [1, 5, 45])]
)
def test_prefill_chunks_on_cached_prefix(ctx_lens, q_lens):
    _check(ctx_lens, q_lens, **CPU)


def test_no_gate_and_wide_gqa():
    _check(
        [50, 3],
        [50, 1],
        hq=8,
        hkv=1,
        d=16,
        block=16,
        device="cpu",
        dtype=torch.float32,
        tol=1e-5,
        with_gate=False,
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cache_blocks_smaller_than_a_key_step(device):
    """Pages of 4 tokens (MSA's small test blocks): a step of 16 keys spans four pages."""
    kw = dict(hq=4, hkv=2, d=32, block=4, device=device, dtype=torch.float32, tol=1e-5)
    _check([29, 13, 5], [29, 1, 5], **kw)  # prefill + decode mixed
    _check([29, 13, 5], [1, 1, 1], **kw, splits=2)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 127, 128, 129, 5000])
def test_real_sizes_gpu(ctx):
    kw = dict(hq=16, hkv=2, d=256, block=128, device="cuda", dtype=torch.bfloat16, tol=2e-2)
    _check([ctx, ctx // 2 + 1], [1, 1], **kw)  # decode
    for splits in (1, 16, 64):
        _check([ctx, ctx // 2 + 1], [1, 1], **kw, splits=splits)
    _check([ctx] * 8, [1] * 8, **kw, splits=0)  # split count chosen by batch
    _check([ctx, ctx // 2 + 1], [ctx, 1], **kw)  # prefill + decode mixed
