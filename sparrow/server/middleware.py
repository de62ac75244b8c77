"""Pure-ASGI middleware of the app: API keys and per-key rate limits on /v1/ routes and
/tokenize, /detokenize, the request-body limits (its size, counted on the bytes received, so
a chunked body is held to it too, and the time it may take to arrive), and the count of
every response by endpoint and status.

Keys are kept only as SHA-256 digests (a key given as `sha256:<hex>` is taken as its digest,
so a deployment need not hold the plain key); a bearer token is hashed and compared with
every digest in constant time. With a rate limit each key has a token bucket of
`per_minute` requests (the burst is the same number); an empty bucket answers 429 with
Retry-After (whole seconds until a request is allowed again)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import time
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparrow.server.metrics import Metrics
from sparrow.server.protocol import error_body

# Route path -> the `endpoint` label; any other path counts as "other" (bounded labels).
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/models": "models",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/health": "health",
    "/metrics": "metrics",
}
BODY_TIMEOUT_S = 30.0  # for a whole request body to arrive
KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})  # besides /v1/: as costly as a prompt


async def send_error(
    send: Send, status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> None:
    """Answer with OpenAI's error body (and any extra headers)."""
    body = json.dumps(error_body(message, kind, status)).encode()
    extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (the first), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def key_digest(key: str) -> bytes:
    """The stored form of a key: `sha256:<hex>` as given, else the SHA-256 of the key."""
    if key.startswith("sha256:"):
        return bytes.fromhex(key.removeprefix("sha256:"))
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    def __init__(self, keys: Iterable[str]):
        self.digests = [key_digest(k) for k in keys]
        if not self.digests:
            raise ValueError("a key ring needs at least one key")

    def match(self, token: str) -> int | None:
        """The index of the key `token` is, or None; every digest is compared."""
        given, found = hashlib.sha256(token.encode()).digest(), None
        for i, digest in enumerate(self.digests):
            if hmac.compare_digest(given, digest):
                found = i
        return found


class RateLimiter:
    """A token bucket of `per_minute` requests per key."""

    def __init__(self, per_minute: float, clock: Callable[[], float] = time.monotonic):
        if per_minute <= 0:
            raise ValueError(f"rate limit must be positive, got {per_minute}")
        self.rate, self.burst, self.clock = per_minute / 60.0, per_minute, clock
        self._buckets: dict[int, tuple[float, float]] = {}  # key -> (tokens, when)

    def take(self, key: int) -> float:
        """0 if a request of `key` may go now (one token taken), else the seconds to wait."""
        now = self.clock()
        tokens, when = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        if tokens >= 1:
            self._buckets[key] = (tokens - 1, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1 - tokens) / self.rate


class ApiKeys:
    """401 without a known key on /v1/ routes and KEYED_PATHS, given as a bearer token or
    (Anthropic's header) as `x-api-key`; 429 with Retry-After past its rate."""

    def __init__(self, app: ASGIApp, keys: KeyRing, limiter: RateLimiter | None = None):
        self.app, self.keys, self.limiter = app, keys, limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith("/v1/") or path in KEYED_PATHS:
            auth = header(scope, b"authorization") or ""
            token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
            token = token if token is not None else header(scope, b"x-api-key")
            key = self.keys.match(token) if token is not None else None
            if key is None:
                return await send_error(
                    send, 401, "missing or wrong API key", "authentication_error"
                )
            wait = self.limiter.take(key) if self.limiter is not None else 0.0
            if wait > 0:
                return await send_error(
                    send,
                    429,
                    "rate limit reached for this API key",
                    "rate_limit_error",
                    headers={"retry-after": str(math.ceil(wait))},
                )
        await self.app(scope, receive, send)


class BodyLimit:
    """Answers 413 for a body over `max_bytes`: at once from Content-Length, else once the
    bytes received pass the limit; and 408 for a body not whole within `timeout_s` of the
    request's headers (a client trickling bytes holds a connection and a task for as long
    as it likes otherwise). In both cases the app sees a disconnect, and its answer is
    dropped for the error."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = (413, f"request body over {self.max_bytes} bytes")
        length = header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await send_error(send, 413, too_big[1], "invalid_request_error")
        deadline = None
        if self.timeout_s is not None:
            deadline = asyncio.get_running_loop().time() + self.timeout_s
        received, whole, started = 0, False, False
        refusal: tuple[int, str] | None = None

        async def counted() -> Message:
            nonlocal received, whole, refusal
            if refusal is not None:
                return {"type": "http.disconnect"}
            if whole or deadline is None:  # past the body: receive waits for a disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    msg = await receive()
            except TimeoutError:
                refusal = (408, f"the request body did not arrive within {self.timeout_s:g} s")
                return {"type": "http.disconnect"}
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                whole = not msg.get("more_body", False)
                if received > self.max_bytes:
                    refusal = too_big
                    return {"type": "http.disconnect"}
            return msg

        async def guarded(msg: Message) -> None:
            nonlocal started
            if refusal is not None:
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if refusal is None:
                raise
        if refusal is not None and not started:
            status, message = refusal
            # close: the rest of the body would keep the connection busy (h11 reads it)
            await send_error(
                send, status, message, "invalid_request_error", {"connection": "close"}
            )


def endpoint_label(path: str) -> str:
    """The `endpoint` label of a path: ENDPOINTS', a stored response's routes
    (/v1/responses/{id}...) as "responses", any other "other"."""
    if path.startswith("/v1/responses/"):
        return "responses"
    return ENDPOINTS.get(path, "other")


class CountResponses:
    """`sparrow_requests_total{endpoint, status}` for every response, errors included."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint, started = endpoint_label(scope["path"]), False

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
