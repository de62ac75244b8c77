"""`Router`: the `EngineClient` a gateway serves from, over several workers.

Each worker is a `Worker`: its address, its connection (a `RemoteEngine`, opened in the
background until the worker answers, so a worker may start after the gateway), its circuit
breaker and the requests in flight there. A request goes to a worker the policy chooses
among the eligible ones: connected, alive by its last health poll (RemoteEngine polls Health
and Load every 0.5 s: a worker that stops answering is ejected, one that answers again is
re-admitted) and not behind an open breaker. A worker that cannot be reached, or does not
take the request within its deadline (`EngineUnreachable`: nothing ran there), or is full
(`EngineFull`) hands the request to another; a refused request (`InvalidRequest`, a 4xx) is
never retried and never counts against a worker.

Workers stream token ids (`generate`); the router detokenises and applies stop strings with
its own `OutputProcessor`, so a stream survives its worker: when the worker fails, ends the
stream early or is ejected by its health polls while the request runs, the request goes on
at another worker as its prompt plus the tokens generated so far (`output_offset`), with the
budget left and the same seed (the router gives every request without one a seed of its
own, so sampled streams resume exactly too), and the client's stream continues with no
visible break. A stream that cannot go on (no worker left to take it, the budget spent)
ends with `EngineError`. `request_timeout_s` counts from the request's admission here.

The breaker (SGLang Model Gateway's worker defaults): `failures` worker failures in a row
open it for `open_s` seconds; then one trial request is let through (half-open): its success
closes the breaker, its failure opens it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sparrow.core.request import RequestOutput
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.client import (
    EngineClient,
    EngineError,
    EngineFull,
    EngineHealth,
    EngineInfo,
    EngineStats,
    EngineUnreachable,
    InvalidRequest,
)
from sparrow.engine.output_processor import Decode, OutputDelta, OutputProcessor
from sparrow.gateway.policies import Candidate, Policy
from sparrow.multimodal.items import MediaItem

logger = logging.getLogger(__name__)

CONNECT_RETRY_S = 1.0  # a worker that has not answered yet is tried again this often
WATCH_S = 0.25  # a stream waiting for its worker checks the worker's health this often


class WorkerClient(Protocol):
    """What the router asks of a worker's connection (`rpc.client.RemoteEngine`)."""

    @property
    def info(self) -> EngineInfo: ...

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        media: Sequence[MediaItem] = (),
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def health(self) -> EngineHealth: ...

    async def shutdown(self) -> None: ...


class WorkerLost(Exception):
    """The worker running a request failed, ended its stream early, or was ejected."""


class TimedOut(Exception):
    """A request ran past the router's request timeout."""


class CircuitBreaker:
    """closed -> open after `failures` in a row -> half-open after `open_s` (one trial)."""

    def __init__(
        self, failures: int = 5, open_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ):
        self.failures, self.open_s, self.clock = failures, open_s, clock
        self._in_a_row, self._opened_at, self._trial = 0, None, False

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self._opened_at >= self.open_s else "open"

    def allows(self) -> bool:
        """Whether a request may go through now (half-open: one trial at a time)."""
        state = self.state
        return state == "closed" or (state == "half_open" and not self._trial)

    def start(self) -> None:
        """A request goes through now."""
        if self.state == "half_open":
            self._trial = True

    def success(self) -> None:
        self._in_a_row, self._opened_at, self._trial = 0, None, False

    def failure(self) -> None:
        self._in_a_row += 1
        if self._trial or self._in_a_row >= self.failures:
            self._opened_at, self._trial = self.clock(), False


