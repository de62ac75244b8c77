"""Fixed-size KV-cache blocks and the per-request block tables (with automatic prefix
caching), and the pools of recurrent (GDN) state slots and state snapshots. Indices only: the
tensors live with the worker.

Prefix caching: a full block is identified by its tokens and everything before it, as the key
(id of the previous block's content, the block's token ids, where a media placeholder's
tokens carry the media's digest: `Request.cache_key_ids`): exact, with no hash to collide
over tokens.
Blocks are reference-counted; a block no request holds keeps its content and waits, least
recently used first, until a new block is needed (then it is evicted and its key dropped).
A request admitted with a prefix that matches cached blocks takes them and computes only the
rest.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

ROOT = 0  # the content id "before the first block"


class KVCacheManager:
    """Block tables of requests over `num_blocks` blocks (all attention layers share a table).
    prefix_caching: keep full blocks' contents for reuse (else blocks are plain free-list
    entries)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.tables: dict[str, list[int]] = {}
        self._free = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, content kept: LRU
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its content key
        self._by_key: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}  # -> block, id
        self._content: dict[int, int] = {}  # block -> its content id
        self._next_id = ROOT + 1
        self._chains: dict[str, list[int]] = {}  # request -> content id of each keyed block
        self.queries = self.hits = 0  # prompt tokens looked up / found, for the hit rate

    @property
    def num_free(self) -> int:
        """Blocks a request can take now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks for the request to hold `num_tokens` tokens in total."""
        have = len(self.tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens` tokens (evicting cached blocks
        nobody holds if the free list is short); False, nothing taken, if too few."""
        n = self.blocks_needed(request_id, num_tokens)
        if n > self.num_free:
            return False
        table = self.tables.setdefault(request_id, [])
        for _ in range(n):
            block = self._free.popleft() if self._free else self._evict()
            self._refs[block] = 1
            table.append(block)
        return True

    def free(self, request_id: str) -> None:
        """Drop the request's references, its last blocks first (they are evicted first)."""
        self._chains.pop(request_id, None)
        for block in reversed(self.tables.pop(request_id, [])):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def match(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """The cached blocks that hold the longest prefix of whole blocks of `token_ids`:
        [(block, content id)] in order (empty without prefix caching)."""
        if not self.prefix_caching:
            return []
        found, parent, bs = [], ROOT, self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            entry = self._by_key.get((parent, tuple(token_ids[start : start + bs])))
            if entry is None:
                break
            found.append(entry)
            parent = entry[1]
        return found

    def take(self, request_id: str, blocks: list[tuple[int, int]]) -> None:
        """Start the request's table with matched blocks (from `match`), referencing them."""
        table = self.tables.setdefault(request_id, [])
        if table:
            raise ValueError(f"request {request_id!r} already holds blocks")
        for block, _ in blocks:
            self._refs[block] += 1
            self._cached.pop(block, None)
            table.append(block)
        self._chains[request_id] = [content for _, content in blocks]

    def register(
        self, request_id: str, num_known: int, tokens: Callable[[int, int], list[int]]
    ) -> None:
        """Key the request's blocks that its first `num_known` tokens (computed, and known on
        the host) now fill, so later requests can match them; tokens(start, stop) gives the
        request's token ids in that range."""
        if not self.prefix_caching or request_id not in self.tables:
            return
        chain = self._chains.setdefault(request_id, [])
        table, bs = self.tables[request_id], self.block_size
        while (len(chain) + 1) * bs <= num_known and len(chain) < len(table):
            done = len(chain)
            key = (chain[-1] if chain else ROOT, tuple(tokens(done * bs, (done + 1) * bs)))
            chain.append(self._key(table[done], key))

    def _key(self, block: int, key: tuple[int, tuple[int, ...]]) -> int:
        """File `block` under its content key; returns the content's id (that of another
        block if the same content is cached already)."""
        if key in self._by_key:
            return self._by_key[key][1]
        if block in self._key_of:  # keyed by an earlier request
            return self._content[block]
        content, self._next_id = self._next_id, self._next_id + 1
        self._key_of[block], self._content[block] = key, content
        self._by_key[key] = (block, content)
        return content

    def uncache(self, request_id: str) -> None:
        """Drop the keys of the request's blocks (their contents are not to be trusted: the
        step that wrote them failed)."""
        for block in self.tables.get(request_id, []):
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._by_key[key], self._content[block]
        self._chains.pop(request_id, None)

    def content_id(self, request_id: str, num_blocks: int) -> int | None:
        """The content id of the request's first `num_blocks` blocks once they are keyed
        (what a state snapshot after them is filed under), else None."""
        chain = self._chains.get(request_id, [])
        return chain[num_blocks - 1] if 0 < num_blocks <= len(chain) else None

    def _evict(self) -> int:
        block, _ = self._cached.popitem(last=False)
        key = self._key_of.pop(block)
        del self._by_key[key], self._content[block]
        return block


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


class SnapshotPool:
    """Saved recurrent states, filed by the content id of the blocks they follow: a request
    whose prefix matches those blocks resumes from the snapshot instead of recomputing them.
    A snapshot is reserved when its save is planned and filed once the blocks' content is
    known (decode tokens are read back a step later); filed snapshots are reused least
    recently used first."""

    def __init__(self, num_snapshots: int):
        self.num_snapshots = num_snapshots
        self._by_content: OrderedDict[int, int] = OrderedDict()  # content id -> snapshot
        self._content_of: dict[int, int] = {}
        self._free = deque(range(num_snapshots))

    @property
    def num_filed(self) -> int:
        """Snapshots filed under a content id (what prefix hits can resume from)."""
        return len(self._by_content)

    @property
    def num_free(self) -> int:
        """Snapshots neither filed nor reserved."""
        return len(self._free)

    def find(self, content_id: int) -> int | None:
        """The snapshot filed under content_id (marked recently used), or None."""
        if content_id not in self._by_content:
            return None
        self._by_content.move_to_end(content_id)
        return self._by_content[content_id]

    def reserve(self) -> int | None:
        """A snapshot to save into: a free one, else the least recently used filed one; None
        if every snapshot is reserved (or none are kept)."""
        if self._free:
            return self._free.popleft()
        if not self._by_content:
            return None
        content_id, snapshot = self._by_content.popitem(last=False)
        del self._content_of[snapshot]
        return snapshot

    def file(self, snapshot: int, content_id: int) -> bool:
        """File a reserved snapshot under content_id. False (and the snapshot released) if
        that content is filed already."""
        if content_id in self._by_content:
            self.release(snapshot)
            return False
        self._by_content[content_id], self._content_of[snapshot] = snapshot, content_id
        return True

    def release(self, snapshot: int) -> None:
        """Give a snapshot back (reserved or filed): its state is not to be used."""
        content_id = self._content_of.pop(snapshot, None)
        if content_id is not None:
            del self._by_content[content_id]
        self._free.append(snapshot)
