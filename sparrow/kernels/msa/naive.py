"""MiniMax Sparse Attention (MSA) in plain PyTorch over paged caches: the spec of the MSA
kernels in this folder.

A sparse layer keeps, per token, K and V ([pages, bs, Hkv, D] each) and one index key
([pages, bs, Di]) in pages of `bs` tokens, one page per MSA block, all addressed by the block
table of the token's sequence. Two steps per layer:

    select_blocks / decode_select_blocks:  index queries [.., Hi, Di] -> blocks [.., Hi, topk]
    sparse_attention:                      q [T, Hq, D] over the selected blocks -> [T, Hq, D]

Selection (transformers 5.17, `MiniMaxM3VLIndexer`): score(t, s) = iq[t, h] . ik[s] in fp32
with no scale, for keys at positions s <= position(t) (-inf after it, so the query's own block
is causal at token level); a block's score is the max over its keys (a partial last block:
over the keys it has); the query's own block and the `local_blocks - 1` before it score
+inf; the top `topk` blocks per (query, index head), best first; slots whose score is -inf
hold -1. Index head h selects for KV group h (Hi == Hkv), so attention head j reads the
blocks of index head j // (Hq / Hkv). Attention is exact softmax (fp32) over the selected
blocks' tokens at positions <= the query's.

fp8 index keys (`quantize_index_keys`): the cache holds float8_e4m3fn codes [pages, bs, Di]
and an fp32 scale per token [pages, bs], the key being codes * scale; selection takes the
scales as `ik_scale` and scores the dequantised keys.

Everything runs chunk by chunk: `q_chunk` queries by `kv_blocks` key blocks at a time for the
scores, one selected block per step (merged online) for the attention. Memory stays
O(q_chunk * kv_blocks * bs); no [S, S] mask or score matrix exists at any length.
"""

from __future__ import annotations

import torch

