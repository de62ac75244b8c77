"""fp8 (e4m3) MSA index keys: the quantisation round trip, the selection kernels on codes +
scales against the reference on the same codes, how far fp8 selection strays from selection
on the full-precision keys, and a tiny M3 whose index cache is fp8 (`index_cache_dtype`),
through `SequenceBatch` (reference and Triton paths) and through `LLM`.

Selections are compared as sets (`sorted_blocks`), as in test_msa_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from sparrow.bench.msa import selection_agreement
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.kernels.msa import naive
from sparrow.kernels.msa.decode_select import fused_decode_select_blocks
from sparrow.kernels.msa.select import (
    DecodeSelectTiles,
    decode_select_blocks,
    decode_select_with,
    select_blocks,
)
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err
from tests.kernels.msa.test_msa_kernels import caches, device
from tests.kernels.msa.test_msa_kernels_in_m3 import POW2, triton_msa  # noqa: F401 (fixture)
from tests.kernels.msa.test_msa_reference import sorted_blocks
from tests.models.test_minimax_m3_parity import build, prompt


def fp8_caches(lengths, bs, di, gen, dtype=torch.float32):
    """Index keys [pages, bs, Di] in `dtype`, their fp8 codes and scales [pages, bs], and
    shuffled block tables [B, W] (`caches`)."""
    _, _, ik, tables = caches(lengths, bs, 1, 16, di, dtype, gen)
    codes, scale = naive.quantize_index_keys(ik)
    return ik, codes, scale, tables


@pytest.mark.parametrize("shape", [(63, 60), (5, 7, 128)])
def test_round_trip(shape):
    """Each element within half an e4m3 step of itself: 2^-4 of its size (3 mantissa
    bits) or, below the normal range, 2^-10 of the key's scale; a key's largest element
    maps to +-448 exactly; an all-zero key gets scale 1 and zero codes."""
    gen = torch.Generator().manual_seed(sum(shape))
    ik = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 8
    ik[0] = 0
    codes, scale = naive.quantize_index_keys(ik.to(torch.bfloat16))
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == ik.shape
    assert scale.dtype == torch.float32 and scale.shape == ik.shape[:-1]
    ik = ik.to(torch.bfloat16).float()
    back = naive.dequantize_index_keys(codes, scale)
    assert ((back - ik).abs() <= 2**-4 * ik.abs() + 2**-10 * scale[..., None]).all()
    assert (codes[1:].float().abs().amax(-1) == 448).all()
    assert (scale[0] == 1).all() and (codes[0].float() == 0).all()
    assert rel_err(back, ik) <= 2**-4  # half an e4m3 step at the largest element


# (context, queries at its end, block size, top-k, local blocks, index heads, index dim)
SELECT = [
    (17, 17, 16, 4, 1, 3, 32),
    (257, 40, 16, 8, 1, 4, 32),
    (625, 20, 16, 16, 2, 4, 16),
    (300, 4, 128, 2, 1, 4, 128),
]


@pytest.mark.parametrize("case", SELECT, ids=[f"ctx{c[0]}-q{c[1]}-bs{c[2]}" for c in SELECT])
def test_select_blocks_fp8(case):
    ctx, nq, bs, topk, local, hi, di = case
    gen = torch.Generator().manual_seed(ctx)
    _, codes, scale, tables = fp8_caches([ctx], bs, di, gen)
    iq = torch.randn(nq, hi, di, generator=gen).to(device())
    q_pos = range(ctx - nq, ctx)
    ref = naive.select_blocks(iq, codes, tables[0], q_pos, topk, local, ik_scale=scale)
    ours = select_blocks(iq, codes, tables[0], q_pos, topk, local, q_chunk=7, ik_scale=scale)
    assert torch.equal(sorted_blocks(ours, topk), sorted_blocks(ref, topk))


@pytest.mark.parametrize(
    "bs, lengths, hi, di, local, kv_blocks, dtype",
    [
        (16, [1, 15, 16, 17, 257, 100], 2, 16, 1, None, torch.float32),
        (
            16,
            [625, 2, 300],
            4,
            32,
            2,
            16,
            torch.float16,
        ),  # 40 blocks in 3 splits of the fused kernel
        (128, [1, 129, 2049], 4, 128, 1, None, torch.float32),
    ],
)
def test_decode_select_blocks_fp8(bs, lengths, hi, di, local, kv_blocks, dtype):
    """Unfused and fused decode selection on fp8 codes with the query as it is (fp16
    queries take the codes converted to fp16 in registers); the engine's fp8 x fp8 tiles
    quantise the query too (test_msa_select_tiles.py)."""
    gen = torch.Generator().manual_seed(len(lengths))
    _, codes, scale, tables = fp8_caches(lengths, bs, di, gen)
    iq = torch.randn(len(lengths), hi, di, generator=gen).to(device(), dtype)
    pos = torch.tensor(lengths, device=device()) - 1
    ref = naive.decode_select_blocks(iq, codes, tables, pos, 16, local, ik_scale=scale)
    fused = fused_decode_select_blocks(iq, codes, tables, pos, 16, local, kv_blocks, ik_scale=scale)
    tiles = DecodeSelectTiles(kv_blocks=kv_blocks or 16)
    unfused = decode_select_with(tiles, iq, codes, tables, pos, 16, local, ik_scale=scale)
    for ours in (fused, unfused):
        assert torch.equal(sorted_blocks(ours, 16), sorted_blocks(ref, 16))


def test_scales_must_fit_the_codes():
    gen = torch.Generator().manual_seed(1)
    ik, codes, scale, tables = fp8_caches([40], 16, 16, gen)
    iq = torch.randn(1, 2, 16, generator=gen)
    pos = torch.tensor([39])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_decode_select_blocks(iq, ik, tables, pos, 2, 1, ik_scale=scale)
    with pytest.raises(ValueError, match="ik_scale"):
        decode_select_blocks(iq, codes, tables, pos, 2, 1, ik_scale=scale[:, :8])


def test_fp8_selection_agrees_with_full_precision():
    """Random keys and queries (many near-ties at the cut): most selected blocks survive
    quantisation, for prompt and decode selection (the GPU figures: bench/msa.py)."""
    gen = torch.Generator().manual_seed(0)
    ctx, bs, hi, di, topk = 2000, 16, 4, 64, 16
    ik, codes, scale, tables = fp8_caches([ctx, ctx, 700], bs, di, gen)
    iq = torch.randn(64, hi, di, generator=gen)
    q_pos = range(ctx - 64, ctx)
    full = naive.select_blocks(iq, ik, tables[0], q_pos, topk, 1)
    fp8 = naive.select_blocks(iq, codes, tables[0], q_pos, topk, 1, ik_scale=scale)
    assert selection_agreement(fp8, full) >= 0.9
    pos = torch.tensor([ctx - 1, ctx - 1, 699])
    full = naive.decode_select_blocks(iq[:3], ik, tables, pos, topk, 1)
    fp8 = naive.decode_select_blocks(iq[:3], codes, tables, pos, topk, 1, ik_scale=scale)
    assert selection_agreement(fp8, full) >= 0.9
    assert selection_agreement(full, full) == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [129, 5000])
def test_real_sizes_fp8_gpu(ctx):
    """bf16 index queries on fp8 codes at the real shapes (4 x 128 index heads, 128-token
    blocks, top-16): prompt, unfused and fused decode selection against the reference."""
    gen = torch.Generator().manual_seed(ctx)
    ik, codes, scale, tables = fp8_caches(
        [ctx, ctx, max(1, ctx // 3)], 128, 128, gen, torch.bfloat16
    )
    iq = torch.randn(ctx, 4, 128, generator=gen).to(device(), torch.bfloat16)
    ref = naive.select_blocks(iq, codes, tables[0], range(ctx), 16, 1, ik_scale=scale)
    ours = select_blocks(iq, codes, tables[0], range(ctx), 16, 1, ik_scale=scale)
    same = (sorted_blocks(ours, 16) == sorted_blocks(ref, 16)).all(-1)
    assert same.float().mean() > 0.99  # bf16 index dots: near-ties may swap at the cut
    pos = torch.tensor([ctx, ctx, max(1, ctx // 3)], device=device()) - 1
    ref = naive.decode_select_blocks(iq[:3], codes, tables, pos, 16, 1, ik_scale=scale)
    for select in (decode_select_blocks, fused_decode_select_blocks):
        ours = select(iq[:3], codes, tables, pos, 16, 1, ik_scale=scale)
        assert selection_agreement(ours, ref) > 0.95


@pytest.fixture(scope="module")
def m3():
    return build(POW2)[1]


def greedy(model, index_dtype: str, ids: list[int], steps: int):
    """Prefill `ids` and `steps` greedy decode steps: (tokens, logits [len(ids) + steps,
    vocab], the cache)."""
    batch = SequenceBatch(model, 1, 64, index_dtype=index_dtype)
    logits = [model.logits(batch.forward([ids]))]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(model.logits(batch.forward([tokens[-1:]])))
    return tokens, torch.cat(logits), batch.cache


@torch.no_grad()
def test_m3_with_fp8_index_cache(m3):
    """The reference path: fp8 index keys in the cache, the same greedy tokens as keys in
    the activation dtype and close logits (selection moves little)."""
    ids = prompt(40, POW2["vocab_size"], 3)
    tokens, logits, _ = greedy(m3, "auto", ids, 4)
    tokens8, logits8, cache = greedy(m3, "fp8_e4m3", ids, 4)
    sparse = [t for t in cache.layers if t is not None and len(t) == 4]
    assert sparse and all(t[2].dtype == torch.float8_e4m3fn for t in sparse)
    assert all((t[3] > 0).any() for t in sparse)  # written scales
    assert tokens8 == tokens
    assert rel_err(logits8, logits) < 1e-2


@torch.no_grad()
def test_m3_with_fp8_index_cache_triton(m3, triton_msa):  # noqa: F811 (fixture)
    """The MSA kernels (interpreter on a CPU) on the fp8 index cache: prefill and a decode
    step match the reference path on the same fp8 cache."""
    from sparrow.kernels import set_backend

    ids = prompt(40, POW2["vocab_size"], 3)
    tokens, logits, _ = greedy(m3, "fp8_e4m3", ids, 1)
    set_backend("reference")
    ref_tokens, ref_logits, _ = greedy(m3, "fp8_e4m3", ids, 1)
    assert tokens == ref_tokens
    assert rel_err(logits, ref_logits) < 1e-4


@torch.no_grad()
def test_llm_with_fp8_index_cache(m3):
    """Through the engine: the option reaches the cache, greedy tokens match."""
    ids = prompt(30, POW2["vocab_size"], 5)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    out = {}
    for dtype in ("auto", "fp8_e4m3"):
        llm = LLM(
            m3,
            device="cpu",
            dtype=torch.float32,
            num_blocks=16,
            max_model_len=64,
            index_cache_dtype=dtype,
        )
        out[dtype] = llm.generate([ids, ids[:17]], params)
    layers = [t for t in llm.runner.cache.layers if t is not None]
    assert any(len(t) == 4 and t[2].dtype == torch.float8_e4m3fn for t in layers)
    assert [o.token_ids for o in out["fp8_e4m3"]] == [o.token_ids for o in out["auto"]]
