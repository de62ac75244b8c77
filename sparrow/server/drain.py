"""Shutdown drain. The first SIGTERM / SIGINT (or `begin()`) starts it; the listener stays
open meanwhile: new requests get 503 + Retry-After (`DrainGate`), /health its 503, and the
requests in flight get `drain_s` seconds to finish. Those still open then end: a stream
with an error event and `[DONE]`, a whole response with a 503. The drain is over when the
last request in flight ends or the window does; only then is the server told to stop
(`on_drained`), so it closes the listener and exits 0. A second signal stops it at once."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from sparrow.server.middleware import send_error

DRAIN_S = 10.0  # the default window
RETRY_AFTER_S = 1  # a draining replica's load balancer has others to send the retry to
OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered while draining (/health: 503)

logger = logging.getLogger(__name__)


class ShuttingDown(Exception):
    """The drain window ended before the request did."""


DRAINED = object()  # put on a request's output queue when its drain window ends


class Drain:
    def __init__(self, drain_s: float = DRAIN_S):
        self.drain_s = drain_s
        self.draining = False
        # Tells the server to stop; set by the command that runs it (uvicorn's should_exit).
        # None: the signal handler the drain replaced is called instead.
        self.on_drained: Callable[[], None] | None = None
        self.in_flight = 0  # requests past DrainGate, not yet answered
        self._queues: set[asyncio.Queue] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._expired = self._done = False
        self._signalled: tuple[Callable, int] | None = None  # (replaced handler, signal)

    def open(self, queue: asyncio.Queue) -> None:
        """Register a request's output queue: it receives DRAINED when the window ends."""
        self._queues.add(queue)
        if self._expired:
            queue.put_nowait((None, DRAINED))

    def close(self, queue: asyncio.Queue) -> None:
        self._queues.discard(queue)

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.draining and self.in_flight == 0:
            self._finish()

    def begin(self) -> None:
        """Start the drain window (idempotent); call on the event loop."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining: %d requests in flight, up to %g s", self.in_flight, self.drain_s)
        self._timer = asyncio.get_running_loop().call_later(self.drain_s, self._expire)
        if self.in_flight == 0:
            self._finish()

    def _expire(self) -> None:
        self._expired = True
        for queue in list(self._queues):
            queue.put_nowait((None, DRAINED))
        self._finish()  # the server waits for the streams to send their error ends

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        self.stop()
        if self.on_drained is not None:
            self.on_drained()
        elif self._signalled is not None:
            handler, signum = self._signalled
            handler(signum, None)

    def hook_signals(self) -> None:
        """Take over SIGTERM / SIGINT from the current handlers (uvicorn's, which close the
        listener at once): the first signal begins the drain; a second one goes to the old
        handler, which stops the server now. A no-op off the main thread or where no Python
        handler is installed."""
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if not callable(previous):
                continue

            def handler(signum: int, frame: Any, previous: Callable = previous) -> None:
                if self._signalled is not None:  # a second signal: stop now
                    self._done = True
                    self.stop()
                    previous(signum, frame)
                    return
                self._signalled = (previous, signum)
                loop.call_soon_threadsafe(self.begin)

            signal.signal(sig, handler)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class DrainGate:
    """Pure-ASGI: counts the requests in flight for `drain`; while it drains, answers new
    requests (other than OPEN_PATHS) 503 with Retry-After."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining and scope["path"] not in OPEN_PATHS:
            return await send_error(
                send,
                503,
                "the server is shutting down",
                "server_overloaded",
                headers={"retry-after": str(RETRY_AFTER_S)},
            )
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
