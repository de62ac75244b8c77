"""A job's outputs as server-sent events, OpenAI's streaming format: one `data: {chunk}`
event per delta (chat starts each choice with the assistant role; each tool call a delta
completes follows as two more: the call's id and name, then its arguments), a usage chunk
when `stream_options.include_usage` asks for it, then `data: [DONE]`. An engine failure
mid-stream is sent as an error event, which ends the stream; so is the end of the shutdown
drain window, followed by `data: [DONE]`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from sparrow.engine.client import EngineError
from sparrow.engine.output_processor import OutputDelta
from sparrow.server import protocol
from sparrow.server.drain import ShuttingDown
from sparrow.server.jobs import Choice, Job


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def sse_events(
    job: Job, events: AsyncIterator[tuple[Choice, OutputDelta]], model: str
) -> AsyncIterator[str]:
    """The events of `job` from its (choice, delta) stream; closing this closes `events`
    (which aborts unfinished choices)."""

    def chunk(choices: list[dict], **extra: Any) -> str:
        return event(
            protocol.response_body(
                job.response_id, job.created, model, choices, job.chat, chunk=True, **extra
            )
        )

    if job.chat:
        for c in job.choices:
            yield chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ]
            )
    async with contextlib.aclosing(events):
        try:
            ids = job.body.return_token_ids
            async for c, delta in events:
                reason = protocol.finish_reason(delta.finish_reason, bool(c.tool_calls))
                reasoning, text = c.last  # the delta's text, split when a parser is on
                calls = c.last_calls  # and the tool calls it completed
                parts = []
                if (
                    text
                    or reasoning
                    or delta.logprobs
                    or ids
                    and delta.token_ids
                    or reason
                    and not calls
                ):
                    logprobs = protocol.logprobs_body(delta.logprobs, job.chat)
                    parts.append(
                        protocol.choice_body(
                            c.index,
                            text,
                            None,
                            logprobs,
                            job.chat,
                            delta=True,
                            token_ids=delta.token_ids if ids else None,
                            reasoning=reasoning if c.splitter is not None else None,
                        )
                    )
                first = len(c.tool_calls) - len(calls)
                for position, call in enumerate(calls, first):
                    parts += protocol.tool_call_deltas(c.index, position, call)
                if parts:
                    parts[-1]["finish_reason"] = reason
                for part in parts:
                    yield chunk([part])
        except EngineError as e:  # the stream cannot go on: an error event, then its end
            yield event(protocol.error_body(str(e), "server_error", 500))
            yield "data: [DONE]\n\n"
            return
        except ShuttingDown as e:
            yield event(protocol.error_body(str(e), "server_overloaded", 503))
            yield "data: [DONE]\n\n"
            return
    options = job.body.stream_options
    if options and options.include_usage:
        yield chunk([], usage=job.usage())
    yield "data: [DONE]\n\n"
