"""Causal attention in plain PyTorch: the spec the attention kernels are tested against."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# keys per block of `blocked_attention`
KEY_BLOCK = 256


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence. q: [Lq, Hq, D]; k, v: [Lk, Hkv, D] with Lk >= Lq, Hq a multiple of Hkv.

    The queries are the last Lq positions of the Lk keys (chunked prefill and decode attend to
    everything cached before them). Returns [Lq, Hq, D] in q's dtype.
    """
    lq, lk = q.shape[0], k.shape[0]
    q_pos = torch.arange(lk - lq, lk, device=q.device)
    mask = torch.arange(lk, device=q.device)[None, :] <= q_pos[:, None]  # [Lq, Lk]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, key_block: int = KEY_BLOCK
) -> torch.Tensor:
    """`causal_attention` (same arguments and result) computed so that a query's output
    depends on its position and keys alone, not on the other queries: its scores against
    blocks of `key_block` keys from position 0 (the last block padded with zero keys), fp32
    softmax merged online block after block. Keys past its position take probability exactly
    0, so a block wholly past it leaves its sums as they were. Each block is two GEMMs per
    K/V head of every query row (query, head of the group) in the same layout, so with GEMMs
    of at least 16 rows (`kernels.batch_invariant`) a query's output is the same bits as a
    decode step's only query and as one of a prompt's."""
    lq, hq, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    pad = -lk % key_block
    k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)) for x in (k, v))  # [Lk + pad, Hkv, D]
    rows = q.float().view(lq, hkv, group, d).transpose(0, 1).reshape(hkv, lq * group, d)
    q_pos = torch.arange(lk - lq, lk, device=q.device).repeat_interleave(group)
    peak = torch.full((hkv, lq * group), -torch.inf, device=q.device)
    total = torch.zeros_like(peak)
    acc = torch.zeros_like(rows)
    for start in range(0, lk, key_block):
        k_b = k[start : start + key_block].permute(1, 2, 0).contiguous()  # [Hkv, D, B]
        v_b = v[start : start + key_block].transpose(0, 1).contiguous()  # [Hkv, B, D]
        k_pos = torch.arange(start, start + key_block, device=q.device)
        s = torch.bmm(rows, k_b) * scale
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], -torch.inf)
        new_peak = torch.maximum(peak, s.amax(-1))
        p = torch.exp(s - new_peak[..., None])
        rescale = torch.exp(peak - new_peak)
        total = total * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + torch.bmm(p, v_b)
        peak = new_peak
    out = (acc / total[..., None]).view(hkv, lq, group, d).transpose(0, 1)
    return out.reshape(lq, hq, d).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
    attend: Callable[..., torch.Tensor] = causal_attention,
) -> torch.Tensor:
    """Varlen causal attention over a paged KV cache, one sequence at a time.

    q: [T, Hq, D], each sequence's queries back to back (cu_seqlens_q [B + 1]); they are the
    last positions of that sequence's context_lens[b] cached tokens (so a chunk attends to
    everything cached before it and causally to itself). k_cache, v_cache:
    [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] physical block of each
    logical block. gate: optional [T, Hq, D], output multiplied by sigmoid(gate). attend:
    one sequence's attention, `causal_attention` or `blocked_attention`.
    Returns [T, Hq, D] in q's dtype."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    bounds = cu_seqlens_q.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n]
        v = v_cache[blocks].flatten(0, 1)[:n]
        out[start:end] = attend(q[start:end], k, v, scale)
    if gate is not None:
        out = out * torch.sigmoid(gate.to(q.dtype))  # each op rounded in q's dtype
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    blocks_per_step: int = 16,
) -> torch.Tensor:
    """One query per sequence over its paged cache, all sequences at once and with no host
    reads (it can be captured in a CUDA graph). q: [B, Hq, D]; k_cache, v_cache:
    [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks]; context_lens: [B] (the
    query is the last of them). Returns [B, Hq, D] in q's dtype.

    fp32 softmax over `blocks_per_step` blocks at a time, merged online: memory stays that of
    one step whatever the table width, and table columns past a sequence's context add
    exactly nothing (a graph's wider, padded tables give eager's result bit for bit)."""
    b, hq, d = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    qf = q.float().view(b, hkv, hq // hkv, d)
    peak = torch.full((b, hkv, hq // hkv), -1e30, device=q.device)
    total = torch.zeros_like(peak)
    acc = torch.zeros_like(qf)
    for start in range(0, block_tables.shape[1], blocks_per_step):
        table = block_tables[:, start : start + blocks_per_step].long()
        k = k_cache[table].flatten(1, 2).float()  # [B, L, Hkv, D]
        v = v_cache[table].flatten(1, 2).float()
        pos = start * block_size + torch.arange(k.shape[1], device=q.device)
        s = torch.einsum("bhgd,blhd->bhgl", qf, k) * scale
        s = s.masked_fill((pos[None, :] >= context_lens[:, None])[:, None, None, :], -torch.inf)
        new_peak = torch.maximum(peak, s.amax(-1))
        p = torch.exp(s - new_peak[..., None])
        rescale = torch.exp(peak - new_peak)
        total = total * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + torch.einsum("bhgl,blhd->bhgd", p, v)
        peak = new_peak
    return (acc / total[..., None]).view(b, hq, d).to(q.dtype)
