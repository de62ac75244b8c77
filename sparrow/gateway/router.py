"""`Router`: the `EngineClient` a gateway serves from, over several workers.

Each worker is a `Worker`: its address, its connection (a `RemoteEngine`, opened in the
background until the worker answers, so a worker may start after the gateway), its circuit
breaker and the requests in flight there. A request goes to a worker the policy chooses
among the eligible ones: connected, alive by its last health poll (RemoteEngine polls Health
and Load every 0.5 s: a worker that stops answering is ejected, one that answers again is
re-admitted) and not behind an open breaker. A worker that cannot be reached
(`EngineUnreachable`: nothing ran there) or is full (`EngineFull`) hands the request to
another before any token streams; a refused request (`InvalidRequest`, a 4xx) is never
retried and never counts against a worker. Once tokens stream, a failure ends the stream
with `EngineError` (a worker killed mid-stream).

The breaker (SGLang Model Gateway's worker defaults): `failures` worker failures in a row
open it for `open_s` seconds; then one trial request is let through (half-open): its success
closes the breaker, its failure opens it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

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
from sparrow.engine.output_processor import OutputDelta
from sparrow.gateway.policies import Candidate, Policy
from sparrow.multimodal.items import MediaItem

CONNECT_RETRY_S = 1.0  # a worker that has not answered yet is tried again this often


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
        self, address: str, connect: Callable[[str], EngineClient], breaker: CircuitBreaker
    ):
        self.address, self.breaker = address, breaker
        self.engine: EngineClient | None = None
        self.in_flight = 0
        self.retries = 0  # requests handed on to another worker after failing here
        self._connect, self._stop = connect, threading.Event()
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
        return self.engine is not None and self.engine.health().alive

    @property
    def load(self) -> int:
        """Requests there: this gateway's in flight, or the worker's own count if larger."""
        if self.engine is None:
            return self.in_flight
        stats = self.engine.stats()
        return max(self.in_flight, stats.waiting + stats.running)

    async def close(self) -> None:
        self._stop.set()
        if self.engine is not None:
            await self.engine.shutdown()


@dataclass(frozen=True)
class RouterSettings:
    max_attempts: int = 3  # workers tried per request before it fails
    request_timeout_s: float | None = 1800.0  # a stream running longer is aborted
    breaker_failures: int = 5
    breaker_open_s: float = 30.0


class Router(EngineClient):
    """Requests over the workers at `addresses`, chosen by `policy`; `connect(address)`
    opens one (a `RemoteEngine`). Waits up to `wait_s` for the first worker to answer (its
    ModelInfo is the model's); EngineError if none does."""

    def __init__(
        self,
        addresses: Sequence[str],
        connect: Callable[[str], EngineClient],
        policy: Policy,
        settings: RouterSettings = RouterSettings(),
        wait_s: float = 30.0,
    ):
        if not addresses:
            raise ValueError("a router needs at least one worker address")
        self.policy, self.settings = policy, settings
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
        tried: set[str] = set()
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
                stream = await worker.engine.add(request_id, prompt_token_ids, params, media)
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
            return self._relay(request_id, worker, stream)
        if isinstance(last, EngineFull) or last is None:
            raise EngineFull(
                f"no worker can take the request now ({len(self.workers)} configured)"
            ) from last
        raise EngineUnreachable(f"no worker could be reached: {last}") from last

    async def _relay(
        self, request_id: str, worker: Worker, stream: AsyncIterator[OutputDelta]
    ) -> AsyncIterator[OutputDelta]:
        """The worker's stream, counted in flight until its last delta (callers may stop
        reading there); past the request timeout the worker aborts it and the stream ends
        with EngineError."""
        timeout, expired = self.settings.request_timeout_s, []

        def expire() -> None:
            expired.append(True)
            worker.engine.abort(request_id)

        timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, expire)
        worker.in_flight += 1
        try:
            async for delta in stream:
                if delta.finish_reason is not None:
                    self._release(request_id)
                    if expired:
                        raise EngineError(f"the request ran past its {timeout:.0f} s limit")
                    worker.breaker.success()
                yield delta
        except EngineError:
            if not expired:
                worker.breaker.failure()
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._release(request_id)
            with contextlib.suppress(Exception):
                await stream.aclose()  # cancels the call: the worker aborts the request

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
