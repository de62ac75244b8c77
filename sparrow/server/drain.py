"""Shutdown drain: once the server begins shutting down (SIGTERM / SIGINT, or `begin()`),
requests in flight get `drain_s` seconds to finish; those still open then end: a stream with
an error event and `[DONE]`, a whole response with a 503. New /v1/ requests get a 503."""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any


class ShuttingDown(Exception):
    """The drain window ended before the request did."""


DRAINED = object()  # put on a request's output queue when its drain window ends


class Drain:
    def __init__(self, drain_s: float):
        self.drain_s = drain_s
        self.draining = False
        self._queues: set[asyncio.Queue] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    def open(self, queue: asyncio.Queue) -> None:
        """Register a request's output queue: it receives DRAINED when the window ends."""
        self._queues.add(queue)
        if self._expired:
            queue.put_nowait((None, DRAINED))

    def close(self, queue: asyncio.Queue) -> None:
        self._queues.discard(queue)

    def begin(self) -> None:
        """Start the drain window (idempotent); call on the event loop."""
        if self.draining:
            return
        self.draining = True
        self._timer = asyncio.get_running_loop().call_later(self.drain_s, self._expire)

    def _expire(self) -> None:
        self._expired = True
        for queue in list(self._queues):
            queue.put_nowait((None, DRAINED))

    def hook_signals(self) -> None:
        """Chain onto the current SIGTERM / SIGINT handlers (uvicorn's, which stop the
        server): the drain begins when the signal arrives, then the old handler runs. A
        no-op off the main thread or where no Python handler is installed."""
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if not callable(previous):
                continue

            def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                loop.call_soon_threadsafe(self.begin)
                previous(signum, frame)

            signal.signal(sig, handler)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
