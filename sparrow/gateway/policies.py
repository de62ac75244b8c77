"""Routing policies: which of the eligible workers (alive, circuit not open) takes a request.

Each policy sees the workers as `Candidate`s (a name and a load: the requests this gateway
has in flight there, or what the worker last reported queued and running, whichever is
more) and the prompt's token ids. SGLang Model Gateway's policies and defaults:
- `round_robin`: in turn;
- `least_load`: the lowest load (ties: the earliest listed);
- `power_of_two`: the lower load of two drawn at random;
- `cache_aware`: while the loads are balanced, the worker whose recent prompts share the
  longest prefix with this one, if that prefix covers more than `cache_threshold` of it,
  else the worker holding the fewest cached blocks; once the busiest worker's load exceeds
  the idlest's by more than `balance_abs` and by a factor over `balance_rel`, least-load.
  Prompts are remembered per worker in 16-token blocks, each keyed by everything before
  it (a radix tree at block granularity), the least recently used evicted past a bound.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("round_robin", "least_load", "power_of_two", "cache_aware")
BLOCK = 16  # tokens per remembered prompt block


@dataclass(frozen=True)
class Candidate:
    name: str  # the worker's address
    load: int


class Policy:
    """Chooses one of a non-empty list of candidates for a prompt."""

    def choose(self, candidates: Sequence[Candidate], prompt: Sequence[int]) -> Candidate:
        raise NotImplementedError

    def routed(self, name: str, prompt: Sequence[int]) -> None:
        """The prompt went to worker `name` (cache-aware remembers it)."""

    def forget(self, name: str) -> None:
        """Worker `name` lost its cache (it restarted or left)."""


class RoundRobin(Policy):
    def __init__(self):
        self._turn = itertools.count()

    def choose(self, candidates, prompt):
        return candidates[next(self._turn) % len(candidates)]


class LeastLoad(Policy):
    def choose(self, candidates, prompt):
        return min(candidates, key=lambda c: c.load)


class PowerOfTwo(Policy):
    def __init__(self, seed: int | None = None):
        self._random = random.Random(seed)

    def choose(self, candidates, prompt):
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._random.sample(list(candidates), 2)
        return a if a.load <= b.load else b


class PrefixBlocks:
    """One worker's recent prompts as chained 16-token block keys, least recently used
    first; at most `max_blocks` of them."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    @staticmethod
    def keys(prompt: Sequence[int]) -> list[int]:
        """The key of each whole block: a hash of its tokens and of every block before it."""
        out, key = [], 0
        for i in range(0, len(prompt) - BLOCK + 1, BLOCK):
            key = hash((key, tuple(prompt[i : i + BLOCK])))
            out.append(key)
        return out

    def matched(self, keys: list[int]) -> int:
        """How many of the leading blocks are remembered."""
        n = 0
        while n < len(keys) and keys[n] in self._blocks:
            n += 1
        return n

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


class CacheAware(Policy):
    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs: int = 32,
        balance_rel: float = 1.1,
        max_blocks: int = 100_000,
    ):
        self.cache_threshold, self.balance_abs, self.balance_rel = (
            cache_threshold,
            balance_abs,
            balance_rel,
        )
        self.max_blocks = max_blocks
        self.trees: dict[str, PrefixBlocks] = {}

    def _tree(self, name: str) -> PrefixBlocks:
        if name not in self.trees:
            self.trees[name] = PrefixBlocks(self.max_blocks)
        return self.trees[name]

    def choose(self, candidates, prompt):
        loads = [c.load for c in candidates]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(
            loads
        ):
            return min(candidates, key=lambda c: c.load)
        keys = PrefixBlocks.keys(prompt)
        best = max(candidates, key=lambda c: self._tree(c.name).matched(keys))
        whole = len(prompt) / BLOCK
        if keys and self._tree(best.name).matched(keys) > self.cache_threshold * whole:
            return best
        return min(candidates, key=lambda c: (len(self._tree(c.name)), c.load))

    def routed(self, name, prompt):
        self._tree(name).insert(PrefixBlocks.keys(prompt))

    def forget(self, name):
        self.trees.pop(name, None)


def make_policy(name: str, seed: int | None = None) -> Policy:
    """The policy called `name` (one of POLICIES); ValueError for another."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "cache_aware":
        return CacheAware()
    raise ValueError(f"unknown routing policy {name!r}; expected one of {POLICIES}")
