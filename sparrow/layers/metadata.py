"""Per-step metadata: what a forward step needs besides the weights and the cache tensors.

The worker builds one `StepMetadata` per step (`sparrow.worker.cache.build_metadata`, or the
CUDA-graph buffers); layers read it. It lives here so that layers and models never import
the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepMetadata:
    """Everything a forward step needs besides the weights, built once per step."""

    input_ids: torch.Tensor  # [T] new tokens of all sequences, back to back
    positions: torch.Tensor  # [T] absolute position of each new token
    seq_lens: list[int]  # [B] new tokens per sequence (host)
    cu_seqlens: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, cached tokens after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, cache row (block * block_size + offset) per token
    state_slots: torch.Tensor  # [B] int32, recurrent-state slot per sequence
    max_q_len: int
    prefix_free: bool = False  # every sequence starts at position 0 (no cached prefix; host)
    prefix_lens: list[int] | None = None  # [B] tokens cached before this step (host; None in
    # the decode graphs' metadata)
    padded: bool = False  # one prompt, then a padding sequence (prefill graphs): causal
    # attention over all rows at once gives the prompt's rows their own (host)
    rope_positions: torch.Tensor | None = None  # [T] or [3, T] (mRoPE) when not `positions`
    # states prefix caching keeps from inside the step: sequence b's recurrent and conv state
    # after its first save_at[b, j] new tokens also go to row save_rows[b, j] of the layer's
    # slot pools (-1: none); None when no sequence saves one
    save_rows: torch.Tensor | None = None  # [B, N] int32
    save_at: torch.Tensor | None = None  # [B, N] int32
    # each sequence's rows the same bits whatever else the step holds and however its
    # tokens are split into steps (`kernels.batch_invariant`; host)
    batch_invariant: bool = False
    media_rows: torch.Tensor | None = None  # [R] int64: rows whose embedding is media's
    media_embeds: torch.Tensor | None = None  # [R, hidden]: the vision tower's output


def to_device(
    values: list | torch.Tensor, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on `device` without waiting for the device: on
    a GPU through pinned memory and an async copy (`torch.tensor(..., device=cuda)`
    synchronises the stream, which would wait for the step in flight)."""
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
