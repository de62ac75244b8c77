"""The OpenAI-compatible HTTP app over an `EngineClient`: chat and text completions (streamed
as SSE or whole), models, health, Prometheus metrics. Middleware checks the API key and the
body size; every error is answered with OpenAI's error body."""

from __future__ import annotations

import contextlib
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from sparrow.engine.client import EngineClient
from sparrow.server.handlers import Handlers
from sparrow.server.metrics import Metrics
from sparrow.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, error_body
from sparrow.tokenizer import Tokenizer


def build_app(engine: EngineClient, tokenizer: Tokenizer, model_name: str,
              api_key: str | None = None, max_body_bytes: int = 1 << 20) -> FastAPI:  # fmt: skip
    """The app serving `model_name` from `engine`; `tokenizer` encodes prompts and applies
    the chat template. `api_key`: required as a bearer token on /v1/ routes. Shutting the
    app down shuts the engine down (after in-flight requests ended)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await engine.shutdown()  # uvicorn stopped taking requests and drained in-flight ones
        print("[sparrow] server stopped", file=sys.stderr, flush=True)

    app = FastAPI(title="sparrow", lifespan=lifespan)
    metrics = Metrics(engine)
    _add_guard(app, api_key, max_body_bytes)
    _add_error_handlers(app)
    _add_routes(app, engine, Handlers(engine, tokenizer, model_name, metrics), metrics,
                model_name)  # fmt: skip
    return app


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status), status_code=status, headers=headers)


def _add_guard(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return _error(401, "missing or wrong API key", "authentication_error")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            return _error(413, f"request body over {max_body_bytes} bytes",
                          "invalid_request_error")  # fmt: skip
        return await call_next(request)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'body'}: {e['msg']}"
                             for e in exc.errors()[:5])  # fmt: skip
        return _error(400, problems or "malformed request", "invalid_request_error")

    @app.exception_handler(ApiError)
    async def on_api_error(_, exc: ApiError):
        return _error(exc.status, exc.message, exc.kind, exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(_, exc: Exception):
        return _error(500, f"internal error: {exc!r}", "server_error")


def _add_routes(app: FastAPI, engine: EngineClient, handlers: Handlers, metrics: Metrics,
                model_name: str) -> None:  # fmt: skip
    @app.get("/health")
    async def health():
        state = engine.health()
        if not state.alive:
            return _error(503, "the engine loop stopped", "server_error")
        if not state.accepting:
            return _error(503, "the server is shutting down", "server_overloaded")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "sparrow"}]}  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await handlers.chat(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await handlers.completions(body)
