"""Chunk attention (prefix without a mask + the chunk's own keys causally, merged by
log-sum-exp) and the layer's prefill routing against the plain causal reference: prefixes
around the block size, out-of-order block tables, GQA folding, mixed steps."""

import pytest
import torch

from sparrow.kernels.attention import naive
from sparrow.kernels.attention.chunked import chunk_attention, merge
from sparrow.layers.attention import CHUNK_TOKENS, prefill_attention
from sparrow.worker.cache import build_metadata
from tests.conftest import rel_err


def _cache(ctx: int, hkv: int, d: int, block: int, gen, device="cpu", dtype=torch.float32):
    blocks = -(-ctx // block) + 2
    k = torch.randn(blocks, block, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(blocks, block, hkv, d, generator=gen).to(device, dtype)
    table = torch.randperm(blocks, generator=gen)[: -(-ctx // block)].to(device, torch.int32)
    return k, v, table


def _rows(cache, table, lo, hi):
    block = cache.shape[1]
    pos = torch.arange(lo, hi, device=cache.device)
    return cache[table[pos // block].long(), pos % block]


def _check_chunk(t, prefix, hq, hkv, d, block, backend, device, dtype, tol, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ctx = prefix + t
    k_cache, v_cache, table = _cache(ctx, hkv, d, block, gen, device, dtype)
    q = torch.randn(t, hq, d, generator=gen).to(device, dtype)
    k, v = _rows(k_cache, table, prefix, ctx), _rows(v_cache, table, prefix, ctx)
    scale = d**-0.5
    out = chunk_attention(q, k, v, k_cache, v_cache, table, prefix, scale, backend)
    expected = naive.causal_attention(
        q.float(),
        _rows(k_cache, table, 0, ctx).float(),
        _rows(v_cache, table, 0, ctx).float(),
        scale,
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out.float(), expected) < tol


@pytest.mark.parametrize("t, prefix", [(1, 0), (5, 0), (7, 3), (16, 16), (33, 47), (64, 130)])
@pytest.mark.parametrize("hq, hkv, d", [(4, 2, 16), (6, 1, 40), (8, 8, 32)])
def test_chunk_matches_causal_reference(t, prefix, hq, hkv, d):
    _check_chunk(
        t, prefix, hq, hkv, d, block=16, backend="math", device="cpu", dtype=torch.float32, tol=1e-5
    )


def test_merge_of_two_halves_is_the_softmax_over_all_keys():
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(5, 3, 12, generator=gen) * 4  # [T, H, keys] scores
    v = torch.randn(12, 7, generator=gen)

    def part(lo, hi):
        lse = torch.logsumexp(s[..., lo:hi], -1)
        return torch.softmax(s[..., lo:hi], -1) @ v[lo:hi], lse

    out = merge(*part(0, 4), *part(4, 12))
    assert rel_err(out, torch.softmax(s, -1) @ v) < 1e-6


def test_prefill_step_mixes_chunks_short_sequences_and_decodes():
    """One step: a long chunk after a cached prefix, a whole prompt, a short chunk and a
    decode token; the long ones take `chunk_attention`, the others the paged kernel."""
    gen = torch.Generator().manual_seed(2)
    hq, hkv, d, block = 4, 2, 32, 16
    computed, lens = [40, 0, 9, 70], [CHUNK_TOKENS + 3, CHUNK_TOKENS, 5, 1]
    tables, start = [], 0
    total_blocks = sum(-(-(c + n) // block) for c, n in zip(computed, lens, strict=True)) + 1
    k_cache = torch.randn(total_blocks, block, hkv, d, generator=gen).half()
    v_cache = torch.randn(total_blocks, block, hkv, d, generator=gen).half()
    order = torch.randperm(total_blocks, generator=gen).tolist()
    for c, n in zip(computed, lens, strict=True):
        need = -(-(c + n) // block)
        tables.append(order[start : start + need])
        start += need
    meta = build_metadata([[0] * n for n in lens], computed, tables, [0, 1, 2, 3], block, "cpu")
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=gen).half()
    gate = torch.randn(t, hq, d, generator=gen).half()
    rows = meta.slot_mapping
    k = k_cache.view(-1, hkv, d)[rows]
    v = v_cache.view(-1, hkv, d)[rows]
    out = prefill_attention(q, gate, k, v, (k_cache, v_cache), meta, d**-0.5)
    expected = naive.paged_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        meta.block_tables,
        meta.cu_seqlens,
        meta.context_lens,
        d**-0.5,
        gate.float(),
    )
    assert rel_err(out.float(), expected) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("hq, hkv, d", [(16, 2, 256), (64, 4, 128)])
@pytest.mark.parametrize("t, prefix", [(2048, 6144), (1000, 3001), (130, 0)])
def test_chunk_matches_reference_gpu(backend, hq, hkv, d, t, prefix):
    _check_chunk(
        t,
        prefix,
        hq,
        hkv,
        d,
        block=128,
        backend=backend,
        device="cuda",
        dtype=torch.bfloat16,
        tol=2e-2,
    )


def test_flash_backends_refuse_what_they_would_get_wrong():
    """cuDNN and FlashAttention take fp16/bf16 CUDA tensors only (fp32 comes back wrong, not
    refused, from the kernels themselves): anything else is a ValueError, and the default
    backend is then the plain definition."""
    from sparrow.kernels.attention.chunked import flash_fits

    assert not flash_fits(torch.zeros(4, 2, 16))
    for backend in ("cudnn", "flash"):
        with pytest.raises(ValueError, match="fp16/bf16 CUDA"):
            _check_chunk(8, 8, 4, 2, 16, 16, backend, "cpu", torch.float32, 1e-5)
    _check_chunk(8, 8, 4, 2, 16, 16, None, "cpu", torch.float32, 1e-5)
