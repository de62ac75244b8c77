"""The OpenAI protocol: request bodies (validated with pydantic), the error body, and the
JSON shapes of responses, stream chunks, usage and logprobs."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from sparrow.core.request import FinishReason
from sparrow.engine.output_processor import LogprobEntry, PromptLogprobEntry, TokenText
from sparrow.server.tool_parsers import ToolCall

# Fields the server does not implement, each with the value that changes nothing: a request
# giving another value (null aside) is refused rather than served as if the field were absent.
UNSUPPORTED = {
    "functions": [],
    "function_call": "none",
    "suffix": "",
    "best_of": 1,
    "echo": False,
    # vLLM's older spellings of structured_outputs: refused rather than ignored
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
}
CHAT_ONLY = {"tools": [], "tool_choice": "none"}  # refused by /v1/completions
# Levels of arrays and objects a request body may nest (the body itself is level 1): deep
# enough for any schema OpenAI takes (its structured outputs allow 10 levels), shallow enough
# for every recursive walk after validation.
MAX_DEPTH = 64


def _neutral(value: Any, neutral: Any) -> bool:
    return value is None or (
        isinstance(value, bool) == isinstance(neutral, bool) and value == neutral
    )


def _not_text(s: str) -> bool:
    """True for a string that is not valid Unicode (a lone UTF-16 surrogate, as the JSON
    escape "\\ud800" gives)."""
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_body(body: Any) -> Any:
    """`body` (parsed JSON) as it is, or ValueError before any other check: arrays and
    objects nested deeper than MAX_DEPTH levels (pydantic, chat templates' `tojson` and the
    schema compilers walk values recursively), or a string or key anywhere that is not valid
    Unicode. Walks with a stack of its own: a body of any depth is safe to check."""
    if isinstance(body, str) and _not_text(body):
        raise ValueError("the body is a string with a lone UTF-16 surrogate (not text)")
    stack = [(body, ())] if isinstance(body, dict | list) else []
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_DEPTH:  # `value` is at level len(path) + 1
            raise ValueError(too_deep(path[0] if isinstance(path[0], str) else "the body"))
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and _not_text(key):
                where = ".".join(map(str, path)) or "the body"
                raise ValueError(f"{where} has a key with a lone UTF-16 surrogate (not text)")
            if isinstance(item, str) and _not_text(item):
                where = ".".join(map(str, (*path, key)))
                raise ValueError(f"{where} holds a string with a lone UTF-16 surrogate (not text)")
            if isinstance(item, dict | list):
                stack.append((item, (*path, key)))
    return body


def too_deep(where: str) -> str:
    """The refusal of a body nested past MAX_DEPTH; `where`: its field, or "the body"."""
    return f"{where} nests arrays and objects too deep: a request body may nest {MAX_DEPTH} levels"


def _number(kind: str) -> BeforeValidator:
    """Refuses strings and booleans where JSON wants a number (as OpenAI does): pydantic's lax
    mode would take "10" and true; integral floats (1.0) still pass for integers."""

    def check(value: Any) -> Any:
        if isinstance(value, bool | str):
            got = "a boolean" if isinstance(value, bool) else "a string"
            raise ValueError(f"expected {kind}, got {got}")
        return value

    return BeforeValidator(check)


Int = Annotated[int, _number("an integer")]
Float = Annotated[float, _number("a number")]  # ints pass
Bool = StrictBool
TokenId = Annotated[Int, Field(ge=0)]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class Tool(BaseModel):
    """A function the model may call, as the request's `tools` give it."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI's JSON text (an object also passes)


