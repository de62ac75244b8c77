"""The MSA reference (`kernels/msa/naive.py`) on paged caches with shuffled pages: block
selection equals HF's `MiniMaxM3VLIndexer`, attention equals HF's eager attention under its
block mask, chunked equals unchunked, and batched decode equals the prompt path's rows."""

from __future__ import annotations

import pytest
import torch
from transformers import MiniMaxM3VLTextConfig
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf_m3

from sparrow.kernels.msa import naive as msa
from tests.conftest import rel_err

# (sequence length, block size, top-k, local blocks, index heads, index dim); the last has
# the real block geometry (128-token blocks, top-16) over 20 blocks, the last one partial.
SHAPES = [
    (63, 8, 3, 1, 3, 20),
    (100, 4, 5, 2, 2, 12),
    (17, 16, 4, 1, 1, 36),
    (9, 2, 16, 3, 2, 8),
    (2500, 128, 16, 1, 2, 32),
]


def paged(values: torch.Tensor, bs: int, gen: torch.Generator, spare: int = 3):
    """values [S, ...] -> (cache [pages, bs, ...] holding them in shuffled pages, table [W])."""
    pages = -(-values.shape[0] // bs)
    total = pages + spare
    table = torch.randperm(total, generator=gen)[:pages].to(torch.int32)
    cache = torch.randn(total, bs, *values.shape[1:], generator=gen)  # unused rows: noise
    flat = cache.view(total * bs, *values.shape[1:])
    pos = torch.arange(values.shape[0])
    rows = table.long()[pos // bs] * bs + pos % bs
    flat[rows] = values
    return cache, table


def hf_indexer(s, bs, topk, local, hi, di, gen):
    config = MiniMaxM3VLTextConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=hi,
        num_key_value_heads=hi,
        index_n_heads=hi,
        index_head_dim=di,
        index_block_size=bs,
        index_topk_blocks=topk,
        index_local_blocks=local,
        layer_types=["minimax_m3_sparse"],
    )
    indexer = hf_m3.MiniMaxM3VLIndexer(config, 0).eval()
    for p in indexer.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    return indexer


def sorted_blocks(ids: torch.Tensor, width: int) -> torch.Tensor:
    """The selected set per row, ascending, -1 padded to `width` (order is not the contract)."""
    ids = torch.nn.functional.pad(ids, (0, width - ids.shape[-1]), value=-1)
    big = ids.masked_fill(ids < 0, 1 << 30).sort(-1).values
    return big.masked_fill(big == 1 << 30, -1)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"S{s[0]}-bs{s[1]}-k{s[2]}" for s in SHAPES])
@torch.no_grad()
def test_selection_matches_hf_indexer(shape):
    s, bs, topk, local, hi, di = shape
    gen = torch.Generator().manual_seed(s)
    indexer = hf_indexer(s, bs, topk, local, hi, di, gen)
    x = torch.randn(1, s, 32, generator=gen)
    cos, sin = torch.randn(2, 1, s, di, generator=gen)  # any tables: both sides use them
    hf = indexer(x, (cos, sin), None, torch.arange(s)[None])[0]  # [Hi, S, k']
    iq = indexer.q_norm(indexer.q_proj(x).view(s, hi, di))
    ik = indexer.k_norm(indexer.k_proj(x).view(s, 1, di))
    iq, ik = hf_m3.apply_rotary_pos_emb(
        iq.transpose(0, 1), ik.transpose(0, 1), cos[0], sin[0], unsqueeze_dim=0
    )
    ik_cache, table = paged(ik[0], bs, gen)
    chunks = ((256, 32), (5, 1), (7, 3)) if s < 1000 else ((256, 32), (700, 6))
    for q_chunk, kv_blocks in chunks:
        ours = msa.select_blocks(
            iq.transpose(0, 1), ik_cache, table, range(s), topk, local, q_chunk, kv_blocks
        )
        assert ours.shape == (s, hi, topk)
        assert torch.equal(sorted_blocks(ours, topk), sorted_blocks(hf.transpose(0, 1), topk))


