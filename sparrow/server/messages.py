"""Anthropic's Messages API over the chat machinery: `POST /v1/messages`, whole or streamed
as Anthropic's server-sent events, and `POST /v1/messages/count_tokens`. A request is
converted to the internal chat request (`messages_protocol.chat_request`), run as a chat job
(`Handlers.start_chat`: the reasoning and tool-call parsers split its output), and its
choice written back as content blocks: reasoning as `thinking` blocks (each with a
signature: the SHA-256 of its text), text as `text` blocks, tool calls as `tool_use`
blocks. A whole response's blocks come from the same `Reply` as a stream's, fed the whole
output at once.

Every error on these routes, the middleware's (401, 413, 503) included, is answered in
Anthropic's shape (`AnthropicErrors`); a stream that fails after it started ends with an
`error` event."""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparrow.core.request import FinishReason
from sparrow.engine.client import EngineError
from sparrow.engine.output_processor import OutputDelta
from sparrow.server.drain import ShuttingDown
from sparrow.server.handlers import Handlers
from sparrow.server.jobs import Choice, Job
from sparrow.server.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    error_body,
    error_type,
)
from sparrow.server.protocol import ApiError
from sparrow.server.tool_parsers import ToolCall

PATH = "/v1/messages"


def add_routes(app: FastAPI, handlers: Handlers) -> None:
    """`/v1/messages` and `/v1/messages/count_tokens` on `app`, with Anthropic's errors."""
    app.add_middleware(AnthropicErrors)

    @app.post(PATH)
    async def messages(body: MessagesRequest, request: Request):
        job = await handlers.start_chat(chat_request(body))
        reply = Reply(body, job, handlers)
        if body.stream:
            events = reply.stream(handlers.events(job))
            return StreamingResponse(events, media_type="text/event-stream")
        await handlers.finish(job, request)
        return reply.whole()

    @app.post(f"{PATH}/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        if body.model != handlers.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves {handlers.model_name!r}",
                "not_found_error",
            )
        ids, _, _ = await handlers.chat_prompt(chat_request(body))
        return {"input_tokens": len(ids)}


