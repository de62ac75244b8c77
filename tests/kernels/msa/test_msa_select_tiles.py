"""Decode selection run as each `DecodeSelectTiles` option says (select.py: the keys-major
decode kernel, its preloaded page ids, its quantised-query dots, the Triton top-k) against
the reference (`naive.py`), on paged caches with shuffled pages (`caches`).

Sizes are awkward: several sequences at different positions, partial last blocks, widths
that are no multiple of kv_blocks, 3 index heads. Selections are compared as sets
(`sorted_blocks`), as in test_msa_kernels.py.

Quantised queries ("fp16", "fp8" dots) are compared with the reference on the same
quantised query (`quantised_query`: the kernel's formula in torch). Under the interpreter
Triton's fp32 -> e4m3 cast rounds some values wrongly (-125.1 -> -64), so the CPU "fp8"
cases take queries that quantise exactly (e4m3 codes times a power of two per row); the
GPU case takes random queries.
"""

from __future__ import annotations

import pytest
import torch

from sparrow.bench.msa import selection_agreement
from sparrow.kernels.msa import naive
from sparrow.kernels.msa import select as msa_select
from sparrow.kernels.msa.select import (
    DecodeSelectTiles,
    decode_block_scores,
    decode_select_blocks,
    decode_select_with,
    top_blocks,
    top_blocks_triton,
)
from tests.kernels.msa.test_msa_kernels import caches, device
from tests.kernels.msa.test_msa_reference import sorted_blocks

KEYS_MAJOR = DecodeSelectTiles(kv_blocks=3, block_n=16, keys_major=True)
TILES = {
    "rows-major-bn16": DecodeSelectTiles(kv_blocks=5, block_n=16),
    "keys-major-kv3": KEYS_MAJOR,
    "keys-major-kv1-preload": DecodeSelectTiles(kv_blocks=1, keys_major=True, preload_pages=True),
    "keys-major-kv4-preload-bn16": DecodeSelectTiles(
        kv_blocks=4, block_n=16, keys_major=True, preload_pages=True
    ),
    "keys-major-kv16-triton-topk": DecodeSelectTiles(
        kv_blocks=16, keys_major=True, preload_pages=True, triton_topk=True
    ),
    # chunks of 16 scores: the top-k's two passes (a program per chunk, then the merge)
    "keys-major-kv4-triton-topk-chunk16": DecodeSelectTiles(
        kv_blocks=4, keys_major=True, triton_topk=True, topk_chunk=16
    ),
}
# (block size, lengths, index heads, index dim, local blocks, query dtype)
CASES = [
    (16, [1, 15, 16, 17, 257, 100], 2, 16, 1, torch.float32),
    (32, [625, 2, 300, 33], 3, 32, 2, torch.float32),
    (16, [200, 31], 4, 16, 1, torch.float16),
]


@pytest.mark.parametrize("tiles", TILES.values(), ids=TILES.keys())
@pytest.mark.parametrize("case", CASES, ids=[f"bs{c[0]}-{c[1]}-{str(c[5])[6:]}" for c in CASES])
def test_decode_tiles(tiles, case):
    bs, lengths, hi, di, local, dtype = case
    gen = torch.Generator().manual_seed(sum(lengths))
    _, _, ik, tables = caches(lengths, bs, 1, 16, di, dtype, gen)
    iq = torch.randn(len(lengths), hi, di, generator=gen).to(device(), dtype)
    pos = torch.tensor(lengths, device=device()) - 1
    ref = naive.decode_select_blocks(iq, ik, tables, pos, 16, local)
    ours = decode_select_with(tiles, iq, ik, tables, pos, 16, local)
    assert ours.shape == ref.shape and ours.dtype == torch.int64
    assert torch.equal(sorted_blocks(ours, 16), sorted_blocks(ref, 16))


@pytest.mark.parametrize("topk", [4, 16])
def test_keys_major_writes_every_score(monkeypatch, topk):
    """The keys-major kernel fills its buffer itself (-inf past each query's block, also in
    the columns past the table when topk > W): NaN-filled memory comes back as the scores
    of the rows-major kernel, which starts from a -inf buffer."""
    gen = torch.Generator().manual_seed(topk)
    bs, lengths = 16, [1, 40, 17, 64]
    _, _, ik, tables = caches(lengths, bs, 1, 16, 16, torch.float32, gen)
    iq = torch.randn(len(lengths), 2, 16, generator=gen).to(device())
    pos = torch.tensor(lengths, device=device()) - 1
    width = max(tables.shape[1], topk)
    ref = decode_block_scores(iq, ik, tables, pos, width, 1, tiles=DecodeSelectTiles())
    empty = torch.empty

    def nan_empty(*shape, **kw):
        return empty(*shape, **kw).fill_(torch.nan)

    monkeypatch.setattr(msa_select.torch, "empty", nan_empty)
    ours = decode_block_scores(iq, ik, tables, pos, width, 1, tiles=KEYS_MAJOR)
    monkeypatch.undo()
    assert ours.shape == (4, 2, width) and not ours.isnan().any()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def quantised_query(iq: torch.Tensor, dot: str) -> torch.Tensor:
    """The query the decode kernel's `dot` multiplies, dequantised: per (sequence, head) a
    scale amax / 448 and the query / scale rounded to e4m3 ("fp8") or fp16 ("fp16")."""
    if dot == "query":
        return iq
    codes, scale = naive.quantize_index_keys(iq)
    if dot == "fp16":
        codes = (iq.float() / scale[..., None]).clamp(-naive.FP8_MAX, naive.FP8_MAX).half()
    return naive.dequantize_index_keys(codes, scale)


def exact_e4m3_queries(shape, gen) -> torch.Tensor:
    """Queries that quantise exactly: e4m3 codes (each row's largest |code| 448) times a
    power of two per row."""
    codes = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448)
    codes = codes.to(torch.float8_e4m3fn).float()
    codes[..., 0] = 448.0 * codes[..., 0].sign().where(codes[..., 0] != 0, 1.0)
    exp = torch.randint(-10, 2, (*shape[:-1], 1), generator=gen).float()
    return codes * 2.0**exp


@pytest.mark.parametrize("dot", ["query", "fp16", "fp8"])
@pytest.mark.parametrize(
    "bs, lengths, hi, di, local, kv_blocks, block_n",
    [
        (16, [1, 15, 16, 17, 257, 100], 2, 16, 1, 3, 16),
        (32, [625, 2, 300, 33], 3, 32, 2, 4, 16),
        (32, [100, 64], 4, 32, 1, 16, 32),
    ],
)
def test_decode_tiles_fp8(dot, bs, lengths, hi, di, local, kv_blocks, block_n):
    """fp8 codes + scales: keys converted to the query dtype, to fp16 beside an fp16
    quantised query, or fp8 x fp8; against the reference on the same quantised query."""
    gen = torch.Generator().manual_seed(len(lengths) + bs)
    _, _, ik, tables = caches(lengths, bs, 1, 16, di, torch.float32, gen)
    codes, scale = naive.quantize_index_keys(ik)
    shape = (len(lengths), hi, di)
    iq = exact_e4m3_queries(shape, gen) if dot == "fp8" else torch.randn(shape, generator=gen)
    iq = iq.to(device())
    pos = torch.tensor(lengths, device=device()) - 1
    ref_q = quantised_query(iq, dot)
    ref = naive.decode_select_blocks(ref_q, codes, tables, pos, 16, local, ik_scale=scale)
    for preload in (False, True):
        tiles = DecodeSelectTiles(
            kv_blocks, block_n, keys_major=True, dot=dot, preload_pages=preload
        )
        ours = decode_select_with(tiles, iq, codes, tables, pos, 16, local, ik_scale=scale)
        assert torch.equal(sorted_blocks(ours, 16), sorted_blocks(ref, 16)), preload


def test_top_blocks_triton():
    """Distinct scores: the ids of torch.topk in its order; -inf: -1 slots at the end; +inf
    and ties: lower ids first."""
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 5, 77, generator=gen).to(device())
    scores[0, 1, 10:] = -torch.inf  # 10 finite scores for 16 slots
    scores[1, 2, [3, 40, 60]] = torch.inf
    scores[2, 0] = -torch.inf
    ours = top_blocks_triton(scores, 16)
    ref = top_blocks(scores, 16)
    assert ours.dtype == torch.int64 and ours.shape == (3, 5, 16)
    plain = torch.ones(3, 5, dtype=torch.bool)
    plain[1, 2] = False
    assert torch.equal(ours[plain], ref[plain])
    assert ours[1, 2, :3].tolist() == [3, 40, 60]
    assert torch.equal(sorted_blocks(ours, 16), sorted_blocks(ref, 16))
    ties = torch.zeros(2, 40, device=device())
    ties[:, 5] = 1.0
    assert top_blocks_triton(ties, 4).tolist() == [[5, 0, 1, 2]] * 2
    for chunk in (16, 32):  # several chunks a row, the last one partial
        assert torch.equal(top_blocks_triton(scores, 16, chunk=chunk), ours)
        assert top_blocks_triton(ties, 4, chunk=16).tolist() == [[5, 0, 1, 2]] * 2


def test_tiles_are_checked():
    with pytest.raises(ValueError, match="dot"):
        DecodeSelectTiles(dot="int8")
    with pytest.raises(ValueError, match="keys-major"):
        DecodeSelectTiles(dot="fp8")
    with pytest.raises(ValueError, match="block_n"):
        DecodeSelectTiles(block_n=48, keys_major=True)
    gen = torch.Generator().manual_seed(1)
    _, _, ik, tables = caches([40], 16, 1, 16, 16, torch.float32, gen)
    iq = torch.randn(1, 2, 16, generator=gen).to(device())
    pos = torch.tensor([39], device=device())
    tiles = DecodeSelectTiles(keys_major=True, dot="fp8")
    with pytest.raises(ValueError, match="fp8 index keys"):
        decode_select_with(tiles, iq, ik, tables, pos, 4, 1)


GPU_TILES = {
    "keys-major-kv8-preload": DecodeSelectTiles(
        kv_blocks=8, block_n=128, keys_major=True, preload_pages=True
    ),
    "keys-major-kv16-bn64-w8": DecodeSelectTiles(
        kv_blocks=16, keys_major=True, num_warps=8, triton_topk=True
    ),
}
GPU_TILES_FP8 = {
    f"keys-major-{dot}": DecodeSelectTiles(
        kv_blocks=8, block_n=128, keys_major=True, dot=dot, preload_pages=True
    )
    for dot in ("query", "fp16", "fp8")
}


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [5000, 1 << 20])
def test_decode_tiles_real_sizes_gpu(ctx):
    """bf16 at the real shapes (4 x 128 index heads, 128-token blocks, top-16) up to 1M
    context: each option against the reference; fp8 codes against the reference on the
    same quantised query (fp8 tensor-core sums are not fp32's: near-ties may swap)."""
    gen = torch.Generator().manual_seed(ctx)
    lengths = [ctx, max(1, ctx // 3)]
    _, _, ik, tables = caches(lengths, 128, 1, 16, 128, torch.bfloat16, gen)
    iq = torch.randn(2, 4, 128, generator=gen).to(device(), torch.bfloat16)
    pos = torch.tensor(lengths, device=device()) - 1
    ref = naive.decode_select_blocks(iq, ik, tables, pos, 16, 1)
    for name, tiles in GPU_TILES.items():
        ours = decode_select_with(tiles, iq, ik, tables, pos, 16, 1)
        assert selection_agreement(ours, ref) > 0.999, name
    codes, scale = naive.quantize_index_keys(ik)
    for name, tiles in GPU_TILES_FP8.items():
        ref_q = quantised_query(iq, tiles.dot)
        ref = naive.decode_select_blocks(ref_q, codes, tables, pos, 16, 1, ik_scale=scale)
        ours = decode_select_with(tiles, iq, codes, tables, pos, 16, 1, ik_scale=scale)
        assert selection_agreement(ours, ref) > 0.95, name
    ours = decode_select_blocks(iq, ik, tables, pos, 16, 1)  # the engine's DECODE_TILES
    assert selection_agreement(ours, naive.decode_select_blocks(iq, ik, tables, pos, 16, 1)) > 0.999