@torch.no_grad()
def test_decode_selection_equals_prompt_rows():
    """The last token of three sequences, batched with no host reads (table columns past a
    sequence's end hold other pages), equals each sequence's prompt-path row."""
    gen = torch.Generator().manual_seed(7)
    bs, topk, local, hi, di, lengths = 4, 3, 1, 2, 12, (37, 5, 22)
    pages, total = [-(-n // bs) for n in lengths], 40
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    ik_cache = torch.randn(total, bs, di, generator=gen)
    tables = torch.zeros(3, max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[start : start + n]
        tables[b, n:] = perm[-1]  # padding: a page of another sequence
        start += n
    iq = torch.randn(3, hi, di, generator=gen)
    positions = torch.tensor(lengths) - 1
    got = msa.decode_select_blocks(iq, ik_cache, tables, positions, topk, local, kv_blocks=2)
    for b, n in enumerate(lengths):
        one = msa.select_blocks(iq[b : b + 1], ik_cache, tables[b], [n - 1], topk, local)
        assert torch.equal(sorted_blocks(got[b], topk), sorted_blocks(one[0], topk))


def hf_sparse_attention(q, k, v, blocks, bs, scale):
    """HF's path: the indexer's dense block mask, then eager attention. q: [Hq, S, D];
    k, v: [Hkv, S, D]; blocks: [Hkv, S, K]."""
    config = MiniMaxM3VLTextConfig(
        num_hidden_layers=1,
        num_attention_heads=q.shape[0],
        num_key_value_heads=k.shape[0],
        index_n_heads=k.shape[0],
        index_block_size=bs,
        layer_types=["minimax_m3_sparse"],
    )
    indexer = hf_m3.MiniMaxM3VLIndexer(config, 0)
    s = q.shape[1]
    mask = indexer.build_block_mask(blocks[None], None, s, q.dtype, q.device, torch.arange(s)[None])
    module = type("M", (), {"num_key_value_groups": q.shape[0] // k.shape[0], "training": False})
    out, _ = hf_m3.eager_attention_forward(module, q[None], k[None], v[None], mask, scale)
    return out[0]  # [S, Hq, D]


@pytest.mark.parametrize(
    "s,bs,topk,hq,hkv,d", [(61, 4, 3, 6, 2, 20), (33, 8, 2, 3, 3, 12), (10, 16, 4, 4, 1, 8)]
)
@torch.no_grad()
def test_sparse_attention_matches_hf_mask(s, bs, topk, hq, hkv, d):
    gen = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(s, h, d, generator=gen) for h in (hq, hkv, hkv))
    iq, ik = torch.randn(s, hkv, 16, generator=gen), torch.randn(s, 16, generator=gen)
    ik_cache, table = paged(ik, bs, gen)
    blocks = msa.select_blocks(iq, ik_cache, table, range(s), topk, 1)
    kv = torch.stack((k, v), 1)  # pages shuffled the same way for K and V
    kv_cache, kv_table = paged(kv.flatten(1), bs, torch.Generator().manual_seed(0))
    kv_cache = kv_cache.view(*kv_cache.shape[:2], 2, hkv, d)
    k_cache, v_cache = kv_cache[:, :, 0].contiguous(), kv_cache[:, :, 1].contiguous()
    tables = kv_table[None].expand(s, -1)
    expected = hf_sparse_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), blocks.transpose(0, 1), bs, d**-0.5
    )
    for q_chunk in (128, 7):
        got = msa.sparse_attention(
            q, k_cache, v_cache, tables, torch.arange(s), blocks, d**-0.5, q_chunk
        )
        assert rel_err(got, expected) < 1e-5


def test_token_tables_follow_cu_seqlens():
    tables = torch.tensor([[3, 4], [5, 6], [7, 8]], dtype=torch.int32)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # the middle sequence has no tokens
    assert msa.token_tables(tables, cu, 5)[:, 0].tolist() == [3, 3, 7, 7, 7]
