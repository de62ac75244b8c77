"""A request's job as the server runs it: the n choices whose deltas arrive from the
engine (reasoning and tool calls split apart as they stream), and what the response needs
to be written, whole or as server-sent events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sparrow.core.request import FinishReason
from sparrow.engine.output_processor import LogprobEntry, OutputDelta, PromptLogprobEntry
from sparrow.server import protocol
from sparrow.server.protocol import SamplingFields
from sparrow.server.reasoning import ReasoningSplitter
from sparrow.server.tool_parsers import ToolCall, ToolCallSplitter


@dataclass
class Choice:
    """One of the n completions of a request, as its deltas arrive."""

    index: int
    request_id: str
    stream: AsyncIterator[OutputDelta]
    text: str = ""
    num_tokens: int = 0
    finish_reason: FinishReason | None = None
    logprobs: list[LogprobEntry] | None = None  # None: not asked for
    token_ids: list[int] = field(default_factory=list)
    splitter: ReasoningSplitter | None = None  # reasoning apart from content
    reasoning: str | None = None
    calls: ToolCallSplitter | None = None  # tool calls apart from the content left by splitter
    tool_calls: list[ToolCall] = field(default_factory=list)
    last: tuple[str, str] = ("", "")  # the last delta's (reasoning, content)
    last_calls: list[ToolCall] = field(default_factory=list)  # and its tool calls
    prompt_logprobs: list[PromptLogprobEntry] | None = None  # set on the choice that asked

    def take(self, delta: OutputDelta) -> None:
        done = delta.finish_reason is not None
        r, c = ("", delta.text) if self.splitter is None else self.splitter.feed(delta.text)
        if done and self.splitter is not None:
            fr, fc = self.splitter.flush()
            r, c = r + fr, c + fc
        calls = []
        if self.calls is not None:
            c, calls = self.calls.feed(c)
            c += self.calls.flush() if done else ""
        if self.splitter is not None:
            self.reasoning = (self.reasoning or "") + r
        self.last, self.last_calls = (r, c), calls
        self.tool_calls += calls
        self.text += c
        self.num_tokens += len(delta.token_ids)
        self.token_ids += delta.token_ids
        self.finish_reason = delta.finish_reason
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass
class Job:
    """A request the engine runs as `choices`: what the response needs to be written."""

    body: SamplingFields
    chat: bool
    prompt_ids: list[int]
    response_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)

    def usage(self) -> dict[str, int]:
        return protocol.usage(len(self.prompt_ids), sum(c.num_tokens for c in self.choices))

    def prompt_logprobs(self) -> list[dict | None] | None:
        """The prompt logprobs in vLLM's shape (the first choice computes them for all),
        None when not asked for."""
        entries = next(
            (c.prompt_logprobs for c in self.choices if c.prompt_logprobs is not None), None
        )
        return None if entries is None else protocol.prompt_logprobs_body(entries)
