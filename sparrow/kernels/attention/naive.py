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
