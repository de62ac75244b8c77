"""Anthropic's Messages API as data: the request bodies of `/v1/messages` and
`/v1/messages/count_tokens` (validated with pydantic), their conversion to the internal chat
request, and Anthropic's error body.

As chat messages: `system` is the system turn; a user turn's `tool_result` blocks become
`tool` messages (their text prefixed "Error: " when `is_error`), its text and images one user
message (images as `image_url` parts: base64 sources as data URLs); an assistant turn's
text is its content, its `thinking` blocks its `reasoning_content` (templates that render
reasoning take it from there) and its `tool_use` blocks its `tool_calls`. A `tool_choice`
that forces a call (`any`, `tool`) constrains the output to the call's JSON with the
structured-output grammar (the tool's `input_schema`; for several tools, one of
{"name", "input"}), as vLLM does for OpenAI's required and named tool choices;
`output_config.format` constrains it to its JSON schema."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sparrow.server.protocol import (
    ApiError,
    Bool,
    ChatCompletionRequest,
    Float,
    Int,
    _check_body,
)

MAX_STOP_SEQUENCES = 4  # the stop strings a chat request takes
# Anthropic's error types by HTTP status; other 4xx are invalid_request_error, 5xx api_error
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int, kind: str | None = None) -> str:
    """Anthropic's error type for an answer of `status` (`kind`: the OpenAI error type the
    server gave it: an engine that stopped is an api_error, not overloaded)."""
    if kind == "server_error":
        return "api_error"
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, kind: str) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def _bad(message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error")


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, unused


class TextBlock(Block):
    type: Literal["text"]
    text: str


class ImageSource(BaseModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ImageSource:
        if self.type == "base64" and not (self.media_type and self.data):
            raise ValueError("a base64 image source needs media_type and data")
        if self.type == "url" and not self.url:
            raise ValueError("a url image source needs url")
        return self

    def url_of(self) -> str:
        """The source as the URL an `image_url` part takes (base64 data as a data URL)."""
        if self.type == "url":
            return self.url
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(Block):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] = ""
    is_error: Bool = False


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str  # opaque: no model here wrote it, so nothing renders it


AnyBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]
ROLE_BLOCKS = {
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: list[AnyBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, v: Any) -> Any:
        return [{"type": "text", "text": v}] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _role_blocks(self) -> Message:
        for block in self.content:
            if block.type not in ROLE_BLOCKS[self.role]:
                raise ValueError(f"a {self.role} message may not hold {block.type} blocks")
        return self


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["custom"] | None = None  # Anthropic's server tools are not served here
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice names a tool when, and only when, its type is tool")
        return self


class ThinkingConfig(BaseModel):
    """`enabled` / `disabled`: the chat template's `enable_thinking`; `adaptive` and
    `between_tools`, like a request without `thinking`, leave it to the template.
    `display: omitted`: thinking blocks come back with their signatures and no text. The
    budget is not a limit here: reasoning counts against max_tokens like any output."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type enabled needs budget_tokens")
        return self


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted, unused
    format: OutputFormat | None = None  # the output follows the schema


