"""The engine on a thread of its own, behind `EngineClient`, fed and drained by asyncio.

Handlers never wait for a model step: `add` validates on their side, then drops the request
into the inbox and returns a stream reading the request's own queue. The engine thread
takes adds and aborts from the inbox in order between steps, runs `LLM.step()` while there
is work, turns each step's token outputs into text deltas with the output processor (which
ends a request at a stop string and aborts it in the scheduler at once) and posts them to
the event loop.

Failures: a step that raises fails the requests it ran (`StepFailed`: their streams raise
`EngineError`, the scheduler and runner have freed them) and the others go on. A failure
pinned on no request, one that breaks the device (a CUDA error is sticky) or
`MAX_FAILED_STEPS` failed steps in a row stop the loop: every open stream raises
`EngineError`, health turns dead, `dead` is set and `on_fatal(error)` is called, so a
server can exit for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Sequence

from sparrow.core.request import FinishReason, Request
from sparrow.core.sampling_params import SamplingParams
from sparrow.core.structured import GrammarSpec
from sparrow.engine.client import (
    EngineClient,
    EngineError,
    EngineFull,
    EngineHealth,
    EngineInfo,
    EngineStats,
    InvalidRequest,
)
from sparrow.engine.llm import LLM, StepFailed
from sparrow.engine.output_processor import OutputDelta
from sparrow.multimodal.items import MediaItem

# ("add", (request, its media)) or ("abort", request_id)
_Message = tuple[str, tuple[Request, tuple[MediaItem, ...]] | str]
MAX_FAILED_STEPS = 3  # in a row: the engine is broken, not a request

logger = logging.getLogger(__name__)


class AsyncEngine(EngineClient):
    """The in-process EngineClient over an `LLM`. At most `max_waiting` requests queue.
    `on_fatal(error)` is called on the engine thread if the loop stops on an error."""

    def __init__(
        self,
        llm: LLM,
        max_waiting: int = 256,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        self._llm, self.max_waiting, self.on_fatal = llm, max_waiting, on_fatal
        self._info = llm.info()
        self._processor = llm.output_processor()  # the engine thread's alone
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._added = self._taken = 0  # adds put in / taken from the inbox (one writer each)
        self._outputs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._work = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self.dead = threading.Event()  # set once the loop stopped on an error
        self._failed_steps = 0  # in a row
        self._thread = threading.Thread(target=self._run, name="sparrow-engine", daemon=True)
        self._thread.start()

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        media: Sequence[MediaItem] = (),
    ) -> AsyncIterator[OutputDelta]:
        self._check_accepting()
        if request_id in self._outputs:
            raise InvalidRequest(f"duplicate request id {request_id!r}")
        try:
            if params.grammar is not None:  # compiled off the event loop (ms to seconds)
                await asyncio.to_thread(self._compile, params.grammar)
            request = self._llm.make_request(list(prompt_token_ids), params, request_id, media)
        except ValueError as e:
            raise InvalidRequest(str(e)) from e
        if self.stats().waiting >= self.max_waiting:
            raise EngineFull(f"{self.max_waiting} requests are already waiting")
        out: asyncio.Queue = asyncio.Queue()
        self._outputs[request_id] = (asyncio.get_running_loop(), out)
        if self._error is not None:  # failed while registering: nobody would post to it
            self._outputs.pop(request_id, None)
            self._check_accepting()
        self._added += 1
        self._inbox.put(("add", (request, tuple(media))))
        self._work.set()
        return self._stream(request_id, out)

    def _compile(self, spec: GrammarSpec) -> None:
        self._llm.grammar_compiler().compile(spec)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._work.set()

    def stats(self) -> EngineStats:
        stats = self._llm.stats()
        queued = self._added - self._taken
        return dataclasses.replace(stats, waiting=stats.waiting + queued)

    def health(self) -> EngineHealth:
        alive = self._error is None and self._thread.is_alive()
        return EngineHealth(alive=alive, accepting=alive and not self._stopping)

    async def shutdown(self, timeout: float = 60.0) -> None:
        """Stop taking requests; in-flight ones finish, then the thread exits."""
        self._stopping = True
        self._work.set()
        await asyncio.to_thread(self._thread.join, timeout)

    def _check_accepting(self) -> None:
        if self._error is not None:
            raise EngineError(f"the engine stopped: {self._error!r}")
        if self._stopping:
            raise EngineFull("the server is shutting down")

    async def _stream(self, request_id: str, out: asyncio.Queue) -> AsyncIterator[OutputDelta]:
        """The request's deltas until it finishes; aborts it if the consumer goes away."""
        finished = False
        try:
            while not finished:
                item: OutputDelta | BaseException = await out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    # -- the engine thread ---------------------------------------------------------------

    def _post(self, request_id: str, item: OutputDelta | BaseException) -> None:
        last = isinstance(item, BaseException) or item.finish_reason is not None
        entry = self._outputs.pop(request_id, None) if last else self._outputs.get(request_id)
        if entry is not None:
            loop, out = entry
            try:
                loop.call_soon_threadsafe(out.put_nowait, item)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _drain(self) -> None:
        while not self._inbox.empty():
            kind, payload = self._inbox.get()
            if kind == "add":
                self._taken += 1
                self._admit(*payload)
            elif self._processor.abort(payload) is not None:
                self._llm.abort(payload)
                self._post(payload, OutputDelta(payload, [], "", FinishReason.ABORT))

    def _admit(self, request: Request, media: tuple[MediaItem, ...]) -> None:
        try:
            self._llm.admit(request, media)
        except ValueError:  # validated before; only a duplicate id lands here
            self._post(
                request.request_id, OutputDelta(request.request_id, [], "", FinishReason.ABORT)
            )
            return
        self._processor.add(request.request_id, request.params)

    def _loop(self) -> None:
        while True:
            self._work.wait()
            self._work.clear()  # before draining: anything added later sets it again
            self._drain()
            if self._llm.has_unfinished():
                self._step()
                self._work.set()
            elif self._stopping and self._inbox.empty():
                return

    def _step(self) -> None:
        """One step; its deltas posted. A failed step fails its requests (re-raised when the
        engine cannot go on); a request whose output cannot be processed fails alone."""
        try:
            outputs = self._llm.step()
        except StepFailed as e:
            self._failed_steps += 1
            if (
                not e.request_ids
                or self._failed_steps >= MAX_FAILED_STEPS
                or "CUDA error" in str(e.cause)
            ):
                raise
            logger.error(
                "a step failed; its %d requests end with an error",
                len(e.request_ids),
                exc_info=e.cause,
            )
            for request_id in e.request_ids:
                self._fail(request_id, f"the request failed in the engine: {e.cause!r}")
            return
        self._failed_steps = 0
        for out in outputs:
            try:
                deltas = self._processor.process([out])
            except Exception as e:  # noqa: BLE001 (decoding this request's tokens failed)
                logger.exception("the output of request %s failed", out.request_id)
                self._llm.abort(out.request_id)
                self._fail(out.request_id, f"the request's output failed: {e!r}")
                continue
            for delta in deltas:
                self._post(delta.request_id, delta)

    def _fail(self, request_id: str, message: str) -> None:
        self._processor.abort(request_id)
        self._post(request_id, EngineError(message))

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 (reported, then every stream ends with it)
            self._error = e.cause if isinstance(e, StepFailed) else e
            logger.exception("the engine loop failed")
            for request_id in list(self._outputs):
                self._post(request_id, EngineError(f"the engine stopped: {self._error!r}"))
            self._release()
            self.dead.set()
            if self.on_fatal is not None:
                self.on_fatal(self._error)

    def _release(self) -> None:
        """Best effort after a fatal error: nothing stays held (the state may be broken)."""
        try:
            self._llm.abort_all()
            for request_id in list(self._processor.request_ids()):
                self._processor.abort(request_id)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
