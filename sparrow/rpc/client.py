"""`RemoteEngine`: the `EngineClient` that runs requests on a worker over gRPC.

`generate` sends Generate and waits, at most `timeout_s`, for the worker's first chunk (the
request is queued) or its refusal; it yields the worker's token outputs as they come (what
a gateway's router follows, and resumes elsewhere when the worker is lost). `add` is the
`EngineClient` over it: the token ids go through this side's own `OutputProcessor`, which
detokenises with the caller's tokenizer and applies stop strings (one found before the worker
stopped is aborted there). Leaving a stream early cancels its call, which aborts the request
on the worker. Status codes come back as the interface's errors: INVALID_ARGUMENT as
InvalidRequest, RESOURCE_EXHAUSTED as EngineFull, UNAVAILABLE (no connection) as
EngineUnreachable, anything else as EngineError.

`info` is read once, when the engine is built; `stats` and `health` are the worker's Load and
Health as a background thread last polled them (a worker that does not answer is not alive),
so neither blocks the event loop. The aio channel belongs to the event loop that first uses
it; `abort` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

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
    check_token_ids,
)
from sparrow.engine.output_processor import OutputDelta, OutputProcessor
from sparrow.multimodal.items import MediaItem
from sparrow.proto import CHANNEL_OPTIONS
from sparrow.proto import worker_pb2 as pb
from sparrow.proto import worker_pb2_grpc as pb_grpc
from sparrow.rpc import convert

POLL_S = 0.5  # Load and Health are polled this often
RPC_TIMEOUT_S = 5.0  # for the unary calls


def status_error(error: grpc.aio.AioRpcError | grpc.RpcError) -> Exception:
    """The `EngineClient` error a worker's status code stands for."""
    code, message = error.code(), error.details() or str(error.code())
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return EngineFull(message)
    if code == grpc.StatusCode.UNAVAILABLE:
        return EngineUnreachable(f"the worker is unreachable: {message}")
    return EngineError(f"the worker answered {code.name}: {message}")


class RemoteEngine(EngineClient):
    """The worker at `target` ("host:port"); `decode(token_ids) -> str` is the tokenizer's,
    `special_ids` its special tokens (`Tokenizer.skipped_ids`). Raises EngineError if the
    worker does not answer ModelInfo within `timeout_s`."""

    def __init__(
        self,
        target: str,
        decode: Callable[[list[int]], str],
        timeout_s: float = RPC_TIMEOUT_S,
        poll_s: float = POLL_S,
        special_ids: frozenset[int] = frozenset(),
    ):
        self.target, self.timeout_s, self.poll_s = target, timeout_s, poll_s
        self._processor = OutputProcessor(decode, on_stop=self.abort, special_ids=special_ids)
        self._sync = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._sync_stub = pb_grpc.WorkerStub(self._sync)
        try:
            reply = self._sync_stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            self._sync.close()
            raise EngineError(f"the worker at {target} does not answer: {e.code().name}") from e
        self._info = convert.info_from_pb(reply)
        self._stats = EngineStats(0, 0, 0.0)
        self._health = EngineHealth(alive=False, accepting=False)
        self._refresh()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.WorkerStub | None = None
        self._pending: set[asyncio.Task] = set()  # Abort calls in flight
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="sparrow-load", daemon=True)
        self._poller.start()

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
        if request_id in self._processor:
            raise InvalidRequest(f"duplicate request id {request_id!r}")
        params = params.stopping_at(self._info.default_stop_token_ids)
        outputs = await self.generate(request_id, prompt_token_ids, params, media)
        self._processor.add(request_id, params)
        return self._stream(request_id, outputs)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        media: Sequence[MediaItem] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request on the worker and return the stream of its token outputs (stop
        token ids as `params` gives them). Raises before anything streams: InvalidRequest,
        EngineFull, EngineUnreachable (no connection, or no answer within `timeout_s`),
        EngineError. The stream raises EngineError if the worker fails or ends it early;
        leaving it cancels the call (the worker aborts the request)."""
        check_token_ids(prompt_token_ids, params, self._info.vocab_size)  # before the uint32s
        stub = self._stub_here()
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=convert.params_to_pb(params),
            media=[convert.media_to_pb(m) for m in media],
        )
        call = stub.Generate(request)
        try:
            accepted = await asyncio.wait_for(call.read(), self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise status_error(e) from e
        except TimeoutError as e:
            call.cancel()
            raise EngineUnreachable(
                f"the worker at {self.target} did not take the request within "
                f"{self.timeout_s:.0f} s"
            ) from e
        except asyncio.CancelledError:
            call.cancel()
            raise
        if accepted is grpc.aio.EOF:
            raise EngineError("the worker closed the stream before queueing the request")
        return self._outputs(request_id, call)

    async def _outputs(self, request_id: str, call) -> AsyncIterator[RequestOutput]:
        """The request's token outputs until the one with a finish reason; the call is
        cancelled (the worker aborts) if the caller stops early."""
        try:
            while True:
                chunk = await call.read()
                if chunk is grpc.aio.EOF:
                    raise EngineError("the worker ended the stream before the request finished")
                out = RequestOutput(
                    request_id,
                    list(chunk.token_ids),
                    convert.FINISH_FROM_PB[chunk.finish_reason],
                    convert.logprobs_from_pb(chunk.logprobs),
                    convert.prompt_logprobs_from_pb(chunk),
                )
                yield out
                if out.finish_reason is not None:
                    return
        except grpc.aio.AioRpcError as e:
            raise status_error(e) from e
        finally:
            call.cancel()  # a no-op once the call ended

    async def _stream(
        self, request_id: str, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[OutputDelta]:
        """The request's deltas, detokenised and stop strings applied here."""
        finished = False
        try:
            async for out in outputs:
                for delta in self._processor.process([out]):
                    finished = delta.finish_reason is not None
                    yield delta
                if finished:
                    return
        finally:
            self._processor.abort(request_id)  # a no-op once it finished
            await outputs.aclose()

    def abort(self, request_id: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._send_abort, request_id)

    def _send_abort(self, request_id: str) -> None:
        if self._stub is None:
            return
        call = self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout_s)
        task = asyncio.ensure_future(call)
        self._pending.add(task)
        task.add_done_callback(self._abort_sent)

    def _abort_sent(self, task: asyncio.Task) -> None:
        self._pending.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a worker that is gone took its requests with it

    def stats(self) -> EngineStats:
        return self._stats

    def health(self) -> EngineHealth:
        return self._health

    async def shutdown(self) -> None:
        """Stop polling and close the channels; the worker keeps running."""
        self._closed.set()
        await asyncio.to_thread(self._poller.join, self.timeout_s)
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._channel is not None and self._loop is asyncio.get_running_loop():
            await self._channel.close()
        self._channel = self._stub = None
        self._sync.close()

    def _stub_here(self) -> pb_grpc.WorkerStub:
        """The stub on the running loop's channel (opened on first use in that loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
            self._stub = pb_grpc.WorkerStub(self._channel)
            self._loop = loop
        return self._stub

    def _poll(self) -> None:
        while not self._closed.wait(self.poll_s):
            self._refresh()

    def _refresh(self) -> None:
        try:
            load = self._sync_stub.Load(pb.LoadRequest(), timeout=self.timeout_s)
            health = self._sync_stub.Health(pb.HealthRequest(), timeout=self.timeout_s)
        except (grpc.RpcError, ValueError):  # ValueError: the channel is closed
            self._health = EngineHealth(alive=False, accepting=False)
            return
        self._stats, self._health = convert.stats_from_pb(load), convert.health_from_pb(health)
