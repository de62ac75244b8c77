"""The engine on a thread of its own, fed and drained by asyncio handlers.

Handlers never wait for a model step: they validate and tokenize on their side, then drop
the request (or an abort) into an inbox and await the request's outputs on its own queue.
The engine thread drains the inboxes between steps, runs `LLM.step()` while there is work,
and posts each step's outputs to the event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sparrow.core.request import FinishReason, Request
from sparrow.core.sampling_params import TokenLogprob
from sparrow.engine.llm import LLM


@dataclass
class StreamItem:
    token_ids: list[int]  # new tokens
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None


class EngineFull(RuntimeError):
    """The queue is at its limit (or the server is stopping): retry later."""


class AsyncEngine:
    def __init__(self, llm: LLM, max_waiting: int = 256):
        self.llm, self.max_waiting = llm, max_waiting
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._outputs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._work = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="sparrow-engine", daemon=True)
        self._thread.start()

    def add(self, request: Request) -> asyncio.Queue:
        """Queue a validated request (LLM.make_request); raises EngineFull."""
        if self._stopping:
            raise EngineFull("the server is shutting down")
        if self.llm.scheduler.num_waiting + self._inbox.qsize() >= self.max_waiting:
            raise EngineFull(f"{self.max_waiting} requests are already waiting")
        out: asyncio.Queue = asyncio.Queue()
        self._outputs[request.request_id] = (asyncio.get_running_loop(), out)
        self._inbox.put(request)
        self._work.set()
        return out

    async def stream(self, request_id: str, out: asyncio.Queue) -> AsyncIterator[StreamItem]:
        """The request's outputs until it finishes; aborts it if the consumer goes away."""
        finished = False
        try:
            while not finished:
                item: StreamItem = await out.get()
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        self._work.set()

    def stats(self) -> dict[str, float]:
        scheduler = self.llm.scheduler
        return {"waiting": scheduler.num_waiting + self._inbox.qsize(),
                "running": len(scheduler.running), "kv_usage": scheduler.kv.usage}  # fmt: skip

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop taking requests; in-flight ones finish, then the thread exits."""
        self._stopping = True
        self._work.set()
        self._thread.join(timeout=timeout)

    # -- the engine thread ---------------------------------------------------------------

    def _post(self, request_id: str, item: StreamItem) -> None:
        entry = self._outputs.get(request_id)
        if item.finish_reason is not None:
            self._outputs.pop(request_id, None)
        if entry is not None:
            loop, out = entry
            loop.call_soon_threadsafe(out.put_nowait, item)

    def _drain(self) -> None:
        while not self._inbox.empty():
            request = self._inbox.get()
            try:
                self.llm.scheduler.add_request(request)
            except ValueError:  # validated before; only a race with shutdown lands here
                self._post(request.request_id, StreamItem([], FinishReason.ABORT))
        while not self._aborts.empty():
            request_id = self._aborts.get()
            self.llm.abort(request_id)
            self._post(request_id, StreamItem([], FinishReason.ABORT))

    def _run(self) -> None:
        while True:
            self._work.wait()
            self._work.clear()  # before draining: anything added later sets it again
            self._drain()
            if self.llm.scheduler.has_unfinished():
                for out in self.llm.step():
                    item = StreamItem(out.new_token_ids, out.finish_reason, out.logprobs)
                    self._post(out.request_id, item)
                self._work.set()
            elif self._stopping and self._inbox.empty():
                return
