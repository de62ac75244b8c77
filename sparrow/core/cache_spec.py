"""What each layer keeps between steps, declared by the layer itself.

A model lists one spec per layer (`Model.cache_specs()`, None for a layer that keeps
nothing). Two kinds of storage follow from them:
- paged, per token: K/V rows (and, for MSA layers, one index key, in the activation dtype or
  as fp8 codes with a scale) in fixed-size blocks
  that every paged layer addresses through the same per-request block table; the block manager
  (`core/block_pool.py`) counts blocks, the worker's `ModelCache` holds one tensor set per
  layer;
- per request slot: recurrent state (the GDN conv window and matrix state, the latter in
  fp32 or bf16), one slot per running request, reset when a request starts.
Specs are plain data: sizes here, tensors in `sparrow/worker/cache.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar


@dataclass(frozen=True)
class PagedKVSpec:
    """K and V of every token: [num_blocks, block_size, num_kv_heads, head_dim] each."""

    paged: ClassVar[bool] = True
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * itemsize


# bytes per element of each recurrent-state dtype (`CacheConfig.recurrent_state_dtype`)
STATE_ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Per request: the conv window [conv_channels, conv_kernel - 1] in the activation dtype
    and the recurrent state `state_shape` (GDN: [Hv, Dk, Dv]) in `state_dtype`, "float32" or
    "bfloat16" (kept in that dtype between steps, updated in fp32)."""

    paged: ClassVar[bool] = False
    conv_channels: int
    conv_kernel: int
    state_shape: tuple[int, ...]
    state_dtype: str = "float32"

    def bytes_per_slot(self, itemsize: int) -> int:
        conv = self.conv_channels * (self.conv_kernel - 1) * itemsize
        state = STATE_ITEMSIZE[self.state_dtype]
        for n in self.state_shape:
            state *= n
        return conv + state


@dataclass(frozen=True)
class SparseKVSpec:
    """An MSA layer: K and V as `PagedKVSpec`, plus one index key per token
    [num_blocks, block_size, index_head_dim], in pages of exactly `block_size` tokens (one
    page is one MSA block: selection picks pages). `index_dtype` "auto": the keys in the
    activation dtype; "fp8_e4m3": float8_e4m3fn codes of that shape and one fp32 scale per
    token [num_blocks, block_size]."""

    paged: ClassVar[bool] = True
    num_kv_heads: int
    head_dim: int
    index_head_dim: int
    block_size: int
    index_dtype: str = "auto"

    def bytes_per_token(self, itemsize: int) -> int:
        kv = 2 * self.num_kv_heads * self.head_dim * itemsize
        if self.index_dtype == "fp8_e4m3":
            return kv + self.index_head_dim + 4
        return kv + self.index_head_dim * itemsize


CacheSpec = PagedKVSpec | RecurrentStateSpec | SparseKVSpec


def required_block_size(specs: Sequence[CacheSpec | None]) -> int | None:
    """The page size the layers need (an MSA block), None if any size does; ValueError if
    two layers need different ones."""
    sizes = {s.block_size for s in specs if isinstance(s, SparseKVSpec)}
    if len(sizes) > 1:
        raise ValueError(f"layers need different cache page sizes: {sorted(sizes)}")
    return sizes.pop() if sizes else None


def with_index_dtype(specs: Sequence[CacheSpec | None], index_dtype: str) -> list[CacheSpec | None]:
    """The specs with every MSA layer's index keys kept as `index_dtype`; ValueError for an
    index dtype other than "auto" when no layer has index keys."""
    if index_dtype != "auto" and not any(isinstance(s, SparseKVSpec) for s in specs):
        raise ValueError(
            f"index cache dtype {index_dtype!r} applies to MSA index keys, and "
            "this model has no MSA layers (use 'auto')"
        )
    return [
        replace(s, index_dtype=index_dtype) if isinstance(s, SparseKVSpec) else s for s in specs
    ]


def with_state_dtype(specs: Sequence[CacheSpec | None], state_dtype: str) -> list[CacheSpec | None]:
    """The specs with every recurrent layer's state kept as `state_dtype` ("float32" or
    "bfloat16"); ValueError for another dtype, or for one other than "float32" when no layer
    has recurrent state."""
    if state_dtype not in STATE_ITEMSIZE:
        raise ValueError(
            f"recurrent state dtype {state_dtype!r}: expected one of {list(STATE_ITEMSIZE)}"
        )
    if state_dtype != "float32" and not any(isinstance(s, RecurrentStateSpec) for s in specs):
        raise ValueError(
            f"recurrent state dtype {state_dtype!r} applies to recurrent (Gated DeltaNet) "
            "state, and this model has no recurrent layers (use 'float32')"
        )
    return [
        replace(s, state_dtype=state_dtype) if isinstance(s, RecurrentStateSpec) else s
        for s in specs
    ]


def paged_bytes_per_block(specs: Sequence[CacheSpec | None], block_size: int, itemsize: int) -> int:
    """Bytes one block takes across every paged layer."""
    return block_size * sum(s.bytes_per_token(itemsize) for s in specs if s is not None and s.paged)


def slot_bytes(specs: Sequence[CacheSpec | None], itemsize: int) -> int:
    """Bytes one request slot takes across every slot-addressed layer."""
    return sum(s.bytes_per_slot(itemsize) for s in specs if s is not None and not s.paged)