class Worker:
    """One worker: `engine` once connected (`connect(address)` returns it or raises)."""

    def __init__(
        self, address: str, connect: Callable[[str], WorkerClient], breaker: CircuitBreaker
    ):
        self.address, self.breaker = address, breaker
        self.engine: WorkerClient | None = None
        self.in_flight = 0
        self.retries = 0  # requests handed on to another worker after failing here
        self.resumed = 0  # of them, requests that had streamed tokens here
        self._connect, self._stop = connect, threading.Event()
        self._ejected = False
        self._thread: threading.Thread | None = None

    def try_connect(self) -> bool:
        try:
            self.engine = self._connect(self.address)
        except EngineError:
            return False
        return True

    def connect_in_background(self, on_connect: Callable[[Worker], None]) -> None:
        def run():
            while not self._stop.is_set():
                if self.try_connect():
                    on_connect(self)
                    return
                self._stop.wait(CONNECT_RETRY_S)

        self._thread = threading.Thread(target=run, name=f"connect-{self.address}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Connected and answering its health polls. A worker back after an ejection (frozen,
        or restarted) starts again with a closed breaker: the failures that came with its
        loss (one per stream it held) are not its record."""
        alive = self.engine is not None and self.engine.health().alive
        if alive and self._ejected:
            self.breaker.success()
        self._ejected = not alive
        return alive

    @property
    def load(self) -> int:
        """Requests there: this gateway's in flight, or the worker's own count if larger (its
        last poll; 0 while it does not answer)."""
        if self.engine is None or not self.alive:
            return self.in_flight
        stats = self.engine.stats()
        return max(self.in_flight, stats.waiting + stats.running)

    async def close(self) -> None:
        self._stop.set()
        if self.engine is not None:
            await self.engine.shutdown()


@dataclass(frozen=True)
class RouterSettings:
    max_attempts: int = 3  # workers tried per request before it fails (each time it starts)
    request_timeout_s: float | None = 1800.0  # from admission: a request running longer ends
    max_resumes: int = 8  # times one stream moves on to another worker
    # a request waits this long for a worker to take it (or a stream its rest) while every
    # worker is down or does not answer: restarting, frozen, ejected
    worker_wait_s: float = 30.0
    breaker_failures: int = 5
    breaker_open_s: float = 30.0


@dataclass
class _Run:
    """A request as the router follows it across workers."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    media: list[MediaItem]
    admitted: float  # time.monotonic() at admission
    generated: list[int] = dataclasses.field(default_factory=list)


