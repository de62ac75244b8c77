"""The model's cache tensors and the per-step metadata that indexes them.

Attention layers keep K/V in a paged pool ([num_blocks, block_size, Hkv, D] per layer, a
request's blocks listed in its block table); Gated DeltaNet layers keep conv and recurrent
states in slot pools ([num_slots, ...] per layer, one slot per running request; the conv
pool position-major in memory, `state_pool`). Which block and which slot a request owns is
decided on the CPU (`sparrow.core`); this module holds the tensors and turns a step's plan
into `StepMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.kernels.causal_conv1d.conv import state_pool
from sparrow.layers.metadata import StepMetadata


@dataclass(frozen=True)
class CacheSpec:
    """What a model needs cached per token (attention) and per request (recurrent)."""

    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    num_recurrent_layers: int
    conv_shape: tuple[int, ...]  # per request and layer: [C, K - 1]
    state_shape: tuple[int, ...]  # per request and layer: [Hv, Dk, Dv], fp32

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_attention_layers * block_size * self.num_kv_heads * self.head_dim * item


class ModelCache:
    """One block and one state slot beyond those the scheduler hands out (`pad_block`,
    `pad_slot`) are scratch: padding rows of a captured decode step write there."""

    def __init__(self, spec: CacheSpec, num_blocks: int, block_size: int, num_slots: int,
                 device: torch.device | str, dtype: torch.dtype):  # fmt: skip
        self.spec, self.block_size = spec, block_size
        self.pad_block, self.pad_slot = num_blocks, num_slots
        num_blocks, num_slots = num_blocks + 1, num_slots + 1
        kv_shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(kv_shape, device=device, dtype=dtype)
                  for _ in range(spec.num_attention_layers)]  # fmt: skip
        self.v = [torch.zeros_like(k) for k in self.k]
        channels, kernel = spec.conv_shape[0], spec.conv_shape[1] + 1
        self.conv = [state_pool(num_slots, channels, kernel, device, dtype)
                     for _ in range(spec.num_recurrent_layers)]  # fmt: skip
        self.state = [torch.zeros(num_slots, *spec.state_shape, device=device,
                                  dtype=torch.float32)
                      for _ in range(spec.num_recurrent_layers)]  # fmt: skip

    def reset_slots(self, slots: torch.Tensor) -> None:
        """Zero the recurrent states of requests that start (or restart) now."""
        for conv, state in zip(self.conv, self.state, strict=True):
            conv.index_fill_(0, slots, 0)  # (`conv[slots] = 0` copies the 0 over and syncs)
            state.index_fill_(0, slots, 0)


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the device: on a GPU through
    pinned memory and an async copy (`torch.tensor(..., device=cuda)` synchronises the
    stream, which would wait for the step in flight)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def build_metadata(
    tokens: list[list[int]],
    computed: list[int],
    block_tables: list[list[int]],
    state_slots: list[int],
    block_size: int,
    device: torch.device | str,
) -> StepMetadata:
    """tokens[b]: sequence b's new tokens, which follow its `computed[b]` cached ones."""
    seq_lens = [len(t) for t in tokens]
    positions = [c + i for c, n in zip(computed, seq_lens, strict=True) for i in range(n)]
    slot_mapping = [
        table[p // block_size] * block_size + p % block_size
        for table, c, n in zip(block_tables, computed, seq_lens, strict=True)
        for p in range(c, c + n)
    ]
    width = max(len(t) for t in block_tables)
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)

    def as_tensor(values, dtype):
        return to_device(values, dtype, device)

    return StepMetadata(
        input_ids=as_tensor([x for t in tokens for x in t], torch.long),
        positions=as_tensor(positions, torch.long),
        seq_lens=seq_lens,
        cu_seqlens=as_tensor(cu, torch.int32),
        context_lens=as_tensor(
            [c + n for c, n in zip(computed, seq_lens, strict=True)], torch.int32
        ),  # fmt: skip
        block_tables=as_tensor(tables, torch.int32),
        slot_mapping=as_tensor(slot_mapping, torch.long),
        state_slots=as_tensor(state_slots, torch.int32),
        max_q_len=max(seq_lens),
        prefix_free=not any(computed),
    )
