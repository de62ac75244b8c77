"""OpenAI-compatible HTTP API over the engine: chat and text completions (streamed as SSE or
whole), models, health, Prometheus metrics. Errors use OpenAI's error body."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sparrow.core.detokenizer import IncrementalText
from sparrow.core.request import FinishReason
from sparrow.core.sampling_params import SamplingParams, TokenLogprob
from sparrow.engine.async_engine import AsyncEngine, EngineFull
from sparrow.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
)

DEFAULT_MAX_TOKENS = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status), status_code=status, headers=headers)


class Metrics:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.requests = Counter("sparrow_requests", "HTTP requests", ["endpoint", "status"],
                                registry=r)  # fmt: skip
        self.prompt_tokens = Counter("sparrow_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("sparrow_generation_tokens", "generated tokens",
                                         registry=r)  # fmt: skip
        self.aborted = Counter("sparrow_aborted_requests", "requests aborted", registry=r)
        self.ttft = Histogram("sparrow_time_to_first_token_seconds", "time to first token",
                              registry=r)  # fmt: skip
        self.itl = Histogram("sparrow_inter_token_latency_seconds", "inter-token latency",
                             registry=r)  # fmt: skip
        self.waiting = Gauge("sparrow_queue_depth", "requests waiting", registry=r)
        self.running = Gauge("sparrow_running_requests", "requests running", registry=r)
        self.kv_usage = Gauge("sparrow_kv_cache_usage", "fraction of KV blocks in use",
                              registry=r)  # fmt: skip

    def render(self) -> bytes:
        stats = self.engine.stats()
        self.waiting.set(stats["waiting"])
        self.running.set(stats["running"])
        self.kv_usage.set(stats["kv_usage"])
        return generate_latest(self.registry)


@dataclass
class Choice:
    """One of the n completions of a request, decoded as its tokens arrive."""

    index: int
    request_id: str
    stops: tuple[str, ...]
    decoded: IncrementalText
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # emitted so far
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def advance(self, new_ids: list[int], finish: FinishReason | None) -> str:
        """Add tokens; returns the text that may be emitted now. Holds back an incomplete
        UTF-8 sequence and, until the end, anything that could begin a stop string."""
        self.token_ids += new_ids
        self.finish_reason = finish
        full = self.decoded.add(new_ids, final=finish is not None)
        for stop in self.stops:
            at = full.find(stop)
            if at >= 0:
                full = full[:at]
                self.finish_reason = FinishReason.STOP
        if self.finish_reason is None:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            full = full[: len(full) - hold] if hold else full
        delta, self.text = full[len(self.text) :], full
        return delta


def chat_logprobs(entries: list[TokenLogprob], decode) -> dict:
    """OpenAI chat format: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def one(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [one(e.token_id, e.logprob)
                        | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}  # fmt: skip


def text_logprobs(entries: list[TokenLogprob], decode, offset: int) -> dict:
    """OpenAI completions format: parallel lists and text offsets."""
    tokens = [decode(e.token_id) for e in entries]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}  # fmt: skip


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20) -> FastAPI:  # fmt: skip
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        engine.shutdown()  # after uvicorn stopped taking requests and drained in-flight ones
        print("[sparrow] server stopped", file=sys.stderr, flush=True)

    app = FastAPI(title="sparrow", lifespan=lifespan)
    metrics = Metrics(engine)
    llm = engine.llm
    context_limit = llm.scheduler.config.max_model_len

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

    @app.exception_handler(RequestValidationError)
    async def on_validation(_, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'body'}: {e['msg']}"
                             for e in exc.errors()[:5])  # fmt: skip
        return _error(400, problems or "malformed request", "invalid_request_error")

    @app.exception_handler(ApiError)
    async def on_api_error(_, exc: ApiError):
        return _error(exc.status, exc.message, exc.kind, exc.headers)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "sparrow"}]}  # fmt: skip

    def start(body: SamplingFields, prompt, max_tokens: int | None, endpoint: str):
        if body.model != model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves "
                                f"{model_name!r}", "not_found_error")  # fmt: skip
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= i < llm.model.config.vocab_size for i in ids):
            raise ApiError(400, "prompt token ids out of range", "invalid_request_error")
        room = context_limit - len(ids)
        params = SamplingParams(
            max_tokens=max_tokens or max(1, min(DEFAULT_MAX_TOKENS, room)),
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            seed=body.seed, stop=body.stop_strings(), logprobs=body.logprobs_count(),
            ignore_eos=body.ignore_eos,
        )  # fmt: skip
        try:  # n requests, seeds seed, seed + 1, ... so the choices differ reproducibly
            requests = [
                llm.make_request(ids, dataclasses.replace(
                    params, seed=None if body.seed is None else body.seed + i))
                for i in range(body.n)
            ]  # fmt: skip
        except ValueError as e:
            raise ApiError(400, f"{e} (context limit {context_limit} tokens)",
                           "invalid_request_error") from e  # fmt: skip
        choices = [Choice(i, r.request_id, params.stop, IncrementalText(llm.tokenizer.decode))
                   for i, r in enumerate(requests)]  # fmt: skip
        queues = []
        try:
            for r in requests:
                queues.append(engine.add(r))
        except EngineFull as e:
            for r in requests[: len(queues)]:
                engine.abort(r.request_id)
            raise ApiError(503, str(e), "server_overloaded", {"Retry-After": "1"}) from e
        metrics.prompt_tokens.inc(len(ids) * body.n)
        metrics.requests.labels(endpoint, "200").inc()
        return ids, choices, queues

    async def events(choices, queues) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, text delta) as tokens arrive, all choices interleaved; aborts every
        unfinished choice if the consumer stops early (client gone)."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(choice, out):
            async for item in engine.stream(choice.request_id, out):
                await merged.put((choice, item))

        tasks = [asyncio.create_task(pump(c, q)) for c, q in zip(choices, queues, strict=True)]
        start = last = time.perf_counter()
        open_choices = len(choices)
        try:
            while open_choices:
                choice, item = await merged.get()
                if choice.finish_reason is not None:
                    continue  # tokens in flight after a stop string ended the choice
                now = time.perf_counter()
                if item.token_ids:
                    (metrics.ttft if not choice.token_ids else metrics.itl).observe(
                        now - (start if not choice.token_ids else last)
                    )
                    last = now
                    metrics.generation_tokens.inc(len(item.token_ids))
                delta = choice.advance(item.token_ids, item.finish_reason)
                choice.logprobs += item.logprobs or []
                if choice.finish_reason is not None:
                    open_choices -= 1
                    if item.finish_reason is None:  # a stop string ended it here
                        engine.abort(choice.request_id)
                yield choice, delta, item.logprobs or []
        finally:
            for task in tasks:
                task.cancel()
            for c in choices:
                if c.finish_reason is None:
                    metrics.aborted.inc()
                    engine.abort(c.request_id)

    def decode(token_id: int) -> str:
        return llm.tokenizer.decode([token_id])

    def usage(ids, choices) -> dict:
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": len(ids), "completion_tokens": completion,
                "total_tokens": len(ids) + completion}  # fmt: skip

    def reason(c: Choice) -> str:
        return "length" if c.finish_reason is FinishReason.LENGTH else "stop"

    async def respond(body: SamplingFields, ids, choices, queues, chat: bool):
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        wants_logprobs = body.logprobs_count() is not None

        def logprobs_json(entries: list[TokenLogprob], offset: int = 0):
            if not wants_logprobs:
                return None
            return (
                chat_logprobs(entries, decode) if chat else text_logprobs(entries, decode, offset)
            )

        if not body.stream:
            async for _ in events(choices, queues):
                pass
            out = [{"index": c.index, "finish_reason": reason(c),
                    **({"message": {"role": "assistant", "content": c.text}} if chat
                       else {"text": c.text}), "logprobs": logprobs_json(c.logprobs)}
                   for c in choices]  # fmt: skip
            return {"id": rid, "object": kind, "created": created, "model": model_name,
                    "choices": out, "usage": usage(ids, choices)}  # fmt: skip

        def chunk(choices_part: list, **extra) -> str:
            data = {
                "id": rid,
                "object": f"{kind}.chunk" if chat else kind,
                "created": created,
                "model": model_name,
                "choices": choices_part,
                **extra,
            }
            return f"data: {json.dumps(data)}\n\n"  # fmt: skip

        async def sse():
            if chat:
                for c in choices:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None}])  # fmt: skip
            async for c, delta, new_logprobs in events(choices, queues):
                done = reason(c) if c.finish_reason is not None else None
                if not delta and done is None and not new_logprobs:
                    continue
                part = {"delta": {"content": delta}} if chat else {"text": delta}
                lp = logprobs_json(new_logprobs, len(c.text) - len(delta))
                yield chunk([{"index": c.index, **part, "finish_reason": done, "logprobs": lp}])
            if body.stream_options and body.stream_options.include_usage:
                yield chunk([], usage=usage(ids, choices))
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            prompt = llm.tokenizer.apply_chat_template(messages)
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_request_error") from e
        max_tokens = body.max_completion_tokens or body.max_tokens
        ids, choices, queues = start(body, prompt, max_tokens, "chat")
        return await respond(body, ids, choices, queues, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        ids, choices, queues = start(body, body.prompt, body.max_tokens, "completions")
        return await respond(body, ids, choices, queues, chat=False)

    return app