class Router(EngineClient):
    """Requests over the workers at `addresses`, chosen by `policy`; `connect(address)`
    opens one (a `RemoteEngine`); `decode` and `special_ids` are the tokenizer's (the text
    side of every stream is here). Waits up to `wait_s` for the first worker to answer (its
    ModelInfo is the model's); EngineError if none does."""

    def __init__(
        self,
        addresses: Sequence[str],
        connect: Callable[[str], WorkerClient],
        policy: Policy,
        settings: RouterSettings = RouterSettings(),
        wait_s: float = 30.0,
        *,
        decode: Decode,
        special_ids: frozenset[int] = frozenset(),
    ):
        if not addresses:
            raise ValueError("a router needs at least one worker address")
        self.policy, self.settings = policy, settings
        self._processor = OutputProcessor(decode, on_stop=self.abort, special_ids=special_ids)
        self.workers = [
            Worker(a, connect, CircuitBreaker(settings.breaker_failures, settings.breaker_open_s))
            for a in addresses
        ]
        self._owner: dict[str, Worker] = {}  # request id -> the worker running it
        self._first = threading.Event()
        for w in self.workers:
            w.connect_in_background(self._connected)
        if not self._first.wait(wait_s):
            raise EngineError(f"no worker answered within {wait_s:.0f} s: {', '.join(addresses)}")
        self._info = next(w.engine.info for w in self.workers if w.engine is not None)

    def _connected(self, worker: Worker) -> None:
        self.policy.forget(worker.address)
        self._first.set()

    @property
    def info(self) -> EngineInfo:
        return self._info

    def eligible(self, exclude: set[str] = frozenset()) -> list[Worker]:
        return [
            w for w in self.workers if w.address not in exclude and w.alive and w.breaker.allows()
        ]

    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        media: Sequence[MediaItem] = (),
    ) -> AsyncIterator[OutputDelta]:
        if request_id in self._processor:
            raise InvalidRequest(f"duplicate request id {request_id!r}")
        admitted = time.monotonic()
        params = params.stopping_at(self._info.default_stop_token_ids)
        if params.seed is None:  # a seed of its own: a sampled stream resumes exactly
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        worker, stream = await self._start_waiting(request_id, prompt_token_ids, params, media)
        self._processor.add(request_id, params)
        run = _Run(request_id, list(prompt_token_ids), params, list(media), admitted)
        return self._relay(run, worker, stream)

    async def _start(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        media: Sequence[MediaItem],
        tried: set[str],
    ) -> tuple[Worker, AsyncIterator[RequestOutput]]:
        """Queue the request at a worker the policy picks among the eligible ones not in
        `tried`, handing it on while workers are unreachable or full. Raises what the last
        refused with (EngineFull, EngineUnreachable), or InvalidRequest at once."""
        last: Exception | None = None
        for _ in range(self.settings.max_attempts):
            workers = self.eligible(tried)
            if not workers:
                break
            chosen = self.policy.choose(
                [Candidate(w.address, w.load) for w in workers], prompt_token_ids
            )
            worker = next(w for w in workers if w.address == chosen.name)
            worker.breaker.start()
            try:
                stream = await worker.engine.generate(request_id, prompt_token_ids, params, media)
            except (EngineUnreachable, EngineFull) as e:
                # full: the worker answered; unreachable: a worker failure
                (
                    worker.breaker.failure
                    if isinstance(e, EngineUnreachable)
                    else worker.breaker.success
                )()
                tried.add(worker.address)
                worker.retries += 1
                last = e
                continue
            except EngineError:
                worker.breaker.failure()
                raise
            except InvalidRequest:  # the request's fault, not the worker's
                worker.breaker.success()
                raise
            self.policy.routed(worker.address, prompt_token_ids)
            self._owner[request_id] = worker
            worker.in_flight += 1
            return worker, stream
        if last is None:
            raise EngineUnreachable(f"no worker is up now ({len(self.workers)} configured)")
        if isinstance(last, EngineFull):
            raise EngineFull(
                f"no worker can take the request now ({len(self.workers)} configured)"
            ) from last
        raise EngineUnreachable(f"no worker could be reached: {last}") from last

    async def _relay(
        self, run: _Run, worker: Worker, stream: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[OutputDelta]:
        """The request's deltas, from `worker` and, each time a worker is lost, from the next
        one that takes the rest of it; past the request timeout the worker aborts it and the
        stream ends with EngineError."""
        rid, resumes = run.request_id, 0
        try:
            while True:
                try:
                    async for delta in self._follow(run, worker, stream):
                        yield delta
                        if delta.finish_reason is not None:
                            return
                    raise WorkerLost("the worker ended the stream before the request finished")
                except TimedOut as e:
                    raise EngineError(str(e)) from None
                except WorkerLost as e:
                    worker.breaker.failure()
                    worker.retries += 1
                    worker.resumed += 1
                    self._release(rid)
                    with contextlib.suppress(Exception):
                        await stream.aclose()
                    resumes += 1
                    worker, stream = await self._resume(run, worker, resumes, e)
        finally:
            self._release(rid)
            self._processor.abort(rid)  # a no-op once it finished
            with contextlib.suppress(Exception):
                await stream.aclose()  # cancels the call: the worker aborts the request

    async def _follow(
        self, run: _Run, worker: Worker, stream: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[OutputDelta]:
        """One worker's part of a stream, as deltas. WorkerLost if the worker fails or is
        ejected while the request waits on it; EngineError past the request timeout."""
        while True:
            task = asyncio.ensure_future(anext(stream))
            try:
                await self._wait(run, worker, task)
                out = task.result()
            except StopAsyncIteration:
                return
            except (EngineError, InvalidRequest) as e:  # the worker's stream failed
                raise WorkerLost(f"the worker at {worker.address} failed: {e}") from e
            finally:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            run.generated += out.new_token_ids
            for delta in self._processor.process([out]):
                if delta.finish_reason is not None:
                    worker.breaker.success()
                    self._release(run.request_id)
                yield delta

    async def _wait(self, run: _Run, worker: Worker, task: asyncio.Future) -> None:
        """Until `task` (the worker's next output) is done: TimedOut past the request timeout
        (the worker aborts the request), WorkerLost once the worker is ejected."""
        timeout = self.settings.request_timeout_s
        while not task.done():
            await asyncio.wait({task}, timeout=WATCH_S)
            if timeout is not None and time.monotonic() - run.admitted > timeout:
                worker.engine.abort(run.request_id)
                raise TimedOut(f"the request ran past its {timeout:.0f} s limit")
            if not task.done() and not worker.alive:
                raise WorkerLost(f"the worker at {worker.address} stopped answering")

    async def _resume(
        self, run: _Run, lost: Worker, resumes: int, cause: Exception
    ) -> tuple[Worker, AsyncIterator[RequestOutput]]:
        """The rest of the request at another worker: its prompt plus the tokens generated so
        far, the budget left. EngineError when it cannot go on."""
        left = run.params.max_tokens - len(run.generated)
        if resumes > self.settings.max_resumes or left <= 0:
            raise EngineError(f"the stream could not be resumed: {cause}") from cause
        params = dataclasses.replace(
            run.params,
            max_tokens=left,
            output_offset=run.params.output_offset + len(run.generated),
            prompt_logprobs=None if run.generated else run.params.prompt_logprobs,
        )
        logger.info(
            "request %s: resuming after %d tokens away from %s (%s)",
            run.request_id,
            len(run.generated),
            lost.address,
            cause,
        )
        try:
            return await self._start_waiting(
                run.request_id, run.prompt + run.generated, params, run.media, lost.address, True
            )
        except (EngineFull, EngineUnreachable, InvalidRequest) as e:
            raise EngineError(f"the stream could not be resumed: {cause}; then {e}") from e

    async def _start_waiting(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        media: Sequence[MediaItem],
        lost: str | None = None,
        full_waits: bool = False,
    ) -> tuple[Worker, AsyncIterator[RequestOutput]]:
        """`_start`, waiting up to `worker_wait_s` while no worker can be reached (every one
        down or not answering; with `full_waits`, full too: a stream under way is not
        refused). The worker at `lost` is tried last (once it answers again: restarted)."""
        until, tried = time.monotonic() + self.settings.worker_wait_s, set()
        if lost is not None:
            tried.add(lost)
        while True:
            try:
                return await self._start(request_id, prompt_token_ids, params, media, tried)
            except (EngineFull, EngineUnreachable) as e:
                waits = isinstance(e, EngineUnreachable) or full_waits
                if not waits or time.monotonic() > until:
                    raise
                tried = set()
                await asyncio.sleep(WATCH_S)

    def _release(self, request_id: str) -> None:
        """The request leaves its worker's count (once: at its last delta or its end)."""
        worker = self._owner.pop(request_id, None)
        if worker is not None:
            worker.in_flight -= 1

    def abort(self, request_id: str) -> None:
        worker = self._owner.get(request_id)
        if worker is not None and worker.engine is not None:
            worker.engine.abort(request_id)

    def stats(self) -> EngineStats:
        """The workers' queues and running requests summed, KV use and hit rate averaged."""
        stats = [w.engine.stats() for w in self.workers if w.alive]
        if not stats:
            return EngineStats(0, 0, 0.0)
        return EngineStats(
            sum(s.waiting for s in stats),
            sum(s.running for s in stats),
            sum(s.kv_usage for s in stats) / len(stats),
            sum(s.prefix_hit_rate for s in stats) / len(stats),
        )

    def health(self) -> EngineHealth:
        """Alive while some worker is; accepting while some worker takes requests."""
        states = [w.engine.health() for w in self.workers if w.engine is not None]
        return EngineHealth(any(s.alive for s in states), any(s.accepting for s in states))

    async def shutdown(self) -> None:
        """Close every connection; the workers keep running."""
        await asyncio.gather(*(w.close() for w in self.workers))
