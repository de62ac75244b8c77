"""Prefill attention through cuDNN's flash kernels: a chunk's queries against every earlier
cached key (no mask) and against the chunk's own keys (causal), two calls merged by their
log-sum-exp.

The cached prefix is gathered from its pages into one contiguous [Hkv, L, D] tensor (at 128K
keys and 2 KV heads of 256: 256 MB of K and V, ~0.1 ms) and the G query heads of each KV
head are folded into the query length ([1, Hkv, T * G, D]): with no mask every query row is
alike, so one call serves all heads of a group without repeating K/V. The chunk's own keys
need the causal mask, so there the K/V heads are repeated to Hq (T keys only).

Measured on the H200 (`python -m sparrow.bench.attention`, 8K queries over 16K-128K keys,
bf16): cuDNN 504-648 TFLOP/s at head dim 256 (16 / 2 heads) and 497-565 at 128 (64 / 4),
FlashAttention-2 (`backend="flash"`) 266-337, one SDPA call with a lower-right causal mask
280-325, the paged Triton kernel 74-86 at 256 and 313-316 at 128.
"""

from __future__ import annotations

import torch

BACKENDS = ("cudnn", "flash", "math")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Chunks of fewer tokens take FlashAttention instead of cuDNN: cuDNN builds an execution plan
# for each new (query length, key length) pair, and a conversation's next turn is a short
# chunk of a length not seen before over a prefix longer than any before.
CUDNN_MIN_TOKENS = 4096


def flash_fits(q: torch.Tensor) -> bool:
    """Whether cuDNN's (and FlashAttention's) kernels take q: a CUDA tensor in fp16 or bf16
    with a head dim that is a multiple of 8 up to 256. They return wrong values, not an
    error, for fp32."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in FLASH_DTYPES and d % 8 == 0 and d <= 256


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v: [1, H, L, D] (causal: Lq == Lk). Returns (out [1, H, Lq, D] in q's dtype,
    lse [1, H, Lq] fp32). "math" is the plain PyTorch definition (any device)."""
    aten = torch.ops.aten
    if backend != "math" and not flash_fits(q):
        raise ValueError(
            f"backend {backend!r} takes fp16/bf16 CUDA tensors with a head dim "
            f"that is a multiple of 8 up to 256, not {q.dtype} x {q.shape[-1]}"
        )
    if backend == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
    elif backend == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
    elif backend == "math":
        s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - lse[..., None]), v.float())
        out = out.to(q.dtype)
    else:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    lse = lse.reshape(*lse.shape[:2], -1)[..., : q.shape[2]]  # cuDNN: [B, H, L, 1]
    return out, lse.float()


def gather_prefix(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached rows of one sequence: [Hkv, length, D] (contiguous per head)."""
    block = cache.shape[1]
    rows = cache[table[: -(-length // block)].long()].flatten(0, 1)[:length]  # [L, Hkv, D]
    return rows.transpose(0, 1).contiguous()


def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Two softmax partials over disjoint keys ([T, H, D] normalised, lse [T, H]) as one
    (fp32)."""
    peak = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - peak), torch.exp(lse2 - peak)
    total = w1 + w2
    return o1.float() * (w1 / total)[..., None] + o2.float() * (w2 / total)[..., None]


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    prefix: int,
    scale: float,
    backend: str | None = None,
) -> torch.Tensor:
    """One sequence's chunk. q: [T, Hq, D]; k, v: the chunk's own [T, Hkv, D] (in the cache
    too); k_cache, v_cache: [num_blocks, block_size, Hkv, D]; table: the sequence's block
    table; prefix: tokens cached before the chunk (host). backend: one of BACKENDS (default
    where `flash_fits`: cudnn from CUDNN_MIN_TOKENS tokens, flash below; else math).
    Returns [T, Hq, D] in q's dtype."""
    t, hq, d = q.shape
    if backend is None and flash_fits(q):
        backend = "cudnn" if t >= CUDNN_MIN_TOKENS else "flash"
    backend = backend or "math"
    hkv = k.shape[1]
    g = hq // hkv
    q_heads = q.transpose(0, 1)[None]  # [1, Hq, T, D]
    k_self, v_self = (x.repeat_interleave(g, dim=1).transpose(0, 1)[None] for x in (k, v))
    out_self, lse_self = _attend(q_heads, k_self, v_self, True, scale, backend)
    out_self, lse_self = out_self[0].transpose(0, 1), lse_self[0].transpose(0, 1)  # [T, Hq(,D)]
    if prefix == 0:
        return out_self
    q_fold = q.view(t, hkv, g, d).transpose(0, 1).reshape(1, hkv, t * g, d)
    k_pre, v_pre = (gather_prefix(c, table, prefix)[None] for c in (k_cache, v_cache))
    out_pre, lse_pre = _attend(q_fold, k_pre, v_pre, False, scale, backend)
    out_pre = out_pre[0].view(hkv, t, g, d).transpose(0, 1).reshape(t, hq, d)
    lse_pre = lse_pre[0].view(hkv, t, g).transpose(0, 1).reshape(t, hq)
    return merge(out_pre, lse_pre, out_self, lse_self).to(q.dtype)
