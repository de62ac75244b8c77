"""OpenAI's Responses API as data: the request body (validated with pydantic), its input items
in the stored form (each with an id), a conversation of items as the chat messages a chat
template renders, and the JSON shapes of the response object, its output items and usage.

A conversation is the list of items a model has seen and written: input `message` items,
`function_call` and `function_call_output` items of tool round trips, `reasoning` items.
As chat messages, the assistant's items in a row (reasoning, then text, then calls) are one
assistant turn, `reasoning_content` holding the reasoning (templates that render it take it
from there); each function_call_output is a `tool` message."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sparrow.server.protocol import (
    ApiError,
    Bool,
    Float,
    Int,
    RefusesUnsupported,
)

# Fields the server does not implement, each with the value that changes nothing: a request
# giving another value (null aside) is refused rather than served as if the field were absent.
UNSUPPORTED = {
    "background": False,
    "conversation": None,
    "prompt": None,
    "truncation": "disabled",
    "top_logprobs": 0,
    "max_tool_calls": None,
}
# `include` may ask for encrypted reasoning: reasoning items carry their text in `content`,
# which is what the server reads when a client sends them back
INCLUDABLE = ("reasoning.encrypted_content",)
# vLLM's sampling extensions a Responses request may carry, passed to the chat request as are
PASSED = ("top_k", "min_p", "seed", "stop", "repetition_penalty", "presence_penalty")
PASSED += ("frequency_penalty", "min_tokens", "ignore_eos", "chat_template_kwargs")
USER_ROLES = ("user", "system", "developer")
ASSISTANT_ITEMS = ("reasoning", "message", "function_call")  # the order within a turn


def bad(message: str, param: str, code: str | None = None) -> ApiError:
    """A 400 naming the field at fault."""
    return ApiError(400, message, "invalid_request_error", param=param, code=code)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ReasoningConfig(BaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None  # summaries are not written: reasoning comes back whole
    generate_summary: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity: a hint
    format: dict[str, Any] | None = None


class ResponsesRequest(RefusesUnsupported):
    """The body of `POST /v1/responses`."""

    model_config = ConfigDict(extra="allow")
    unsupported: ClassVar[dict[str, Any]] = UNSUPPORTED
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool = True
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    stream: Bool = False
    store: Bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None

    @model_validator(mode="after")
    def _include(self) -> ResponsesRequest:
        for name in self.include or ():
            if name not in INCLUDABLE:
                raise ValueError(f"include {name!r} is not supported")
        return self

    @model_validator(mode="after")
    def _metadata(self) -> ResponsesRequest:
        meta = self.metadata or {}
        if len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
            raise ValueError("metadata takes 16 pairs at most, keys of 64 and values of 512 chars")
        return self

    def passed(self) -> dict[str, Any]:
        """The vLLM sampling extensions the request gives."""
        extra = self.model_extra or {}
        return {k: extra[k] for k in PASSED if extra.get(k) is not None}


def function_tools(tools: list[dict] | None) -> list[dict]:
    """The request's tools in Responses' flat shape, checked: function tools only."""
    out = []
    for i, tool in enumerate(tools or ()):
        if tool.get("type") != "function":
            raise bad(
                f"tool type {tool.get('type')!r} is not supported: this server runs "
                "function tools only",
                f"tools[{i}].type",
            )
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise bad("a function tool needs a name", f"tools[{i}].name")
        if params is not None and not isinstance(params, dict):
            raise bad("parameters must be a JSON schema object", f"tools[{i}].parameters")
        out.append(
            {
                "type": "function",
                "name": name,
                "description": tool.get("description"),
                "parameters": params,
                "strict": tool.get("strict"),
            }
        )
    return out


def chat_tools(tools: list[dict]) -> list[dict] | None:
    """Flat function tools as chat's nested ones (what the chat template renders)."""
    nested = [
        {
            "type": "function",
            "function": {
                k: t[k] for k in ("name", "description", "parameters") if t[k] is not None
            },
        }
        for t in tools
    ]
    return nested or None


def forced_names(choice: str | dict | None, tools: list[dict]) -> tuple[str, ...] | None:
    """The functions `tool_choice` forces a call of ("required": any tool; a named function:
    that one), None when it forces none ("auto", "none", absent)."""
    names = tuple(t["name"] for t in tools)
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        if not names:
            raise bad("tool_choice 'required' needs tools", "tool_choice")
        return names
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name not in names:
            raise bad(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return (name,)
    raise bad(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        "tool_choice",
    )


def call_schema(choice: str | dict, tools: list[dict], single: bool) -> dict:
    """The JSON schema the output of a forced call follows (vLLM's forced tool choice): a
    named function's parameters, or for "required" an array of {name, parameters} (one item
    when `single`: parallel_tool_calls false)."""
    params = {t["name"]: t["parameters"] or {"type": "object"} for t in tools}
    names = forced_names(choice, tools)
    if isinstance(choice, dict):
        return params[names[0]]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "parameters": params[n]},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for n in names
    ]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    return array | ({"maxItems": 1} if single else {})


def response_format(text: TextConfig | None) -> dict | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad("a json_schema format needs a schema object", "text.format.schema")
        keep = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": keep}
    raise bad(
        f"text.format type {fmt.get('type')!r} is not supported: text, json_object or json_schema",
        "text.format.type",
    )


def template_kwargs(body: ResponsesRequest) -> dict | None:
    """The chat template's keyword arguments: `reasoning.effort` as `reasoning_effort`
    (templates that take it) and effort "none" as `enable_thinking` false; the request's
    own `chat_template_kwargs` over them."""
    kwargs = {}
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:
        kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
    kwargs |= body.passed().get("chat_template_kwargs") or {}
    return kwargs or None
