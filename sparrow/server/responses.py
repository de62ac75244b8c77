"""OpenAI's Responses API over the chat machinery: `POST /v1/responses` turns its request into
a chat request (instructions as the system message, the stored conversation of
`previous_response_id`, then the new input items; flat function tools as chat's; `text.format`
as `response_format`; `reasoning.effort` for the template), runs it as `handlers.start_chat`
does a chat completion, and writes the job's deltas back as output items
(`responses_output.py`), whole or as the API's typed server-sent events. `GET` and `DELETE
/v1/responses/{id}` and `GET /v1/responses/{id}/input_items` read the store
(`response_store.py`).

A continued conversation extends the previous turn's tokens: turn N + 1's prompt is turn N's
prompt and output ids as they ran, then what the chat template renders after turn N (the new
input items and the generation prompt), when its instructions and tools are turn N's. So the
engine's prefix cache serves all of turn N, reasoning included, where a re-rendered history
would differ from what the model wrote (templates that drop earlier reasoning, or open a
think block in the generation prompt)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from sparrow.core.request import FinishReason
from sparrow.engine.client import EngineError
from sparrow.server.drain import ShuttingDown
from sparrow.server.handlers import Handlers
from sparrow.server.jobs import Job
from sparrow.server.protocol import ApiError, ChatCompletionRequest
from sparrow.server.response_store import ResponseStore, StoreCollector
from sparrow.server.responses_items import chat_messages, input_items
from sparrow.server.responses_output import OutputItems
from sparrow.server.responses_protocol import (
    ResponsesRequest,
    bad,
    call_schema,
    chat_tools,
    forced_names,
    function_tools,
    new_id,
    response_format,
    template_kwargs,
)

CHAT_PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input"}


class Responses:
    """The Responses endpoints over `handlers` (the chat path) and `store`."""

    def __init__(self, handlers: Handlers, store: ResponseStore):
        self.handlers, self.store = handlers, store

    async def create(self, body: ResponsesRequest, request: Request):
        """The response, whole or streamed; 400 naming the field for a bad request, or for a
        previous_response_id that is not stored."""
        tools = function_tools(body.tools)
        forced = body.tool_choice if forced_names(body.tool_choice, tools) else None
        history = []
        if body.previous_response_id is not None:
            previous = await self.store.get(body.previous_response_id)
            if previous is None:
                raise bad(
                    f"previous response with id {body.previous_response_id!r} not found: "
                    "unknown, deleted, expired, or created with store false",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            history = previous.conversation
        items = input_items(body.input)
        messages = chat_messages(history + items, len(history))
        if body.instructions:
            messages.insert(0, {"role": "system", "content": body.instructions})
        try:
            chat = _chat_request(body, messages, tools, forced)
            prompt = await self.handlers.chat_prompt(chat)
            if body.previous_response_id is not None and _same_setup(
                previous.response, body, tools
            ):
                past = len(chat_messages(history, len(history))) + bool(body.instructions)
                prompt = await self._continued(chat, prompt, past, previous.tokens)
            job = await self.handlers.start_chat(chat, prompt)
        except ApiError as e:
            e.param = CHAT_PARAMS.get(e.param, e.param)
            raise
        run = Run(body, tools, job, OutputItems(job.choices[0], forced), history + items, items)
        if body.stream:
            return StreamingResponse(self._stream(run), media_type="text/event-stream")
        await self.handlers.finish(job, request, run.output.feed)
        run.output.close(run.incomplete)
        return await self._end(run)

    async def _continued(
        self, chat: ChatCompletionRequest, prompt: tuple, past: int, tokens: list[int]
    ) -> tuple[list[int], list, bool]:
        """A continuation's prompt: the previous turn's ids as it ran them (its prompt, then
        its output, closed by a stop token where the output has none), then the ids the
        template renders after that turn (`prompt`'s ids past the rendering of the first
        `past` messages as history, from the end of the turn's last stop token on). So turn
        N + 1 extends turn N's tokens, reasoning included, and the prefix cache serves all of
        them, where a template that drops earlier reasoning would render a different
        history. `prompt` as it is where the rendering does not line up (media, a template
        that renders the history differently once a turn follows)."""
        ids, media, inside = prompt
        stops = set(self.handlers.engine.info.default_stop_token_ids)
        history = await self.handlers.history_ids(chat, past)
        ends = [i for i, t in enumerate(history) if t in stops]
        if media or not tokens or not ends or ids[: len(history)] != history:
            return prompt
        end = ends[-1]
        closed = tokens if tokens[-1] in stops else [*tokens, history[end]]
        return [*closed, *history[end + 1 :], *ids[len(history) :]], media, inside

    async def _end(self, run: Run) -> dict:
        """The finished response, stored first when asked."""
        response = run.body_json(self.handlers.model_name)
        if run.body.store:
            conversation = run.conversation + run.output.items
            tokens = run.job.prompt_ids + run.job.choices[0].token_ids
            await self.store.put(response, run.items, conversation, tokens)
        return response

    async def _stream(self, run: Run) -> AsyncIterator[str]:
        sequence = 0

        def sse(event: dict) -> str:
            nonlocal sequence
            event["sequence_number"], sequence = sequence, sequence + 1
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        start = run.body_json(self.handlers.model_name, "in_progress")
        yield sse({"type": "response.created", "response": start})
        yield sse({"type": "response.in_progress", "response": start})
        events = self.handlers.events(run.job)
        async with contextlib.aclosing(events):
            try:
                async for choice, delta in events:
                    for event in run.output.feed(choice, delta):
                        yield sse(event)
            except (EngineError, ShuttingDown) as e:
                failed = run.body_json(self.handlers.model_name, "failed")
                failed["error"] = {"code": "server_error", "message": str(e)}
                yield sse({"type": "response.failed", "response": failed})
                return
        for event in run.output.close(run.incomplete):
            yield sse(event)
        response = await self._end(run)
        yield sse({"type": f"response.{response['status']}", "response": response})

    async def retrieve(self, response_id: str) -> dict:
        return (await self._stored(response_id)).response

    async def delete(self, response_id: str) -> dict:
        if not await self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(
        self, response_id: str, after: str | None, limit: int, order: str
    ) -> dict:
        """The request's own input items, a page in the list shape OpenAI's SDK pages through
        (`after`: the last id of the page before)."""
        items = (await self._stored(response_id)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad(f"no input item {after!r} in response {response_id!r}", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    async def _stored(self, response_id: str):
        stored = await self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored


class Run:
    """One create request as it runs: the request, its job and output, and the conversation
    (earlier turns' items and its input) the output extends."""

    def __init__(self, body, tools, job: Job, output: OutputItems, conversation, items):
        self.body, self.tools, self.job, self.output = body, tools, job, output
        self.conversation, self.items = conversation, items
        self.id, self.created = new_id("resp"), time.time()

    @property
    def incomplete(self) -> bool:
        return self.job.choices[0].finish_reason is FinishReason.LENGTH

    def body_json(self, model: str, status: str | None = None) -> dict[str, Any]:
        """The response object; `status` None: finished (completed or incomplete), with its
        output and usage."""
        body, done = self.body, status is None
        if done:
            status = "incomplete" if self.incomplete else "completed"
        reasoning = body.reasoning.model_dump() if body.reasoning is not None else None
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": model,
            "output": self.output.items if done else [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": reasoning,
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text and body.text.format) or {"type": "text"}},
            "tool_choice": body.tool_choice or ("auto" if self.tools else "none"),
            "tools": self.tools,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": self.usage() if done else None,
            "user": body.user,
        }
        if status == "completed":
            response["completed_at"] = time.time()
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        return response

    def usage(self) -> dict[str, Any]:
        prompt, output = len(self.job.prompt_ids), self.job.choices[0].num_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": self.output.reasoning_tokens},
            "total_tokens": prompt + output,
        }