class MessageToolCall(BaseModel):
    """A call in an earlier assistant turn, sent back for the template to render."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # rendered with the messages
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        return _check_body(data)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    tokens: list[TokenId]

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        return _check_body(data)


class StreamOptions(BaseModel):
    include_usage: Bool = False


class RefusesUnsupported(BaseModel):
    """A request body checked whole before its fields (`_check_body`), with its class's
    `unsupported` fields refused unless null or their neutral value."""

    unsupported: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        _check_body(data)
        if isinstance(data, dict):
            for name, neutral in cls.unsupported.items():
                if not _neutral(data.get(name), neutral):
                    raise ValueError(f"{name} is not supported")
        return data


class SamplingFields(RefusesUnsupported):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")
    unsupported: ClassVar[dict[str, Any]] = UNSUPPORTED
    model: str
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=0, ge=0)
    min_p: Float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: Int = Field(default=0, ge=0)
    logit_bias: dict[str, Float] | None = None  # token id (as a string) -> bias in [-100, 100]
    presence_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: Float = Field(default=1.0, gt=0.0)
    stop_token_ids: list[TokenId] | None = None  # as well as end tokens
    seed: Int | None = None
    stop: str | list[str] | None = None
    n: Int = Field(default=1, ge=1, le=16)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: Bool = False  # keep generating past end tokens (vLLM's extension; benchmarks)
    # each choice (and stream chunk) also carries its generated token ids (vLLM's extension:
    # a client can send them back as the next turn's prompt, exactly as generated)
    return_token_ids: Bool = False
    # structured output: {"type": "json_object"} or {"type": "json_schema", "json_schema":
    # {"name", "schema", "strict"}}, or vLLM's {"json": schema}, {"regex": ...},
    # {"choice": [...]}, {"grammar": ...} (`sparrow.core.structured.from_request`)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    skip_special_tokens: Bool = True  # false: special tokens' text stays in the output (vLLM)
    # vLLM's extension: each prompt token's logprob and this many top alternatives; in each
    # choice of a completion, beside the choices of a chat completion; not with stream
    prompt_logprobs: Int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _prompt_logprobs_whole(self) -> SamplingFields:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    # "auto" (the default with tools) and "required" or a named function parse the model's
    # calls; "none" leaves its text as text. Nothing constrains decoding to a call yet, so
    # "required" and a named function are what the model is asked for, not what it must do.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _tool_choice(self) -> ChatCompletionRequest:
        choice, names = self.tool_choice, {t.function.name for t in self.tools or ()}
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not names:
            raise ValueError("tool_choice other than none or auto needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return self

    def tool_schemas(self) -> dict[str, dict] | None:
        """Each tool's parameter schema by name, when the model's calls are to be parsed
        (tools given and tool_choice not "none"); else None."""
        if not self.tools or self.tool_choice == "none":
            return None
        return {t.function.name: t.function.parameters or {} for t in self.tools}


class CompletionRequest(SamplingFields):
    unsupported: ClassVar[dict[str, Any]] = UNSUPPORTED | CHAT_ONLY
    prompt: str | list[Int] = Field(min_length=1)
    logprobs: Int | None = Field(default=None, ge=0, le=20)

    def logprobs_count(self) -> int | None:
        return self.logprobs


class ApiError(Exception):
    """An error answered with the error body: HTTP status, message, OpenAI error type, the
    request field at fault (`param`) when there is one, and the body's `code` (None: the
    status)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        headers: dict | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers
        self.param, self.code = param, code


def error_body(
    message: str, kind: str, code: int | str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(reason: FinishReason | None, called: bool = False) -> str | None:
    """ "length" at max_tokens or the context limit; "stop" at a stop token or string (and an
    abort); "tool_calls" when the completion (`called`) made tool calls."""
    if reason is None:
        return None
    if called:
        return "tool_calls"
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """Chat format: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def one(t: TokenText) -> dict[str, Any]:
        return {"token": t.text, "logprob": t.logprob, "bytes": list(t.bytes)}

    return {"content": [one(e.token) | {"top_logprobs": [one(t) for t in e.top]} for e in entries]}


def text_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """Completions format: parallel lists, with each token's character offset."""
    return {
        "tokens": [e.token.text for e in entries],
        "token_logprobs": [e.token.logprob for e in entries],
        "top_logprobs": [{t.text: t.logprob for t in e.top} for e in entries],
        "text_offset": [e.offset for e in entries],
    }


def prompt_logprobs_body(entries: list[PromptLogprobEntry]) -> list[dict[str, Any] | None]:
    """vLLM's shape: None for the first prompt token, then per token {token id: {logprob,
    rank, decoded_token}}, the prompt token first, then its top alternatives."""

    def one(t: TokenText) -> dict[str, Any]:
        return {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.text}

    return [None] + [{str(t.token_id): one(t) for t in (e.token, *e.top)} for e in entries]


def logprobs_body(entries: list[LogprobEntry] | None, chat: bool) -> dict[str, Any] | None:
    if entries is None:
        return None
    return chat_logprobs(entries) if chat else text_logprobs(entries)


def choice_body(
    index: int,
    text: str,
    reason: str | None,
    logprobs: dict | None,
    chat: bool,
    delta: bool = False,
    token_ids: list[int] | None = None,
    reasoning: str | None = None,
    tool_calls: list[ToolCall] | None = None,
) -> dict[str, Any]:
    """One choice of a response (`delta`: of a stream chunk); `token_ids` when asked for;
    `reasoning` (None: no reasoning parser) as `reasoning_content`; a whole message's
    `tool_calls` (its content then null when empty)."""
    if chat:
        message = {"content": text} if delta else {"role": "assistant", "content": text}
        if reasoning is not None and (reasoning or not delta):
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in tool_calls
            ]
        content = {"delta" if delta else "message": message}
    else:
        content = {"text": text}
    ids = {} if token_ids is None else {"token_ids": token_ids}
    return {"index": index, **content, "finish_reason": reason, "logprobs": logprobs, **ids}


def tool_call_deltas(index: int, position: int, call: ToolCall) -> list[dict[str, Any]]:
    """A call as stream deltas of choice `index`, OpenAI's shape: its id, type and name (no
    arguments yet), then its arguments; `position`: the call's index among the choice's."""
    head = {
        "index": position,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }
    args = {"index": position, "function": {"arguments": call.arguments}}
    return [
        {"index": index, "delta": {"tool_calls": [part]}, "finish_reason": None, "logprobs": None}
        for part in (head, args)
    ]


def response_body(
    response_id: str,
    created: int,
    model: str,
    choices: list[dict],
    chat: bool,
    chunk: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """A whole response, or (`chunk`) one event of a stream."""
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": response_id,
        "object": f"{kind}.chunk" if chat and chunk else kind,
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }
