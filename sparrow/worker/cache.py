"""The model's cache tensors, built from the layers' cache specs, and the per-step metadata
that indexes them.

Paged layers (`PagedKVSpec`) keep K/V in a block pool per layer ([num_blocks, block_size,
Hkv, D], a request's blocks listed in its block table, shared by all paged layers); MSA
layers (`SparseKVSpec`) keep an index-key pool [num_blocks, block_size, Di] beside their K/V
(fp8 index keys: e4m3 codes of that shape and fp32 scales [num_blocks, block_size]), and need
`block_size` to be their MSA block;
slot layers (`RecurrentStateSpec`) keep conv and recurrent states in slot pools ([num_slots,
...] per layer, one slot per running request; the conv pool position-major in memory,
`state_pool`; the recurrent pool in the spec's state dtype, fp32 or bf16), followed in the
same tensors by the prefix cache's state snapshots, so a step's kernels store a snapshot as
they store a slot. Which block and which slot a request owns is decided on the CPU
(`sparrow.core`); this module holds the tensors and turns a step's plan into
`StepMetadata`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparrow.core.cache_spec import (
    CacheSpec,
    PagedKVSpec,
    RecurrentStateSpec,
    SparseKVSpec,
    required_block_size,
)
from sparrow.kernels.causal_conv1d.conv import state_pool
from sparrow.layers.metadata import StepMetadata, to_device

# the tensor dtype of each `RecurrentStateSpec.state_dtype`
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelCache:
    """`layers[i]`: what layer i keeps, per its spec: (k, v) block pools for a paged layer,
    (k, v, index keys) for an MSA layer ((k, v, index codes, index scales) with fp8 index
    keys), (conv, state) slot pools for a recurrent one, None for a layer that keeps nothing.
    ValueError if `block_size` is not the MSA block.

    One block and one state slot beyond those the scheduler hands out (`pad_block`,
    `pad_slot`) are scratch: padding rows of a captured decode step write there.
    `snapshots[i]`: a recurrent layer's saved states, what prefix caching resumes from
    (`num_snapshots` of them: the rows of its slot pools after the scratch slot, snapshot j
    at row `snapshot_row(j)`, so in the slots' layout and dtypes); None for other layers."""

    def __init__(
        self,
        specs: Sequence[CacheSpec | None],
        num_blocks: int,
        block_size: int,
        num_slots: int,
        device: torch.device | str,
        dtype: torch.dtype,
        num_snapshots: int = 0,
    ):
        self.specs, self.block_size = list(specs), block_size
        needed = required_block_size(self.specs)
        if needed is not None and needed != block_size:
            raise ValueError(
                f"cache block size {block_size} does not match the model's MSA "
                f"block of {needed} tokens: a cache page must be one MSA block "
                f"(set block_size={needed})"
            )
        self.pad_block, self.pad_slot = num_blocks, num_slots
        self.num_snapshots = num_snapshots
        rows = num_slots + 1 + num_snapshots
        self.layers = [self._allocate(s, num_blocks + 1, rows, device, dtype) for s in self.specs]
        self.snapshots = [
            tuple(t[self.snapshot_row(0) :] for t in tensors)
            if num_snapshots and s is not None and not s.paged
            else None
            for s, tensors in zip(self.specs, self.layers, strict=True)
        ]

    def _allocate(
        self, spec: CacheSpec | None, num_blocks: int, num_slots: int, device, dtype
    ) -> tuple[torch.Tensor, ...] | None:
        if spec is None:
            return None
        if isinstance(spec, PagedKVSpec):
            shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
            return (
                torch.zeros(shape, device=device, dtype=dtype),
                torch.zeros(shape, device=device, dtype=dtype),
            )
        if isinstance(spec, SparseKVSpec):
            kv = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
            index = (num_blocks, self.block_size, spec.index_head_dim)
            k, v = (torch.zeros(kv, device=device, dtype=dtype) for _ in range(2))
            if spec.index_dtype == "auto":
                return k, v, torch.zeros(index, device=device, dtype=dtype)
            if spec.index_dtype == "fp8_e4m3":
                return (
                    k,
                    v,
                    torch.zeros(index, device=device, dtype=torch.float8_e4m3fn),
                    torch.zeros(index[:2], device=device, dtype=torch.float32),
                )
            raise ValueError(f"index dtype {spec.index_dtype!r}: expected 'auto' or 'fp8_e4m3'")
        if isinstance(spec, RecurrentStateSpec):
            conv = state_pool(num_slots, spec.conv_channels, spec.conv_kernel, device, dtype)
            state_dtype = STATE_DTYPES[spec.state_dtype]
            state = torch.zeros(num_slots, *spec.state_shape, device=device, dtype=state_dtype)
            return conv, state
        raise TypeError(f"no cache storage for spec {spec!r}")

    def snapshot_row(self, snapshot: int) -> int:
        """The row of the slot pools that holds `snapshot`."""
        return self.pad_slot + 1 + snapshot

    def reset_slots(self, slots: torch.Tensor) -> None:
        """Zero the per-slot states of requests that start (or restart) now."""
        for spec, tensors in zip(self.specs, self.layers, strict=True):
            if spec is not None and not spec.paged:
                for t in tensors:  # (`t[slots] = 0` copies the 0 over and syncs)
                    t.index_fill_(0, slots, 0)

    def restore(self, slots: torch.Tensor, snapshots: torch.Tensor) -> None:
        """Load saved states into slots (both [n] int64 on the device): exact copies, the
        snapshots being in their pools' dtypes."""
        for tensors, saved in zip(self.layers, self.snapshots, strict=True):
            for t, s in zip(tensors, saved or (), strict=False):
                t.index_copy_(0, slots, s.index_select(0, snapshots))

    def save(self, slots: torch.Tensor, snapshots: torch.Tensor) -> None:
        """Save the slots' states into snapshots (both [n] int64 on the device)."""
        for tensors, saved in zip(self.layers, self.snapshots, strict=True):
            for t, s in zip(tensors, saved or (), strict=False):
                s.index_copy_(0, snapshots, t.index_select(0, slots))


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
        ),
        block_tables=as_tensor(tables, torch.int32),
        slot_mapping=as_tensor(slot_mapping, torch.long),
        state_slots=as_tensor(state_slots, torch.int32),
        max_q_len=max(seq_lens),
        prefix_free=not any(computed),
        prefix_lens=list(computed),
    )
