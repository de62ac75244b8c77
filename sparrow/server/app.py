"""The OpenAI-compatible HTTP app over an `EngineClient`: chat and text completions (streamed
as SSE or whole), Responses (`responses.py`, stored in `response_store.py`), Anthropic's
Messages (`messages.py`), models, health, Prometheus metrics. Pure-ASGI middleware checks the
API key, holds the body to its limits, turns new requests away while the server drains and
counts every response; every error, 404 and 405 included, is answered with OpenAI's error
body (Anthropic's on /v1/messages). Tokenising and chat templates run on a few threads of
their own, off the event loop."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparrow.engine.client import EngineClient
from sparrow.multimodal.pipeline import MediaPipeline
from sparrow.server import messages
from sparrow.server.drain import DRAIN_S, Drain, DrainGate
from sparrow.server.handlers import Handlers
from sparrow.server.metrics import Metrics
from sparrow.server.middleware import (
    BODY_TIMEOUT_S,
    ApiKeys,
    BodyLimit,
    CountResponses,
    KeyRing,
    RateLimiter,
)
from sparrow.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    too_deep,
)
from sparrow.server.reasoning import ReasoningFormat
from sparrow.server.response_store import ResponseStore, ResponseStoreSettings
from sparrow.server.responses import add_responses_routes
from sparrow.server.tool_parsers import ToolFormat
from sparrow.tokenizer import Tokenizer

# Threads that tokenise and render chat templates: tiktoken and HF tokenizers encode without
# the GIL, so a 1 MB prompt (0.1-0.4 s) leaves the event loop free; a few threads bound the
# CPU that concurrent long prompts take from the engine.
TEXT_THREADS = min(4, os.cpu_count() or 1)

ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "server_overloaded",
}

logger = logging.getLogger(__name__)


def build_app(
    engine: EngineClient,
    tokenizer: Tokenizer,
    model_name: str,
    api_key: str | Sequence[str] | None = None,
    max_body_bytes: int | None = None,
    max_waiting: int | None = None,
    drain_s: float = DRAIN_S,
    media: MediaPipeline | None = None,
    reasoning: ReasoningFormat | None = None,
    rate_limit: float | None = None,
    media_executor: Executor | None = None,
    collectors: Sequence[object] = (),
    tool_parser: ToolFormat | None = None,
    body_timeout_s: float | None = BODY_TIMEOUT_S,
    response_store: ResponseStoreSettings | None = None,
) -> FastAPI:
    """The app serving `model_name` from `engine`; `tokenizer` encodes prompts and applies
    the chat template. `api_key`: one or more keys (plain, or `sha256:<hex>`), one of which
    is required as a bearer token on /v1/ routes, /tokenize and /detokenize; `rate_limit`:
    requests per minute per key.
    `max_body_bytes`: the request body limit (None: 64 MiB with `media`, which arrive as data
    URLs, else 1 MiB).
    `body_timeout_s`: the time a request body may take to arrive (None: no limit).
    `max_waiting`: the engine's queue limit (a request of more choices can never be
    admitted). On SIGTERM / SIGINT the app drains (`drain.py`): requests in flight get
    `drain_s` seconds, then end with an error, and `app.state.drain.on_drained` tells the
    server to stop; shutting the app down then shuts the engine down. `media`: image and
    video parts of chat messages (None: the model takes text only), loaded on
    `media_executor` (None: the event loop's threads). `reasoning`: the think markers that
    split chat completions into `reasoning_content` and `content` (None: all text is
    content). `collectors`: more Prometheus collectors for /metrics (a gateway's per-worker
    state). `tool_parser`: the model's tool-call format (`tool_parsers.PARSERS`), parsed
    into `tool_calls` when a chat request gives tools (None: the tools are rendered and the
    text stays text). `response_store`: where `store: true` responses are kept (None: in
    memory, `ResponseStoreSettings`' caps)."""
    drain = Drain(drain_s)
    store = ResponseStore(response_store or ResponseStoreSettings())
    text_executor = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="sparrow-text")

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        drain.hook_signals()
        yield
        drain.stop()
        text_executor.shutdown(wait=False, cancel_futures=True)
        await engine.shutdown()  # uvicorn stopped taking requests and drained in-flight ones
        store.close()
        logger.info("server stopped")

    app = FastAPI(
        title="sparrow", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.drain = drain
    metrics = Metrics(engine)
    for collector in collectors:
        metrics.registry.register(collector)
    app.add_middleware(
        BodyLimit,
        max_bytes=max_body_bytes or ((64 << 20) if media else 1 << 20),
        timeout_s=body_timeout_s,
    )
    if api_key:
        keys = KeyRing([api_key] if isinstance(api_key, str) else api_key)
        app.add_middleware(
            ApiKeys, keys=keys, limiter=RateLimiter(rate_limit) if rate_limit else None
        )
    app.add_middleware(DrainGate, drain=drain)
    app.add_middleware(CountResponses, metrics=metrics)  # outermost: sees every answer
    _add_error_handlers(app)
    handlers = Handlers(
        engine,
        tokenizer,
        model_name,
        metrics,
        drain,
        max_waiting,
        media,
        reasoning,
        media_executor,
        tool_parser,
        text_executor,
    )
    _add_routes(app, engine, handlers, metrics, model_name)
    add_responses_routes(app, handlers, store)  # OpenAI's Responses API
    messages.add_routes(app, handlers)  # Anthropic's Messages API
    return app


def _error(
    status: int, message: str, kind: str, headers: dict | None = None, param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(message, kind, status, param), status_code=status, headers=headers
    )


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_, exc: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'][1:])) or 'body'}: "
            f"{e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()[:5]
        )
        return _error(400, problems or "malformed request", "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_, exc: StarletteHTTPException):
        kind = ERROR_TYPES.get(
            exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error"
        )
        detail = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):  # json.loads: a body ~1,000 levels deep
            detail = too_deep("the body")
        return _error(exc.status_code, detail, kind, exc.headers)

    @app.exception_handler(ApiError)
    async def on_api_error(_, exc: ApiError):
        body = error_body(exc.message, exc.kind, exc.code or exc.status, exc.param)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(_, exc: Exception):
        return _error(500, f"internal error: {exc!r}", "server_error")


def _add_routes(
    app: FastAPI, engine: EngineClient, handlers: Handlers, metrics: Metrics, model_name: str
) -> None:
    @app.get("/health")
    async def health():
        state = engine.health()
        if not state.alive:
            return _error(503, "the engine loop stopped", "server_error")
        if not state.accepting or handlers.drain.draining:
            return _error(503, "the server is shutting down", "server_overloaded")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [engine.info.model_card(model_name)],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await handlers.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await handlers.completions(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await handlers.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await handlers.detokenize(body)