Q_CHUNK = 256  # queries per scoring / attention step
KV_BLOCKS = 32  # key blocks per scoring step
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_index_keys(ik: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ik: [..., Di] -> (float8_e4m3fn codes [..., Di], fp32 scales [...]), ik ~ codes *
    scale: a key's scale is its largest |value| / 448 (1 for an all-zero key)."""
    amax = ik.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    codes = (ik.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return codes.to(torch.float8_e4m3fn), scale


def dequantize_index_keys(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [..., Di], scale [...] -> the keys [..., Di] in fp32."""
    return codes.float() * scale[..., None]


def _index_keys(ik_cache: torch.Tensor, ik_scale: torch.Tensor | None, pages: torch.Tensor):
    """The index keys of `pages` ([...] page ids): [..., bs, Di], dequantised where scaled."""
    keys = ik_cache[pages]
    return keys if ik_scale is None else dequantize_index_keys(keys, ik_scale[pages])


def token_tables(block_tables: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int):
    """The block table row of each token's sequence: [B, W] -> [T, W] (no host reads)."""
    token = torch.arange(num_tokens, device=block_tables.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), token, right=True)
    return block_tables[seq]


def _block_max(
    iq: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, k0: int, bs: int
) -> torch.Tensor:
    """iq: [B, Q, Hi, Di]; keys: [B, L, Di] at positions k0 .. k0 + L - 1 (L a multiple of
    bs); q_pos: [B, Q]. Returns each key block's max causal score, [B, Q, Hi, L / bs] fp32."""
    scores = torch.einsum("bqhd,bld->bqhl", iq.float(), keys.float())
    k_pos = k0 + torch.arange(keys.shape[1], device=keys.device)
    future = k_pos[None, None, :] > q_pos[:, :, None]  # [B, Q, L]
    scores = scores.masked_fill(future[:, :, None, :], -torch.inf)
    return scores.unflatten(-1, (-1, bs)).amax(-1)


def _top_blocks(
    scores: torch.Tensor, q_pos: torch.Tensor, bs: int, topk: int, local_blocks: int
) -> torch.Tensor:
    """scores: [B, Q, Hi, W] block scores (-inf: no causal key), W covering every query's
    own block; q_pos: [B, Q]. Returns int64 block ids [B, Q, Hi, topk], -1 past the valid."""
    q_block = (q_pos // bs)[:, :, None, None].expand(*scores.shape[:3], 1)
    for j in range(local_blocks):  # the local blocks take slots of the top-k
        scores = scores.scatter(-1, (q_block - j).clamp(min=0), torch.inf)
    if scores.shape[-1] < topk:
        scores = torch.nn.functional.pad(scores, (0, topk - scores.shape[-1]), value=-torch.inf)
    values, ids = scores.topk(topk, dim=-1)
    return ids.masked_fill(values == -torch.inf, -1)


def select_blocks(
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    table: torch.Tensor,
    q_pos: list[int] | range,
    topk: int,
    local_blocks: int,
    q_chunk: int = Q_CHUNK,
    kv_blocks: int = KV_BLOCKS,
    ik_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's queries (a prompt, a prompt chunk or one decode token). iq: [Q, Hi, Di]
    index queries at host positions q_pos [Q]; ik_cache: [pages, bs, Di] holding the
    sequence's index keys up to its last query (fp8 codes if ik_scale [pages, bs] is given);
    table: [W] its pages. Returns int64 block ids [Q, Hi, topk], -1 padded. Key blocks past a
    query chunk's last position are skipped."""
    bs = ik_cache.shape[1]
    pos = torch.as_tensor(list(q_pos), device=iq.device)
    out = []
    for c0 in range(0, iq.shape[0], q_chunk):
        q, p = iq[c0 : c0 + q_chunk][None], pos[c0 : c0 + q_chunk][None]
        n_blocks = int(q_pos[min(c0 + q_chunk, len(q_pos)) - 1]) // bs + 1
        scores = []
        for j0 in range(0, n_blocks, kv_blocks):
            pages = table[j0 : min(j0 + kv_blocks, n_blocks)].long()
            keys = _index_keys(ik_cache, ik_scale, pages).flatten(0, 1)[None]
            scores.append(_block_max(q, keys, p, j0 * bs, bs))
        out.append(_top_blocks(torch.cat(scores, -1), p, bs, topk, local_blocks)[0])
    return torch.cat(out)


def decode_select_blocks(
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    local_blocks: int,
    kv_blocks: int = KV_BLOCKS,
    ik_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence, all sequences at once, with no host reads (capturable).
    iq: [B, Hi, Di]; block_tables: [B, W]; positions: [B]; ik_scale: as `select_blocks`.
    Table columns past a sequence's last block score -inf whatever their pages hold.
    Returns [B, Hi, topk] int64."""
    bs = ik_cache.shape[1]
    p = positions[:, None]
    scores = []
    for j0 in range(0, block_tables.shape[1], kv_blocks):
        pages = block_tables[:, j0 : j0 + kv_blocks].long()
        keys = _index_keys(ik_cache, ik_scale, pages).flatten(1, 2)
        scores.append(_block_max(iq[:, None], keys, p, j0 * bs, bs))
    return _top_blocks(torch.cat(scores, -1), p, bs, topk, local_blocks)[:, 0]


def sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
    q_chunk: int = Q_CHUNK,
) -> torch.Tensor:
    """Attention of each query over its KV group's selected blocks, no host reads.
    q: [T, Hq, D]; k_cache, v_cache: [pages, bs, Hkv, D]; tables: [T, W] the block table of
    each query's sequence (`token_tables`); positions: [T]; blocks: [T, Hkv, K] logical block
    ids, -1 unused. Returns [T, Hq, D] in q's dtype (fp32 softmax, merged over the K blocks
    online)."""
    out, tables = torch.empty_like(q), tables.long()
    for c0 in range(0, q.shape[0], q_chunk):
        rows = slice(c0, c0 + q_chunk)
        out[rows] = _attend(
            q[rows], k_cache, v_cache, tables[rows], positions[rows], blocks[rows], scale
        )
    return out


def _attend(q, k_cache, v_cache, tables, positions, blocks, scale):
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    qf = q.float().view(t, hkv, hq // hkv, d)
    heads = torch.arange(hkv, device=q.device)[None, :, None]  # [1, Hkv, 1]
    offsets = torch.arange(bs, device=q.device)
    peak = torch.full((t, hkv, hq // hkv), -torch.inf, device=q.device)
    total = torch.zeros_like(peak)
    acc = torch.zeros_like(qf)
    for slot in range(blocks.shape[-1]):
        logical = blocks[:, :, slot]  # [T, Hkv]
        pages = tables.gather(1, logical.clamp(min=0))
        k = k_cache[pages[:, :, None], offsets, heads].float()  # [T, Hkv, bs, D]
        v = v_cache[pages[:, :, None], offsets, heads].float()
        k_pos = logical[:, :, None] * bs + offsets  # [T, Hkv, bs]
        keep = (logical[:, :, None] >= 0) & (k_pos <= positions[:, None, None])
        s = torch.einsum("thgd,thld->thgl", qf, k) * scale
        s = s.masked_fill(~keep[:, :, None, :], -torch.inf)
        new_peak = torch.maximum(peak, s.amax(-1))
        safe = torch.where(new_peak == -torch.inf, 0.0, new_peak)  # no key yet: no NaN
        p = torch.exp(s - safe[..., None])
        rescale = torch.exp(peak - safe)
        total = total * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + torch.einsum("thgl,thld->thgd", p, v)
        peak = new_peak
    return (acc / total[..., None]).view(t, hq, d).to(q.dtype)
