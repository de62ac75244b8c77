"""The worker's gRPC service: `worker.proto`'s `Worker` around an `EngineClient` (the
in-process `AsyncEngine` in practice).

Generate queues the request with `engine.add`, sends an empty chunk once it is queued, then
one chunk of token ids per output delta; the text the engine decodes stays here (the caller
detokenises with its own tokenizer). A call that is cancelled, or whose client goes away,
aborts its request at once. Refusals become status codes: InvalidRequest and a malformed
message INVALID_ARGUMENT, EngineFull RESOURCE_EXHAUSTED, EngineError INTERNAL while the
engine lives and UNAVAILABLE once its loop stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc

from sparrow.engine.async_engine import AsyncEngine
from sparrow.engine.client import EngineClient, EngineError, EngineFull, InvalidRequest
from sparrow.engine.output_processor import OutputDelta
from sparrow.proto import CHANNEL_OPTIONS
from sparrow.proto import worker_pb2 as pb
from sparrow.proto import worker_pb2_grpc as pb_grpc
from sparrow.rpc import convert

logger = logging.getLogger(__name__)


class WorkerService(pb_grpc.WorkerServicer):
    """`Worker` over `engine`."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        try:
            params = convert.params_from_pb(request.sampling_params)
            media = [convert.media_from_pb(m) for m in request.media]
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            stream = await self.engine.add(rid, list(request.prompt_token_ids), params, media)
        except (InvalidRequest, EngineFull, EngineError) as e:
            await context.abort(self._code(e), str(e))
        finished = False
        try:
            async with contextlib.aclosing(stream):
                yield pb.GenerateChunk(prompt_tokens=len(request.prompt_token_ids))
                completion = 0
                async for delta in stream:
                    completion += len(delta.token_ids)
                    finished = delta.finish_reason is not None
                    yield _chunk(delta, len(request.prompt_token_ids), completion)
        except EngineError as e:
            finished = True
            await context.abort(self._code(e), str(e))
        finally:
            if not finished:  # cancelled or the client went away
                self.engine.abort(rid)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortReply:
        self.engine.abort(request.request_id)
        return pb.AbortReply()

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthReply:
        health = self.engine.health()
        return pb.HealthReply(alive=health.alive, accepting=health.accepting)

    async def Load(self, request: pb.LoadRequest, context) -> pb.LoadReply:
        return convert.stats_to_pb(self.engine.stats())

    async def ModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfoReply:
        return convert.info_to_pb(self.engine.info)

    def _code(self, error: Exception) -> grpc.StatusCode:
        if isinstance(error, InvalidRequest):
            return grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(error, EngineFull):
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        alive = self.engine.health().alive
        return grpc.StatusCode.INTERNAL if alive else grpc.StatusCode.UNAVAILABLE


def _chunk(delta: OutputDelta, prompt_tokens: int, completion_tokens: int) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        token_ids=delta.token_ids,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        logprobs=convert.logprobs_to_pb(delta.logprobs),
        finish_reason=convert.FINISH_TO_PB[delta.finish_reason],
        prompt_logprobs=convert.prompt_logprobs_to_pb(delta.prompt_logprobs),
    )


def make_server(engine: EngineClient, address: str) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server (not started) serving `engine` on `address` ("host:port", port 0
    for any free one), and the port it bound. Call it inside the event loop it runs on."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(WorkerService(engine), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the worker's gRPC port at {address}")
    return server, port


async def serve(engine: AsyncEngine, address: str, grace_s: float = 30.0) -> None:
    """Serve `engine` on `address` until SIGTERM / SIGINT (requests in flight get `grace_s`
    seconds) or until the engine loop fails; then shut the engine down."""
    server, port = make_server(engine, address)
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine.on_fatal = lambda _error: loop.call_soon_threadsafe(stop.set)
    if engine.dead.is_set():
        stop.set()
    host = address.rsplit(":", 1)[0]
    logger.info("worker serving gRPC on %s:%d", host, port)
    await stop.wait()
    await server.stop(grace_s)
    await engine.shutdown()
