"""Causal attention in plain PyTorch: the spec the attention kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention over a paged KV cache, one sequence at a time.

    q: [T, Hq, D], each sequence's queries back to back (cu_seqlens_q [B + 1]); they are the
    last positions of that sequence's context_lens[b] cached tokens (so a chunk attends to
    everything cached before it and causally to itself). k_cache, v_cache:
    [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] physical block of each
    logical block. gate: optional [T, Hq, D], output multiplied by sigmoid(gate).
    Returns [T, Hq, D] in q's dtype."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    bounds = cu_seqlens_q.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n]
        v = v_cache[blocks].flatten(0, 1)[:n]
        out[start:end] = causal_attention(q[start:end], k, v, scale)
    if gate is not None:
        out = (out.float() * torch.sigmoid(gate.float())).to(q.dtype)
    return out