def signature(thinking: str) -> str:
    """A thinking block's signature: opaque to clients, who send it back unchanged."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def sse(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"


class Reply:
    """The response to a Messages request run as `job`: its content blocks as the choice's
    output arrives, each change also given as the stream events that make it."""

    def __init__(self, body: MessagesRequest, job: Job, handlers: Handlers):
        self.body, self.job, self.handlers = body, job, handlers
        self.choice: Choice = job.choices[0]
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.forced = body.forced()
        choice = body.tool_choice
        self.one_call = choice is not None and choice.disable_parallel_tool_use
        self.omit = body.thinking is not None and body.thinking.display == "omitted"
        self.thought = ""  # the open thinking block's text (kept out of it with `omit`)
        self.content: list[dict[str, Any]] = []
        self.open = False  # the last block takes more deltas
        self.held = ""  # a forced call's JSON, held until it is whole

    def whole(self) -> dict[str, Any]:
        c = self.choice
        self.feed(c.reasoning or "", c.text, c.tool_calls)
        self.finish()
        reason, sequence = self.stop_reason()
        return self.message(self.content, reason, sequence, c.num_tokens)

    async def stream(self, events: AsyncIterator[tuple[Choice, OutputDelta]]) -> AsyncIterator[str]:
        """The events of the response; closing this closes `events` (which aborts the
        choice when it is unfinished)."""
        yield sse({"type": "message_start", "message": self.message([], None, None, 0)})
        yield sse({"type": "ping"})
        async with contextlib.aclosing(events):
            try:
                async for c, _ in events:
                    for event in self.feed(*c.last, c.last_calls):
                        yield sse(event)
            except (EngineError, ShuttingDown) as e:
                status = 503 if isinstance(e, ShuttingDown) else 500
                yield sse(error_body(str(e), error_type(status)))
                return
        for event in self.finish():
            yield sse(event)
        reason, sequence = self.stop_reason()
        yield sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": self.choice.num_tokens},
            }
        )
        yield sse({"type": "message_stop"})

    def message(
        self, content: list[dict], reason: str | None, sequence: str | None, output_tokens: int
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.handlers.model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": len(self.job.prompt_ids), "output_tokens": output_tokens},
        }

    def feed(self, reasoning: str, text: str, calls: list[ToolCall]) -> list[dict]:
        """The events of a delta: its reasoning, its text (held when a call is forced) and
        the tool calls it completed."""
        events = self._extend("thinking", reasoning) if reasoning else []
        if self.forced is not None:
            self.held += text
        elif text:
            events += self._extend("text", text)
        for call in calls:
            events += self._tool_use(call.name, call.arguments)
        return events

    def finish(self) -> list[dict]:
        """The events that end the content: a forced call (its text, when it is no whole
        call), then the last block's end."""
        events = []
        if self.held:
            call = self.forced.parse(self.held)
            if call is None:
                events += self._extend("text", self.held)
            else:
                events += self._tool_use(call[0], json.dumps(call[1], ensure_ascii=False))
            self.held = ""
        return events + self._close()

    def stop_reason(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished choice."""
        if any(b["type"] == "tool_use" for b in self.content):
            return "tool_use", None
        if self.choice.finish_reason is FinishReason.LENGTH:
            return "max_tokens", None
        sequence = self._stop_sequence()
        return ("end_turn", None) if sequence is None else ("stop_sequence", sequence)

    def _stop_sequence(self) -> str | None:
        """The stop sequence that ended the output, None for an end token. The output's
        tokens hold the sequence's (those after it are dropped): the first in the decoded
        text is the one the engine matched."""
        stops = self.body.stop_sequences
        if not stops or self.choice.finish_reason is not FinishReason.STOP:
            return None
        text = self.handlers.tokenizer.decode(self.choice.token_ids, skip_special_tokens=True)
        found = [(at, i) for i, s in enumerate(stops) if (at := text.find(s)) >= 0]
        return stops[min(found)[1]] if found else None

    def _extend(self, kind: str, text: str) -> list[dict]:
        """`text` added to the open block of `kind` ("text" or "thinking"), or to a new one."""
        events = []
        if not (self.open and self.content[-1]["type"] == kind):
            events += self._close()
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            events.append(self._start(block))
            self.open, self.thought = True, ""
        if kind == "thinking":
            self.thought += text
            if self.omit:
                return events
        self.content[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(
            {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
        )
        return events

    def _tool_use(self, name: str, arguments: str) -> list[dict]:
        """A whole call as its block's events: its start, its input as one JSON delta, its
        end (none after the first when the request disables parallel calls)."""
        events = self._close()
        if self.one_call and any(b["type"] == "tool_use" for b in self.content):
            return events
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name}
        events.append(self._start(block | {"input": {}}))
        self.content[-1]["input"] = json.loads(arguments)
        index = len(self.content) - 1
        delta = {"type": "input_json_delta", "partial_json": arguments}
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
        return events

    def _start(self, block: dict) -> dict:
        self.content.append(dict(block))
        return {
            "type": "content_block_start",
            "index": len(self.content) - 1,
            "content_block": block,
        }

    def _close(self) -> list[dict]:
        """The open block's end (a thinking block's signature first)."""
        if not self.open:
            return []
        self.open, index, block = False, len(self.content) - 1, self.content[-1]
        events = []
        if block["type"] == "thinking":
            block["signature"] = signature(self.thought)
            delta = {"type": "signature_delta", "signature": block["signature"]}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        return [*events, {"type": "content_block_stop", "index": index}]


class AnthropicErrors:
    """Error answers on /v1/messages routes in Anthropic's shape: an OpenAI error body
    (from a handler or the middleware inside) is rewritten, its status kept; an exception
    no handler took is answered 500 (api_error) and raised on."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path != PATH and not path.startswith(f"{PATH}/"):
            return await self.app(scope, receive, send)
        start: Message | None = None  # an error's start, held until its body is whole
        body, started = b"", False

        async def shaped(msg: Message) -> None:
            nonlocal start, body, started
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                start = msg
                return
            if start is None or msg["type"] != "http.response.body":
                started = started or msg["type"] == "http.response.start"
                return await send(msg)
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                started = True
                await _send_error(send, start, _reshaped(start["status"], body))

        try:
            await self.app(scope, receive, shaped)
        except Exception as e:
            if not started:
                message = f"internal error: {e!r}"
                await _send_error(
                    send, {"status": 500, "headers": []}, _json(error_body(message, "api_error"))
                )
            raise


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _reshaped(status: int, body: bytes) -> bytes:
    """An OpenAI error body as Anthropic's; any other body as it is."""
    try:
        error = json.loads(body)["error"]
        message, kind = error["message"], error.get("type")
    except (ValueError, KeyError, TypeError):
        return body
    return _json(error_body(message, error_type(status, kind)))


async def _send_error(send: Send, start: Message, body: bytes) -> None:
    headers = [
        (k, v) for k, v in start.get("headers", []) if k not in (b"content-length", b"content-type")
    ]
    headers += [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": start["status"], "headers": headers})
    await send({"type": "http.response.body", "body": body})
