"""Pure-ASGI middleware of the app: the API key on /v1/ routes, the request-body limit
(counted on the bytes received, so a chunked body is held to it too), and the count of every
response by endpoint and status."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparrow.server.metrics import Metrics
from sparrow.server.protocol import error_body

# Route path -> the `endpoint` label; any other path counts as "other" (bounded labels).
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
             "/v1/models": "models", "/health": "health", "/metrics": "metrics"}  # fmt: skip


async def send_error(send: Send, status: int, message: str, kind: str) -> None:
    """Answer with OpenAI's error body."""
    body = json.dumps(error_body(message, kind, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class ApiKey:
    """Requires `Authorization: Bearer <key>` on /v1/ routes (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = (_header(scope, b"authorization") or "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                return await send_error(send, 401, "missing or wrong API key",
                                        "authentication_error")  # fmt: skip
        await self.app(scope, receive, send)


class BodyLimit:
    """Answers 413 for a body over `max_bytes`: at once from Content-Length, else once the
    bytes received pass the limit (the app then sees a disconnect, and its answer is dropped
    for the 413)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"request body over {self.max_bytes} bytes"
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await send_error(send, 413, message, "invalid_request_error")
        received, over, started = 0, False, False

        async def counted() -> Message:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    return {"type": "http.disconnect"}
            return msg

        async def guarded(msg: Message) -> None:
            nonlocal started
            if over:
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over:
                raise
        if over and not started:
            await send_error(send, 413, message, "invalid_request_error")


class CountResponses:
    """`sparrow_requests_total{endpoint, status}` for every response, errors included."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint, started = ENDPOINTS.get(scope["path"], "other"), False

        async def counted(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                self.metrics.requests.labels(endpoint, str(msg["status"])).inc()
            await send(msg)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:  # the server-error middleware outside answers 500
                self.metrics.requests.labels(endpoint, "500").inc()
            raise
