"""Fixed-size KV-cache blocks and the per-request block tables, and the pool of recurrent
(GDN) state slots. Indices only: the tensors live with the worker."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A free list of block indices [0, num_blocks)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class KVCacheManager:
    """Block tables of requests over one BlockPool (all attention layers share a table)."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[int]] = {}

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks for the request to hold `num_tokens` tokens in total."""
        have = len(self.tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens` tokens; False if the pool is short."""
        blocks = self.pool.allocate(self.blocks_needed(request_id, num_tokens))
        if blocks is None:
            return False
        self.tables.setdefault(request_id, []).extend(blocks)
        return True

    def free(self, request_id: str) -> None:
        self.pool.free(self.tables.pop(request_id, []))

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks


class StateSlotPool:
    """Slots of the recurrent-state pool: one per running request."""

    def __init__(self, num_slots: int):
        self._free = deque(range(num_slots))
        self.slots: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str) -> int | None:
        if request_id in self.slots:
            return self.slots[request_id]
        if not self._free:
            return None
        self.slots[request_id] = self._free.popleft()
        return self.slots[request_id]

    def free(self, request_id: str) -> None:
        if request_id in self.slots:
            self._free.append(self.slots.pop(request_id))

