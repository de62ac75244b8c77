"""The MSA Triton kernels (`select`, `prefill`, `decode` in kernels/msa) against the
reference (`naive.py`) on paged caches with shuffled pages and block tables whose columns
past a sequence's end hold other sequences' pages.

Sizes: the CPU cases scale the real geometry down (16-token blocks; contexts 1, 15, 16, 17,
257 = 2049 / 8, 625 = 5000 / 8 keep their relations to the block size) and run a few real
128-token-block cases with few queries; the interpreter is too slow for more. The `gpu`
cases take the real shapes (64 query heads, 4 KV heads, D 128, 4 x 128 index heads, top-16)
at contexts up to 5000 in bf16.

Selections are compared as sets (`sorted_blocks`): torch.topk orders tied scores in no
documented way and every local block scores +inf. Random scores are tie-free at the cut, so
the sets equal the reference's exactly; the tie cases check that the kernel's set is a valid
top-k of the exact scores instead.
"""

from __future__ import annotations

import pytest
import torch

from sparrow.kernels.attention.paged import DecodeTiles
from sparrow.kernels.msa import naive
from sparrow.kernels.msa.decode import sparse_decode_attention
from sparrow.kernels.msa.decode_select import fused_decode_select_blocks
from sparrow.kernels.msa.prefill import BlockMajorTiles, sparse_prefill_attention
from sparrow.kernels.msa.select import decode_select_blocks, select_blocks
from tests.conftest import rel_err
from tests.kernels.msa.test_msa_reference import sorted_blocks

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def caches(lengths, bs, hkv, d, di, dtype, gen, spare=3):
    """K, V [pages, bs, Hkv, D] and index keys [pages, bs, Di], all slots random, and block
    tables [B, W] of shuffled pages (columns past a sequence's last block: other pages)."""
    w = max(-(-n // bs) for n in lengths) + 1
    pages = len(lengths) * w + spare
    dev = device()
    tables = torch.randperm(pages, generator=gen)[: len(lengths) * w].view(-1, w)
    k, v = (torch.randn(pages, bs, hkv, d, generator=gen).to(dev, dtype) for _ in range(2))
    ik = torch.randn(pages, bs, di, generator=gen).to(dev, dtype)
    return k, v, ik, tables.to(dev, torch.int32)


def exact_block_scores(iq, ik_cache, table, q_pos, bs):
    """[Q, Hi, blocks] fp64 block maxima of the causal scores, dense (small sizes only)."""
    n = max(q_pos) + 1
    keys = ik_cache[table.long()].flatten(0, 1)[:n].double()
    s = torch.einsum("qhd,sd->qhs", iq.double(), keys)
    pos = torch.tensor(q_pos, device=s.device)
    future = torch.arange(n, device=s.device)[None, :] > pos[:, None]
    s = s.masked_fill(future[:, None, :], -torch.inf)
    s = torch.nn.functional.pad(s, (0, -n % bs), value=-torch.inf)
    return s.unflatten(-1, (-1, bs)).amax(-1)


# (context, queries at its end, block size, top-k, local blocks, index heads, index dim)
SELECT = [
    (1, 1, 16, 4, 1, 2, 16),
    (15, 15, 16, 4, 1, 2, 16),
    (16, 16, 16, 4, 2, 2, 16),
    (17, 17, 16, 4, 1, 3, 32),
    (257, 40, 16, 8, 1, 4, 32),
    (625, 20, 16, 16, 2, 4, 16),
    (129, 3, 128, 16, 1, 4, 128),
    (300, 4, 128, 2, 1, 4, 128),
]


@pytest.mark.parametrize("case", SELECT, ids=[f"ctx{c[0]}-q{c[1]}-bs{c[2]}" for c in SELECT])
def test_select_blocks(case):
    ctx, nq, bs, topk, local, hi, di = case
    gen = torch.Generator().manual_seed(ctx)
    _, _, ik, tables = caches([ctx], bs, 1, 16, di, torch.float32, gen)
    iq = torch.randn(nq, hi, di, generator=gen).to(device())
    q_pos = range(ctx - nq, ctx)
    ref = naive.select_blocks(iq, ik, tables[0], q_pos, topk, local)
    for q_chunk in (None, 7):
        ours = select_blocks(iq, ik, tables[0], q_pos, topk, local, q_chunk=q_chunk)
        assert ours.shape == (nq, hi, topk) and ours.dtype == torch.int64
        assert torch.equal(sorted_blocks(ours, topk), sorted_blocks(ref, topk))


def test_select_blocks_positions_list_and_few_blocks():
    """Host positions as a list with gaps (ascending, as the reference's chunk widths
    assume); every query has fewer causal blocks than k."""
    gen = torch.Generator().manual_seed(3)
    _, _, ik, tables = caches([40], 16, 1, 16, 16, torch.float32, gen)
    iq = torch.randn(5, 2, 16, generator=gen).to(device())
    q_pos = [0, 3, 16, 17, 39]
    ref = naive.select_blocks(iq, ik, tables[0], q_pos, 5, 1)
    ours = select_blocks(iq, ik, tables[0], q_pos, 5, 1)
    assert torch.equal(sorted_blocks(ours, 5), sorted_blocks(ref, 5))
    assert ((ours >= 0).sum(-1) == torch.tensor([1, 1, 2, 2, 3])[:, None]).all()


@pytest.mark.parametrize("local", [1, 3])
def test_select_blocks_ties(local):
    """Every block repeats the index keys of block 0 or 1, so full blocks tie in two groups:
    the selection is a valid top-k of the exact scores (no unselected block above a selected
    one, as many blocks as the query has, up to k)."""
    gen = torch.Generator().manual_seed(11)
    bs, ctx, topk = 16, 200, 4
    _, _, ik, tables = caches([ctx], bs, 1, 16, 16, torch.float32, gen)
    rows = tables[0].long()[:, None] * bs + torch.arange(bs, device=ik.device)  # [W, bs]
    flat = ik.view(-1, 16)
    flat[rows.flatten()] = flat[rows[torch.arange(len(rows)) % 2].flatten()].clone()
    iq = torch.randn(6, 2, 16, generator=gen).to(device())
    q_pos = [199, 150, 64, 63, 20, 100]
    ours = select_blocks(iq, ik, tables[0], q_pos, topk, local)
    scores = exact_block_scores(iq, ik, tables[0], q_pos, bs)
    q_block = torch.tensor(q_pos, device=ik.device) // bs
    for j in range(local):
        scores.scatter_(-1, (q_block - j).clamp(min=0)[:, None, None].expand(-1, 2, 1), torch.inf)
    scores = torch.nn.functional.pad(scores, (0, 1), value=-torch.inf)  # column -1: unused
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ours % scores.shape[-1], True)
    low = scores.masked_fill(~chosen, torch.inf).amin(-1)
    high = scores.masked_fill(chosen, -torch.inf).amax(-1)
    assert (low >= high).all()
    assert ((ours >= 0).sum(-1) == (q_block[:, None] + 1).clamp(max=topk)).all()


@pytest.mark.parametrize(
    "bs, lengths, hi, di, local, kv_blocks",
    [
        (16, [1, 15, 16, 17, 257, 100], 2, 16, 1, None),
        (16, [625, 2, 300], 4, 32, 2, 16),  # 40 blocks in 3 splits of the fused kernel
        (128, [1, 127, 128, 129, 2049], 4, 128, 1, None),
    ],
)
@pytest.mark.parametrize("fused", [False, True])
def test_decode_select_blocks(bs, lengths, hi, di, local, kv_blocks, fused):
    gen = torch.Generator().manual_seed(len(lengths))
    _, _, ik, tables = caches(lengths, bs, 1, 16, di, torch.float32, gen)
    iq = torch.randn(len(lengths), hi, di, generator=gen).to(device())
    pos = torch.tensor(lengths, device=device()) - 1
    ref = naive.decode_select_blocks(iq, ik, tables, pos, 16, local)
    if fused:
        ours = fused_decode_select_blocks(iq, ik, tables, pos, 16, local, kv_blocks)
    else:
        ours = decode_select_blocks(iq, ik, tables, pos, 16, local, kv_blocks or 16)
    assert ours.shape == ref.shape and ours.dtype == torch.int64
    assert torch.equal(sorted_blocks(ours, 16), sorted_blocks(ref, 16))


def test_fused_decode_select_ties_take_the_lower_block():
    """Every block holds block 0's index keys: all full blocks tie, so the fused kernel
    takes the local block, then the lowest ids (across its splits)."""
    gen = torch.Generator().manual_seed(4)
    bs, lengths = 16, [600, 100]
    _, _, ik, tables = caches(lengths, bs, 1, 16, 16, torch.float32, gen)
    rows = tables.long()[..., None] * bs + torch.arange(bs, device=ik.device)  # [B, W, bs]
    flat = ik.view(-1, 16)
    flat[rows.flatten()] = flat[rows[:, :1].expand_as(rows).flatten()].clone()
    iq = torch.randn(2, 2, 16, generator=gen).to(device())
    pos = torch.tensor(lengths, device=device()) - 1
    ours = fused_decode_select_blocks(iq, ik, tables, pos, 4, 1, kv_blocks=16)
    own = (pos // bs)[:, None, None].expand(-1, 2, 1)
    want = torch.cat([own, torch.arange(3, device=own.device).expand(2, 2, 3)], -1)
    assert torch.equal(ours, want)


def prompt_batch(chunks, bs, hq, hkv, d, topk, dtype, gen):
    """Prompt chunks [(context, queries at its end)] of several sequences batched as the
    layer sees them, with the reference's selection. Returns the kernels' arguments."""
    k, v, ik, tables = caches([c for c, _ in chunks], bs, hkv, d, d, dtype, gen)
    q = torch.randn(sum(n for _, n in chunks), hq, d, generator=gen).to(device(), dtype)
    iq = torch.randn(q.shape[0], hkv, d, generator=gen).to(device(), torch.float32)
    blocks, positions, start = [], [], 0
    for b, (ctx, n) in enumerate(chunks):
        blocks.append(
            naive.select_blocks(
                iq[start : start + n], ik.float(), tables[b], range(ctx - n, ctx), topk, 1
            )
        )
        positions.append(torch.arange(ctx - n, ctx, device=q.device))
        start += n
    cu = torch.tensor(
        [0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()], device=q.device
    )
    token_tables = naive.token_tables(tables, cu, q.shape[0])
    return q, k, v, token_tables, torch.cat(positions), torch.cat(blocks)


def random_blocks(positions, hkv, topk, bs, gen):
    """Any causal selection: distinct blocks per row in random slots, -1 holes anywhere."""
    rows = []
    for p in positions.tolist():
        for _ in range(hkv):
            ids = torch.randperm(p // bs + 1, generator=gen)[:topk]
            row = torch.full((topk,), -1)
            row[torch.randperm(topk, generator=gen)[: len(ids)]] = ids
            rows.append(row)
    return torch.stack(rows).view(len(positions), hkv, topk).to(positions.device)


PREFILL = [
    ([(1, 1)], torch.float32),
    ([(17, 17), (16, 5)], torch.float32),
    ([(257, 24), (40, 9)], torch.float32),
    ([(625, 12), (15, 15)], torch.float16),
]


@pytest.mark.parametrize("chunks, dtype", PREFILL, ids=[f"{c}-{str(t)[6:]}" for c, t in PREFILL])
def test_sparse_prefill(chunks, dtype):
    gen = torch.Generator().manual_seed(sum(c for c, _ in chunks))
    bs, hq, hkv, d, topk = 16, 8, 2, 32, 4
    q, k, v, tables, positions, blocks = prompt_batch(chunks, bs, hq, hkv, d, topk, dtype, gen)
    ref = naive.sparse_attention(q, k, v, tables, positions, blocks, d**-0.5)
    tiles = BlockMajorTiles(tile=24, block_m=8, block_n=16)  # rows cut into several tiles
    ours = sparse_prefill_attention(
        q, k, v, tables, positions, blocks, d**-0.5, q_chunk=16, tiles=tiles
    )
    assert ours.dtype == dtype and rel_err(ours, ref) < TOL[dtype]
    blocks = random_blocks(positions, hkv, topk, bs, gen)
    ref = naive.sparse_attention(q, k, v, tables, positions, blocks, d**-0.5)
    ours = sparse_prefill_attention(q, k, v, tables, positions, blocks, d**-0.5)
    assert rel_err(ours, ref) < TOL[dtype]


def test_sparse_prefill_real_geometry():
    """128-token blocks, G = 16 query heads per group, D = 128: a chunk at 300 tokens."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, tables, positions, blocks = prompt_batch(
        [(300, 3)], 128, 32, 2, 128, 16, torch.float32, gen
    )
    ref = naive.sparse_attention(q, k, v, tables, positions, blocks, 128**-0.5)
    ours = sparse_prefill_attention(q, k, v, tables, positions, blocks, 128**-0.5)
    assert rel_err(ours, ref) < 1e-4


DECODE = [
    (16, [1, 15, 16, 17, 257, 100], torch.float32),
    (16, [625, 33], torch.float16),
    (128, [1, 127, 128, 129], torch.float32),
]


@pytest.mark.parametrize("bs, lengths, dtype", DECODE, ids=[f"bs{b}-{n}" for b, n, _ in DECODE])
def test_sparse_decode(bs, lengths, dtype):
    gen = torch.Generator().manual_seed(len(lengths) + bs)
    hq, hkv, d, di, topk = 8, 2, 32, 16, 4
    k, v, ik, tables = caches(lengths, bs, hkv, d, di, dtype, gen)
    q = torch.randn(len(lengths), hq, d, generator=gen).to(device(), dtype)
    iq = torch.randn(len(lengths), hkv, di, generator=gen).to(device(), dtype)
    pos = torch.tensor(lengths, device=device()) - 1
    for local in (1, 0):  # without local blocks the own block may be left out
        blocks = naive.decode_select_blocks(iq.float(), ik.float(), tables, pos, topk, local)
        ref = naive.sparse_attention(q, k, v, tables, pos, blocks, d**-0.5)
        ours = sparse_decode_attention(
            q, k, v, tables, pos, blocks, d**-0.5, tiles=DecodeTiles(2, 16)
        )
        assert ours.dtype == dtype and rel_err(ours, ref) < TOL[dtype]
    blocks = random_blocks(pos, hkv, topk, bs, gen)
    ref = naive.sparse_attention(q, k, v, tables, pos, blocks, d**-0.5)
    ours = sparse_decode_attention(q, k, v, tables, pos, blocks, d**-0.5, tiles=DecodeTiles(4, 16))
    assert rel_err(ours, ref) < TOL[dtype]


def test_sparse_decode_on_a_pool_slice():
    """Caches that are a slice of a larger pool (offset storage): the per-head view keeps
    the offset."""
    gen = torch.Generator().manual_seed(9)
    k, v, ik, tables = caches([40, 9], 16, 2, 32, 16, torch.float32, gen, spare=6)
    k, v = k[2:], v[2:]
    tables = (tables % k.shape[0]).to(torch.int32)
    q = torch.randn(2, 4, 32, generator=gen).to(device())
    pos = torch.tensor([39, 8], device=device())
    blocks = random_blocks(pos, 2, 3, 16, gen)
    ref = naive.sparse_attention(q, k, v, tables, pos, blocks, 0.2)
    assert rel_err(sparse_decode_attention(q, k, v, tables, pos, blocks, 0.2), ref) < 1e-4


REAL = (64, 4, 128, 4, 128, 128, 16)  # Hq, Hkv, D, Hi, Di, block size, top-k


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 127, 128, 129, 2049, 5000])
def test_real_sizes_gpu(ctx):
    """Selection, prompt and decode attention at the real shapes in bf16, a prompt of ctx
    tokens and a decode step of 3 sequences after it."""
    hq, hkv, d, hi, di, bs, topk = REAL
    gen = torch.Generator().manual_seed(ctx)
    k, v, ik, tables = caches([ctx, ctx, max(1, ctx // 3)], bs, hkv, d, di, torch.bfloat16, gen)
    rows = max(ctx, 3)  # the decode step takes 3 query rows
    iq_all = torch.randn(rows, hi, di, generator=gen).to(device(), torch.bfloat16)
    q_all = torch.randn(rows, hq, d, generator=gen).to(device(), torch.bfloat16)
    iq, q = iq_all[:ctx], q_all[:ctx]
    ref_sel = naive.select_blocks(iq, ik, tables[0], range(ctx), topk, 1)
    ours_sel = select_blocks(iq, ik, tables[0], range(ctx), topk, 1)
    same = (sorted_blocks(ours_sel, topk) == sorted_blocks(ref_sel, topk)).all(-1)
    assert same.float().mean() > 0.99  # bf16 index dots: near-ties may swap at the cut
    pos = torch.arange(ctx, device=q.device)
    token_tables = tables[0][None].expand(ctx, -1)
    ref = naive.sparse_attention(q, k, v, token_tables, pos, ref_sel, d**-0.5)
    ours = sparse_prefill_attention(q, k, v, token_tables, pos, ref_sel, d**-0.5)
    assert rel_err(ours, ref) < TOL[torch.bfloat16]
    lengths = torch.tensor([ctx, ctx, max(1, ctx // 3)], device=q.device)
    blocks = naive.decode_select_blocks(iq_all[:3], ik, tables, lengths - 1, topk, 1)
    for select in (decode_select_blocks, fused_decode_select_blocks):
        ours_sel = select(iq_all[:3], ik, tables, lengths - 1, topk, 1)
        assert torch.equal(sorted_blocks(ours_sel, topk), sorted_blocks(blocks, topk))
    ref = naive.sparse_attention(q_all[:3], k, v, tables, lengths - 1, blocks, d**-0.5)
    ours = sparse_decode_attention(q_all[:3], k, v, tables, lengths - 1, blocks, d**-0.5)
    assert rel_err(ours, ref) < TOL[torch.bfloat16]


def test_kernels_module_takes_the_reference_signatures():
    """`kernels` swaps in for `naive` (the layer's switch): same names, same parameters."""
    import inspect

    from sparrow.kernels.msa import kernels

    for name in ("select_blocks", "decode_select_blocks", "sparse_attention", "token_tables"):
        ours, ref = (inspect.signature(getattr(m, name)).parameters for m in (kernels, naive))
        assert list(ours) == list(ref), name


@pytest.mark.parametrize("decode_rows", [0, 64])
def test_kernels_sparse_attention_either_path(monkeypatch, decode_rows):
    from sparrow.kernels.msa import kernels

    monkeypatch.setattr(kernels, "DECODE_ROWS", decode_rows)
    gen = torch.Generator().manual_seed(21)
    q, k, v, tables, positions, blocks = prompt_batch(
        [(40, 3), (20, 2)], 16, 4, 2, 16, 3, torch.float32, gen
    )
    ref = naive.sparse_attention(q, k, v, tables, positions, blocks, 0.25)
    assert rel_err(kernels.sparse_attention(q, k, v, tables, positions, blocks, 0.25), ref) < 1e-4
