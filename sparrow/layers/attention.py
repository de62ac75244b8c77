"""Full attention of Qwen3.5/3.6: q/k RMSNorm, partial RoPE, GQA, sigmoid output gate; and
of Qwen3-MoE: the same without the gate (`output_gate=False`), plain q/k norms, full RoPE."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.core.cache_spec import PagedKVSpec
from sparrow.kernels import fits_tiles, use_triton
from sparrow.kernels.attention import naive
from sparrow.kernels.attention.chunked import chunk_attention, flash_fits
from sparrow.kernels.attention.paged import paged_attention, paged_decode_attention
from sparrow.layers.linear import Projections
from sparrow.layers.metadata import StepMetadata, to_device
from sparrow.layers.norms import ZeroCenteredRMSNorm

# Whole prompts (no cached prefix) in a step of at most this many sequences attend through
# torch SDPA, one call per prompt (FlashAttention on the GPU: 526-622 TFLOP/s for this head
# shape on the H200); the paged kernel measured 1.76 ms per layer for a 4K prompt, about 4x
# SDPA's time. Many short prompts stay on the paged kernel (one launch for all of them).
PROMPTS_PER_SDPA = 4
# Sequences with at least this many new tokens after a cached prefix attend through cuDNN
# (`kernels.attention.chunked`: 504-648 TFLOP/s for 8K-query chunks over 16K-128K keys on
# the H200, the paged kernel 74-86) when a step has at most PROMPTS_PER_SDPA of them; the
# step's other sequences take the paged kernel in one launch.
CHUNK_TOKENS = 64


def prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """Causal attention within each prompt of the step. q: [T, Hq, D]; k, v: [T, Hkv, D],
    prompts back to back (seq_lens on the host). K/V heads are repeated to Hq first and every
    operand is 4-D [1, H, L, D]: SDPA's FlashAttention kernel takes only that (a 3-D call
    falls back to the math path, fp32 scores in memory). Returns [T, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for q_s, k_s, v_s in zip(q.split(seq_lens), k.split(seq_lens), v.split(seq_lens), strict=True):
        k_s, v_s = (x.repeat_interleave(rep, dim=1).transpose(0, 1)[None] for x in (k_s, v_s))
        o = F.scaled_dot_product_attention(
            q_s.transpose(0, 1)[None], k_s, v_s, is_causal=True, scale=scale
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


class GatedAttention(Projections, nn.Module):
    FUSED = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        output_gate: bool = True,
        norm: type[nn.Module] = ZeroCenteredRMSNorm,
    ):
        """output_gate: q_proj also gives each head a sigmoid gate on its output; norm: the
        q/k norm's class (`layers.norms`: `ZeroCenteredRMSNorm` or the plain `RMSNorm`)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.output_gate = output_gate
        # q_proj rows are per head [q (head_dim) | gate (head_dim)], or q alone without a gate.
        self.q_proj = nn.Linear(hidden, (1 + output_gate) * num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = norm(head_dim, eps)
        self.k_norm = norm(head_dim, eps)
        self.kernel_fits = fits_tiles(head_dim)

    def cache_spec(self) -> PagedKVSpec:
        return PagedKVSpec(self.num_kv_heads, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: StepMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x: [T, hidden] (the step's new tokens); cos, sin: [T, rotary]; kv_cache: this
        layer's paged K and V [num_blocks, block_size, Hkv, D], written here, then read."""
        t = x.shape[0]
        q, k, v = self.project("qkv", x)
        if self.output_gate:
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q, gate = q.view(t, self.num_heads, self.head_dim), None
        q = self.q_norm.with_rope(q, cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        cache_rows = (
            k_cache.view(-1, self.num_kv_heads, self.head_dim),
            v_cache.view(-1, self.num_kv_heads, self.head_dim),
            meta.slot_mapping,
        )
        k = self.k_norm.with_rope(
            k.view(t, self.num_kv_heads, self.head_dim), cos, sin, cache=(v, *cache_rows)
        )  # writes k and v to the cache
        args = (k_cache, v_cache, meta.block_tables, meta.cu_seqlens, meta.context_lens, self.scale)
        if meta.batch_invariant:  # prompts and decode alike
            out = gated(naive.paged_attention(q, *args, attend=naive.blocked_attention), gate)
        elif use_triton(x) and self.kernel_fits and meta.max_q_len == 1:  # decode
            out = paged_decode_attention(
                q.contiguous(),
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                gate,
            )
        elif use_triton(x) and meta.prefix_free and len(meta.seq_lens) <= PROMPTS_PER_SDPA:
            spans = [t] if meta.padded else meta.seq_lens  # no host reads in a graph
            out = gated(prompt_attention(q, k, v, spans, self.scale), gate)
        elif use_triton(x) and self.kernel_fits and meta.prefix_lens is not None:
            out = prefill_attention(
                q.contiguous(), contiguous(gate), k, v, kv_cache, meta, self.scale
            )
        elif use_triton(x) and self.kernel_fits:
            out = paged_attention(
                q.contiguous(), *args, gate=contiguous(gate), max_q_len=meta.max_q_len
            )
        elif meta.max_q_len == 1:  # no host reads: decode graphs capture it
            out = naive.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale
            )
            out = gated(out, gate)
        else:
            out = gated(naive.paged_attention(q, *args), gate)
        return self.o_proj(out.reshape(t, -1))


def gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """out * sigmoid(gate), or out where the layer has no output gate."""
    return out if gate is None else out * torch.sigmoid(gate)


def contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.contiguous()


def prefill_attention(
    q: torch.Tensor,
    gate: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: StepMetadata,
    scale: float,
) -> torch.Tensor:
    """A step's gated attention over the paged cache (GPU): sequences of at least
    CHUNK_TOKENS new tokens, when at most PROMPTS_PER_SDPA and cuDNN takes q (`flash_fits`),
    one `chunk_attention` each; the rest in one paged-kernel launch over their rows.
    q, gate: [T, Hq, D] (gate None: no output gate); k, v: the step's [T, Hkv, D]. Returns
    [T, Hq, D]."""
    (k_cache, v_cache), lens, tables = kv_cache, meta.seq_lens, meta.block_tables
    long = [b for b, n in enumerate(lens) if n >= CHUNK_TOKENS] if flash_fits(q) else []
    if not long or len(long) > PROMPTS_PER_SDPA:
        return paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            meta.cu_seqlens,
            meta.context_lens,
            scale,
            gate=gate,
            max_q_len=meta.max_q_len,
        )
    starts = [0, *itertools.accumulate(lens)]
    out = torch.empty_like(q)
    for b in long:
        rows = slice(starts[b], starts[b + 1])
        o = chunk_attention(
            q[rows], k[rows], v[rows], k_cache, v_cache, tables[b], meta.prefix_lens[b], scale
        )
        out[rows] = gated(o, None if gate is None else gate[rows])
    short = [b for b in range(len(lens)) if b not in long]
    if short:
        rows = to_device(
            [r for b in short for r in range(starts[b], starts[b + 1])], torch.long, q.device
        )
        which = to_device(short, torch.long, q.device)
        short_lens = [lens[b] for b in short]
        cu = to_device([0, *itertools.accumulate(short_lens)], torch.int32, q.device)
        out[rows] = paged_attention(
            q[rows],
            k_cache,
            v_cache,
            tables[which],
            cu,
            meta.context_lens[which],
            scale,
            gate=None if gate is None else gate[rows],
            max_q_len=max(short_lens),
        )
    return out
