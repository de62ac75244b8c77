"""Continuous batching by token budget.

Each step the scheduler returns a plan, `{request_id: num_tokens}`: how many of each
request's not-yet-computed tokens the model processes now. It knows no phases: a prompt is
just many uncomputed tokens (taken in chunks that fit the budget), a decode is one. Running
requests go first, oldest first; waiting ones are admitted while the budget, the sequence
limit, the KV blocks and the recurrent-state slots allow. When a running request needs a
block and none is free, the newest running request is preempted: its blocks and slot are
freed and it returns to the front of the queue to be recomputed later. Nothing is admitted
that does not fit, so the worker never runs out of cache memory.

After a step is launched, `commit` counts its tokens as computed and gives each request
whose input is complete one pending token: sampled on the device, read back later. The next
step can then be planned (and launched) before the host has the tokens: the runner feeds
pending tokens from the device. `resolve` takes the tokens once read back: appends them,
applies the stop conditions (stop tokens, length; stop strings are matched on the text by
the output processor, which then aborts the request here) and frees what finished requests
held. A request whose length limit the pending tokens reach is not planned again (it
finishes on resolve); one that stops on a token computes one step more, discarded.
`update_from_output` is the two at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sparrow.config import CacheConfig, SchedulerConfig
from sparrow.core.block_pool import KVCacheManager, SnapshotPool, StateSlotPool
from sparrow.core.request import FinishReason, Request, RequestOutput, RequestStatus

# states a request saves inside one step's chunk: where its prompt forks from a cached prefix
# and its prompt's last full block
SAVES_INSIDE = 2


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]  # the plan
    new_request_ids: list[str] = field(default_factory=list)  # (re)started this step
    preempted_ids: list[str] = field(default_factory=list)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    state_slots: dict[str, int] = field(default_factory=dict)
    # prefix caching with recurrent layers: the snapshot a (re)started request's state slot
    # is loaded from (instead of zeros), the one its state is saved to after this step, and
    # those its states inside this step's chunk are saved to from inside the recurrent layers'
    # scan: [(tokens of the chunk before the state, snapshot)], at most `SAVES_INSIDE`
    restore: dict[str, int] = field(default_factory=dict)
    save: dict[str, int] = field(default_factory=dict)
    save_inside: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, recurrent: bool = False):
        """config and cache resolved: max_model_len, block_size, num_blocks and
        num_state_slots set. recurrent: the model keeps per-request recurrent state, so a
        prefix hit needs a snapshot of that state where the hit ends. The scheduler sees
        token ids only (stop tokens, length); stop strings are the output processor's
        (sparrow/engine)."""
        if None in (
            config.max_model_len,
            cache.block_size,
            cache.num_blocks,
            cache.num_state_slots,
        ):
            raise ValueError(f"unresolved scheduler settings: {config}, {cache}")
        self.config, self.cache_config = config, cache
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.slots = StateSlotPool(cache.num_state_slots)
        self.recurrent = recurrent
        self.snapshots = SnapshotPool(cache.num_state_snapshots or 0)
        # saves planned, not filed yet: request -> [(blocks the state follows, snapshot)]
        self._unfiled: dict[str, list[tuple[int, int]]] = {}
        self._latest: dict[str, int] = {}  # request -> its latest snapshot past the prompt
        # request -> the block boundaries of its prompt where its state is saved as it is
        # computed (`_plan_boundaries`), ascending, those not reached yet
        self._boundaries: dict[str, list[int]] = {}
        self.requests: dict[str, Request] = {}  # unfinished ones
        # finished with tokens still in flight: request id -> how many (discarded on resolve)
        self._draining: dict[str, int] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._arrivals = 0

    # -- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError for one that can never run."""
        if request.request_id in self.requests or request.request_id in self._draining:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.validate(request)
        request.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def validate(self, request: Request) -> None:
        """Raise ValueError if the request can never run (reads only the config: safe to call
        from another thread)."""
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        limit = self.config.max_model_len
        total = len(request.prompt_token_ids) + request.params.max_tokens
        if total > limit:
            raise ValueError(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                f"({request.params.max_tokens}) = {total} exceeds the context limit of {limit}"
            )
        blocks, size = self.cache_config.num_blocks, self.cache_config.block_size
        if -(-total // size) > blocks:
            raise ValueError(
                f"request needs {total} tokens of KV cache; the cache holds {blocks * size}"
            )

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Finish a request now (with `reason`: STOP when a stop string ended it) and free
        what it holds. False if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, reason)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput({})
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending and self._length_reached(request, request.num_pending):
                i += 1  # its last token is in flight: it finishes when that is resolved
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.kv.allocate(request.request_id, request.num_computed_tokens + n):
                out.num_scheduled_tokens[request.request_id] = n
                budget -= n
                i += 1
                continue
            victim = self.running[-1]  # the newest running request gives way
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                break
        while (
            self.waiting
            and budget > 0
            and not out.preempted_ids
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted with a token in flight: readmitted once it is resolved
            n = self._admit(request, budget, out)
            if n is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.num_scheduled_tokens[request.request_id] = n
            out.new_request_ids.append(request.request_id)
            budget -= n
        for rid, n in out.num_scheduled_tokens.items():
            out.block_tables[rid] = list(self.kv.tables[rid])
            out.state_slots[rid] = self.slots.slots[rid]
            self._plan_snapshot(self.requests[rid], n, out)
        return out

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Give a waiting request its slot, its cached prefix and the blocks for its first
        chunk. Returns the chunk's tokens, or None (nothing held) if it does not fit."""
        rid, bs = request.request_id, self.kv.block_size
        if self.slots.allocate(rid) is None:
            return None
        blocks, restore, match_end = self._prefix_hit(request)
        self.kv.take(rid, blocks)
        request.num_computed_tokens = start = len(blocks) * bs
        n = min(request.num_tokens - start, budget)
        if not self.kv.allocate(rid, start + n):
            self.kv.free(rid)
            self.slots.free(rid)
            request.num_computed_tokens = 0
            return None
        self._plan_boundaries(request, start, match_end)
        self.kv.queries += request.num_tokens
        self.kv.hits += start
        if restore is not None:
            out.restore[rid] = restore
        return n

    def _plan_boundaries(self, request: Request, start: int, match_end: int) -> None:
        """Where an admitted request's state is saved as its prompt is computed from `start`:
        at its last full block before its last token (what a repeat of the prompt, or a
        longer one that starts with it, resumes from) and, where its prompt leaves a cached
        prefix without a snapshot at `match_end`, there (what later prompts on that prefix
        resume from: a conversation on a shared system prompt saves the end of the shared
        blocks, as no request before it could know where prompts would part). Each is saved
        by the step whose chunk reaches it: from inside the scan, or after the step where the
        chunk ends there."""
        if not (self.recurrent and self.snapshots.num_snapshots and self.kv.prefix_caching):
            return
        last = (len(request.prompt_token_ids) - 1) // self.kv.block_size * self.kv.block_size
        marks = sorted({p for p in (match_end, last) if p > start})
        if marks:
            self._boundaries[request.request_id] = marks

    def _prefix_hit(self, request: Request) -> tuple[list[tuple[int, int]], int | None, int]:
        """(cached blocks to start from, the snapshot to restore the recurrent state from,
        tokens the cached blocks match). The last token is always computed (its logits are
        needed); with recurrent state the hit ends where a snapshot exists. A request that
        asks for prompt logprobs computes every position (as vLLM: no hit, its blocks are
        still cached for others)."""
        if not self.kv.prefix_caching or request.params.prompt_logprobs is not None:
            return [], None, 0
        bs = self.kv.block_size
        matched = self.kv.match(request.cache_key_ids(0, request.num_tokens))
        matched = matched[: (request.num_tokens - 1) // bs]
        if not self.recurrent:
            return matched, None, len(matched) * bs
        for j in range(len(matched), 0, -1):
            snapshot = self.snapshots.find(matched[j - 1][1])
            if snapshot is not None:
                return matched[:j], snapshot, len(matched) * bs
        return [], None, len(matched) * bs

    def _plan_snapshot(self, request: Request, n: int, out: SchedulerOutput) -> None:
        """Save the recurrent state at the prompt's boundaries this step's chunk reaches
        (`_plan_boundaries`): from inside the scan, or after the step where the chunk ends on
        one; and past the prompt after each step that ends on a block boundary (only the
        latest is kept: the next turn of a conversation resumes there)."""
        rid, start, bs = request.request_id, request.num_computed_tokens, self.kv.block_size
        end = start + n
        marks = self._boundaries.get(rid, [])
        due = [p for p in marks if p <= end]
        if due:
            if len(due) == len(marks):
                del self._boundaries[rid]
            else:
                self._boundaries[rid] = marks[len(due) :]
        past_prompt = end % bs == 0 and end > len(request.prompt_token_ids)
        if end in due or (self.recurrent and past_prompt):
            snapshot = self._reserve_snapshot(rid, end // bs)
            if snapshot is not None:
                out.save[rid] = snapshot
        for p in due:  # at most SAVES_INSIDE: a request has two boundaries
            snapshot = self._reserve_snapshot(rid, p // bs) if p < end else None
            if snapshot is not None:
                out.save_inside.setdefault(rid, []).append((p - start, snapshot))

    def _reserve_snapshot(self, rid: str, num_blocks: int) -> int | None:
        """A snapshot for rid's state after its first num_blocks blocks (filed once their
        content is keyed), or None if every snapshot is reserved."""
        if not self.snapshots.num_snapshots:
            return None
        snapshot = self.snapshots.reserve()
        if snapshot is not None:
            self._unfiled.setdefault(rid, []).append((num_blocks, snapshot))
        return snapshot

    def update_from_output(
        self, scheduled: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[RequestOutput]:
        """Commit a step and resolve it with the runner's sampled tokens at once (requests
        still inside their prompt sample nothing)."""
        return self.resolve(self.commit(scheduled), sampled)

    def commit(self, scheduled: SchedulerOutput) -> list[str]:
        """Count a launched step's tokens as computed. Returns the requests that sample a
        token in it (their input is complete): each gets one pending token."""
        sampling = []
        for rid, n in scheduled.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.is_finished or request.status is RequestStatus.WAITING:
                continue  # aborted or preempted since the plan was made
            request.num_computed_tokens += n
            self._register(request)
            if request.num_computed_tokens == request.num_tokens:
                request.num_pending += 1
                sampling.append(rid)
        return sampling

    def resolve(self, sampling: list[str], sampled: dict[str, list[int]]) -> list[RequestOutput]:
        """Replace the oldest pending token of each of `sampling` (from `commit`) with what
        was sampled. Returns what each request gained and whether it finished."""
        outputs = []
        for rid in sampling:
            request = self.requests.get(rid)
            if request is None:  # finished meanwhile: its later tokens are discarded
                self._drained(rid)
                continue
            request.num_pending -= 1
            new = []
            reason = None
            for token in sampled.get(rid, []):
                request.output_token_ids.append(token)
                new.append(token)
                reason = self._stop_reason(request, token)
                if reason is not None:
                    break
            self._register(request)
            if reason is not None:
                self._finish(request, reason)
            outputs.append(RequestOutput(rid, new, reason))
        return outputs

    def drop_pending(self, sampling: list[str]) -> None:
        """Forget the pending tokens of a launched step that will never be read (it failed):
        the undo of `commit` for `sampling`. The requests are to be aborted next; finished
        ones stop waiting for these tokens."""
        for rid in sampling:
            request = self.requests.get(rid)
            if request is None:
                self._drained(rid)
            elif request.num_pending:
                request.num_pending -= 1

    @property
    def num_draining(self) -> int:
        """Finished requests whose tokens are still in flight."""
        return len(self._draining)

    # -- internals -----------------------------------------------------------------------

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        if token in request.params.stop_token_ids:
            return FinishReason.STOP
        if self._length_reached(request, 0):
            return FinishReason.LENGTH
        return None

    def _length_reached(self, request: Request, pending: int) -> bool:
        outputs = len(request.output_token_ids) + pending
        total = len(request.prompt_token_ids) + outputs
        return outputs >= request.params.max_tokens or total >= self.config.max_model_len

    def uncache(self, request_ids: list[str]) -> None:
        """Forget the cached contents of these requests' blocks (a step that wrote them
        failed); their planned snapshots are then never filed."""
        for rid in request_ids:
            self.kv.uncache(rid)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache over prompt tokens admitted."""
        return self.kv.hit_rate

    def _register(self, request: Request) -> None:
        """Key the blocks the request's computed, host-known tokens fill; file the snapshots
        that follow them."""
        rid = request.request_id
        known = min(
            request.num_computed_tokens,
            len(request.prompt_token_ids) + len(request.output_token_ids),
        )
        self.kv.register(rid, known, request.cache_key_ids)
        pending = []
        for num_blocks, snapshot in self._unfiled.pop(rid, []):
            content = self.kv.content_id(rid, num_blocks)
            if content is None:
                pending.append((num_blocks, snapshot))
            elif self.snapshots.file(snapshot, content) and num_blocks * self.kv.block_size > len(
                request.prompt_token_ids
            ):
                if rid in self._latest:  # keep the latest past the prompt only
                    self.snapshots.release(self._latest[rid])
                self._latest[rid] = snapshot
        if pending:
            self._unfiled[rid] = pending

    def _release(self, request: Request) -> None:
        rid = request.request_id
        self._register(request)
        for _, snapshot in self._unfiled.pop(rid, []):
            self.snapshots.release(snapshot)  # its blocks' content never became known
        self._latest.pop(rid, None)
        self._boundaries.pop(rid, None)
        self.kv.free(request.request_id)
        self.slots.free(request.request_id)
        if request in self.running:
            self.running.remove(request)

    def _preempt(self, request: Request) -> None:
        """Free everything it holds; it will recompute prompt and outputs when readmitted."""
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._release(request)
        if request in self.waiting:  # preempted while a token was pending
            self.waiting.remove(request)
        if request.num_pending:
            self._draining[request.request_id] = request.num_pending
        request.num_pending = 0
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]  # its id may come again once nothing is in flight

    def _drained(self, request_id: str) -> None:
        left = self._draining.get(request_id, 0) - 1
        if left > 0:
            self._draining[request_id] = left
        else:
            self._draining.pop(request_id, None)