class CountTokensRequest(BaseModel):
    """`/v1/messages/count_tokens`: what the prompt of a Messages request is made of."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        return _check_body(data)

    @model_validator(mode="after")
    def _consistent(self) -> CountTokensRequest:
        names = {t.name for t in self.tools or ()}
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice of type {choice.type} needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        if self.forced() is not None and self.output_format() is not None:
            raise ValueError(
                "give output_config.format or a tool_choice that forces a call, not both"
            )
        asked: set[str] = set()  # the tool_use ids of the assistant turn before
        for i, m in enumerate(self.messages):
            for block in m.content:
                if block.type == "tool_result" and block.tool_use_id not in asked:
                    raise ValueError(
                        f"messages.{i}: tool_result for {block.tool_use_id!r}, which is not "
                        "the id of a tool_use block in the assistant message before it"
                    )
            asked = {b.id for b in m.content if b.type == "tool_use"}
        return self

    def output_format(self) -> dict[str, Any] | None:
        """The JSON schema `output_config.format` asks the output to follow, or None."""
        config = self.output_config
        return None if config is None or config.format is None else config.format.json_schema

    def forced(self) -> ForcedCall | None:
        """The call `tool_choice` forces (any, tool), or None."""
        choice = self.tool_choice
        if choice is None or choice.type not in ("any", "tool"):
            return None
        tools = [t for t in self.tools if choice.type == "any" or t.name == choice.name]
        return ForcedCall({t.name: t.input_schema for t in tools})


class MessagesRequest(CountTokensRequest):
    """`/v1/messages`."""

    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: Float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # user_id: accepted, unused
    stream: Bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (len(v) > MAX_STOP_SEQUENCES or not all(v)):
            raise ValueError(f"takes at most {MAX_STOP_SEQUENCES} non-empty strings")
        return v


@dataclass(frozen=True)
class ForcedCall:
    """A call the output must be: with one tool its input as JSON, with several one of
    {"name": NAME, "input": INPUT}. `schemas`: each tool's input schema by name."""

    schemas: dict[str, dict]

    def grammar(self) -> dict[str, Any]:
        """The structured-output constraint (vLLM's `structured_outputs`)."""
        if len(self.schemas) == 1:
            return {"json": next(iter(self.schemas.values()))}
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "input": schema},
                "required": ["name", "input"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas.items()
        ]
        return {"json": {"anyOf": one_of}}

    def parse(self, text: str) -> tuple[str, dict] | None:
        """(name, input) of the output, None when it is not a whole call (cut short)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if len(self.schemas) == 1:
            name = next(iter(self.schemas))
        elif isinstance(value, dict) and value.keys() == {"name", "input"}:
            name, value = value["name"], value["input"]
        else:
            return None
        return (name, value) if name in self.schemas and isinstance(value, dict) else None


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The internal chat request that `body` is (a count_tokens body: its prompt only)."""
    forced = body.forced()
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
        # a forced call's JSON is read by ForcedCall, not by the model's tool-call parser
        auto = body.tool_choice is None or body.tool_choice.type == "auto"
        fields["tool_choice"] = "auto" if auto else "none"
    if body.thinking is not None and body.thinking.type in ("enabled", "disabled"):
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    if forced is not None:
        fields["structured_outputs"] = forced.grammar()
    elif body.output_format() is not None:
        fields["structured_outputs"] = {"json": body.output_format()}
    if isinstance(body, MessagesRequest):
        sampling = {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": body.stream,
        }
        fields |= {k: v for k, v in sampling.items() if v is not None}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise _bad(e.errors()[0]["msg"].removeprefix("Value error, ")) from e


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages as chat messages."""
    out: list[dict[str, Any]] = []
    if isinstance(body.system, str):
        out.append({"role": "system", "content": body.system})
    elif body.system:
        out.append(
            {"role": "system", "content": [{"type": "text", "text": b.text} for b in body.system]}
        )
    for m in body.messages:
        out += _user_turn(m) if m.role == "user" else [_assistant_turn(m)]
    return out


def _parts(blocks: list[TextBlock | ImageBlock]) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": b.text}
        if b.type == "text"
        else {"type": "image_url", "image_url": {"url": b.source.url_of()}}
        for b in blocks
    ]


def _user_turn(m: Message) -> list[dict[str, Any]]:
    """The tool messages of a user turn's tool results (in order), then its text and images
    as one user message."""
    out = []
    for block in m.content:
        if block.type != "tool_result":
            continue
        content = block.content if isinstance(block.content, str) else _parts(block.content)
        if block.is_error:
            head = "Error: "
            content = head + content if isinstance(content, str) else [_text(head), *content]
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
    rest = [b for b in m.content if b.type != "tool_result"]
    if rest or not out:
        out.append({"role": "user", "content": _parts(rest)})
    return out


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _assistant_turn(m: Message) -> dict[str, Any]:
    """An assistant turn: its text as content, thinking as reasoning_content, tool_use
    blocks as tool_calls (redacted thinking has no text to render and is left out)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(b.text for b in m.content if b.type == "text"),
    }
    thinking = [b.thinking for b in m.content if b.type == "thinking"]
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in m.content
        if b.type == "tool_use"
    ]
    if calls:
        message["tool_calls"] = calls
    return message