def _chat_request(
    body: ResponsesRequest, messages: list[dict], tools: list[dict], forced: str | dict | None
) -> ChatCompletionRequest:
    """The chat request a Responses request runs as; a forced call's grammar takes the place
    of `text.format` (a call has no text to format)."""
    fields = {k: v for k, v in body.passed().items() if k != "chat_template_kwargs"}
    fields |= {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "tools": chat_tools(tools),
        "chat_template_kwargs": template_kwargs(body),
    }
    if tools:  # a forced call is read by its grammar, not the model's tool-call markup
        fields["tool_choice"] = "none" if forced or body.tool_choice == "none" else "auto"
    if forced:
        schema = call_schema(forced, tools, single=not body.parallel_tool_calls)
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "call", "schema": schema, "strict": True},
        }
    else:
        fields["response_format"] = response_format(body.text)
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        error = e.errors()[0]
        param = ".".join(map(str, error["loc"])) or None
        message = error["msg"].removeprefix("Value error, ")
        raise bad(f"{param}: {message}", CHAT_PARAMS.get(param, param)) from e


def _same_setup(previous: dict, body: ResponsesRequest, tools: list[dict]) -> bool:
    """Whether a continuation renders its history as the previous turn's prompt did: the
    same instructions and tools (each request gives its own)."""
    return previous.get("instructions") == body.instructions and previous.get("tools") == tools


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404, f"response {response_id!r} is not stored", "invalid_request_error", param="response_id"
    )


def add_responses_routes(app: FastAPI, handlers: Handlers, store: ResponseStore) -> None:
    """The Responses routes, and the store's state in /metrics."""
    handlers.metrics.registry.register(StoreCollector(store))
    responses = Responses(handlers, store)

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        return await responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        return await responses.delete(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str,
        after: str | None = None,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
    ):
        return await responses.input_items(response_id, after, limit, order)
