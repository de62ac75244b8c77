"""Tool calls: each family's parser on outputs written as its chat template renders calls, at
every split of the stream (streamed calls and content equal the whole parse), several calls,
text around them, malformed and truncated calls (text, never an error); then chat requests
with `tools` through the app, whole and streamed, and a round trip whose next request sends
the calls and their results back for the template to render."""

import json

import pytest

from sparrow.chat_templates import CHATML_TEMPLATE, MINIMAX_TEMPLATE
from sparrow.engine.client import EngineInfo
from sparrow.models import ARCHITECTURES
from sparrow.server.tool_parsers import NS, PARSERS, ToolCallSplitter
from sparrow.tokenizer import Tokenizer, load_tokenizer
from tests.server import test_app
from tests.server.test_app import MODEL, CharTokenizer, ScriptedEngine, events

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from sparrow.server.app import build_app  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "zip": {"type": "string"},
        "units": {"type": "object", "properties": {"metric": {"type": "boolean"}}},
        "hours": {"type": "array", "items": {"type": "integer"}},
    },
}
SCHEMAS = {"get_weather": WEATHER, "search": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in SCHEMAS.items()]
CALLS = [
    (
        "get_weather",
        {"city": "Paris", "days": 3, "zip": "007", "units": {"metric": True}, "hours": [6, 18]},
    ),
    ("search", {"query": "a < b && c\nline two", "-A": 2, "tags": ["x", "y"]}),
]


def rendered(template: str, content: str, calls: list) -> str:
    """An assistant turn's text as `template` renders it: what the model writes."""
    tok = Tokenizer(None, "tiktoken", template)
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }
    text = tok.apply_chat_template([message], add_generation_prompt=False)
    head, tail = (
        ("<|im_start|>assistant\n", "<|im_end|>\n")
        if template == CHATML_TEMPLATE
        else ("]~!b[]~b]ai\n", "[e~[\n")
    )
    assert text.startswith(head) and text.endswith(tail)
    return text[len(head) : -len(tail)]


def parse(parser: str, pieces: list[str], schemas=SCHEMAS) -> tuple[str, list]:
    splitter = ToolCallSplitter(PARSERS[parser], schemas)
    content, calls = "", []
    for piece in pieces:
        c, new = splitter.feed(piece)
        content, calls = content + c, calls + new
    return content + splitter.flush(), [(c.name, json.loads(c.arguments)) for c in calls]


def check_every_split(parser: str, text: str, expected, schemas=SCHEMAS) -> None:
    assert parse(parser, [text], schemas) == expected
    for cut in range(len(text) + 1):
        assert parse(parser, [text[:cut], text[cut:]], schemas) == expected, cut
    assert parse(parser, list(text), schemas) == expected  # char by char


@pytest.mark.parametrize(
    "parser, template", [("qwen3", CHATML_TEMPLATE), ("minimax_m3", MINIMAX_TEMPLATE)]
)
@pytest.mark.parametrize(
    "content, calls",
    [
        ("", CALLS[:1]),
        ("Let me look that up.", CALLS[:1]),
        ("Two at once:", CALLS),
    ],
)
def test_template_rendered_calls_at_every_split(parser, template, content, calls):
    text = rendered(template, content, calls)
    check_every_split(parser, text, (content, calls))


def test_qwen_formats_and_value_types():
    """Qwen3's JSON call, an undeclared tool's values decoded as JSON, a string-typed
    parameter kept as text, a multi-line value and the whitespace the template writes."""
    text = (
        'Sure.\n\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
        "\n<tool_call>\n<function=other>\n<parameter=n>\n123\n</parameter>\n"
        '<parameter=s>\nnot json\n</parameter>\n<parameter=o>\n{"k": [1, null]}\n'
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\n123\n</parameter>\n<parameter=zip>\n\nline\n\n</parameter>\n"
        "</function>\n</tool_call>\n"
    )
    check_every_split(
        "qwen3",
        text,
        (
            "Sure.",
            [
                ("search", {"query": "x"}),
                ("other", {"n": 123, "s": "not json", "o": {"k": [1, None]}}),
                ("get_weather", {"city": "123", "zip": "\nline\n"}),
            ],
        ),
    )


def test_minimax_nesting_duplicates_and_types():
    """M3's nested objects and arrays, a repeated tag collected in an array, a name that is
    no identifier, numbers typed by the schema ("007" as an integer) or kept as text."""
    body = (
        f'{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>007{NS}</days>'
        f"{NS}<units>{NS}<metric>false{NS}</metric>{NS}</units>{NS}<hours>{NS}</hours>"
        f"{NS}<extra>{NS}<tag>a{NS}</tag>{NS}<tag>b{NS}</tag>{NS}</extra>"
        f"{NS}<-A>{NS}<item>1.5{NS}</item>{NS}<item>{NS}<k>v w{NS}</k>{NS}</item>{NS}</-A>"
        f"{NS}</invoke>"
    )
    text = (
        f'Checking.{NS}<tool_call>\n{body}\n{NS}<invoke name="search">{NS}</invoke>\n'
        f"{NS}</tool_call>"
    )
    args = {
        "city": "Paris",
        "days": 7,
        "units": {"metric": False},
        "hours": [],
        "extra": {"tag": ["a", "b"]},
        "-A": [1.5, {"k": "v w"}],
    }
    check_every_split("minimax_m3", text, ("Checking.", [("get_weather", args), ("search", {})]))


M3_CALL = f'{NS}<invoke name="search">{NS}<q>x{NS}</q>{NS}</invoke>'


@pytest.mark.parametrize(
    "parser, text, calls",
    [
        # malformed: the text as it was
        (
            "qwen3",
            "Hi <tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call> end",
            [],
        ),
        ("qwen3", "<tool_call>just words</tool_call>", []),
        ("qwen3", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', []),
        ("minimax_m3", f"{NS}<tool_call>\n{NS}</q> after", []),
        (
            "minimax_m3",
            f'x {NS}<tool_call>\n{NS}<invoke name="f">{NS}<a>1{NS}</b>{NS}</invoke>\n'
            f"{NS}</tool_call>",
            [],
        ),
        (
            "minimax_m3",
            f'{NS}<tool_call>\n{NS}<invoke name="f">text{NS}<a>1{NS}</a>{NS}</invoke>',
            [],
        ),
        # truncated: no call, the text as it was
        ("qwen3", "Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nPar", []),
        ("qwen3", "an unfinished marker <tool_ca", []),
        ("minimax_m3", f'Sure {NS}<tool_call>\n{NS}<invoke name="search">{NS}<q>x', []),
        ("minimax_m3", f"ends in {NS}<tool", []),
    ],
)
def test_malformed_and_truncated_calls_are_text(parser, text, calls):
    check_every_split(parser, text, (text, calls))


def test_minimax_keeps_the_calls_before_a_truncated_one():
    partial = f'\n{NS}<invoke name="search">{NS}<q>y'
    text = f"Go.{NS}<tool_call>\n{M3_CALL}{partial}"
    check_every_split("minimax_m3", text, ("Go." + partial, [("search", {"q": "x"})]))


def test_text_around_calls_and_markers_in_plain_text():
    """Text after a call stays content; a near-marker is text once it cannot be one."""
    text = "a <tool_cal b\n\n<tool_call>\n<function=search>\n</function>\n</tool_call>\n\nmore"
    check_every_split("qwen3", text, ("a <tool_cal bmore", [("search", {})]))


def test_every_family_names_a_known_parser():
    for arch in ARCHITECTURES.values():
        assert arch.SPEAKS.tool_parser is None or arch.SPEAKS.tool_parser in PARSERS


class RoomyEngine(ScriptedEngine):
    """Room for prompts that carry tool definitions."""

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(max_model_len=8192, vocab_size=50, default_stop_token_ids=())


class ToolTokenizer(CharTokenizer):
    """Records what the template is given."""

    def __init__(self):
        self.seen = []

    def apply_chat_template(self, messages, **kwargs):
        self.seen.append((messages, kwargs))
        return super().apply_chat_template(messages)

    def encode_chat(self, messages, **kwargs):
        return self.encode(self.apply_chat_template(messages, **kwargs))


def script(monkeypatch, text: str, size: int = 3) -> None:
    """The engine writes `text`, `size` characters a token."""
    pieces = {i + 1: text[i * size : (i + 1) * size] for i in range((len(text) + size - 1) // size)}
    monkeypatch.setattr(test_app, "PIECES", pieces)


def chat(client, **body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}]} | body
    return client.post("/v1/chat/completions", json=body)


QWEN_OUT = rendered(CHATML_TEMPLATE, "Checking.", CALLS)


@pytest.fixture
def tools_client(monkeypatch):
    script(monkeypatch, QWEN_OUT)
    tokenizer = ToolTokenizer()
    client = TestClient(build_app(RoomyEngine(), tokenizer, MODEL, tool_parser=PARSERS["qwen3"]))
    return client, tokenizer


def streamed(response) -> tuple[str, dict, str]:
    """A stream's content, its calls by index ({index: [id, name, arguments]}) and the
    finish reason."""
    chunks = [c for c in events(response)[:-1] if c["choices"]]
    content, calls = "", {}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], [None, "", ""])
            if "id" in part:
                assert call[0] is None and part["type"] == "function"
                call[0] = part["id"]
                assert part["function"]["arguments"] == ""  # the name comes first, alone
            call[1] += part["function"].get("name", "")
            call[2] += part["function"]["arguments"]
    return content, calls, chunks[-1]["choices"][0]["finish_reason"]


def test_tool_calls_whole_and_streamed(tools_client):
    client, tokenizer = tools_client
    choice = chat(client, tools=TOOLS).json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == "Checking."
    assert [
        (c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ] == [("function", n, a) for n, a in CALLS]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])
    assert tokenizer.seen[-1][1]["tools"] == TOOLS  # the template renders them
    content, calls, reason = streamed(chat(client, tools=TOOLS, stream=True))
    assert content == "Checking." and reason == "tool_calls"
    assert [(name, json.loads(args)) for _, name, args in calls.values()] == CALLS
    assert sorted(calls) == [0, 1] and all(i.startswith("call_") for i, _, _ in calls.values())


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "search"}}]
)
def test_tool_choices_that_parse(tools_client, choice):
    out = chat(tools_client[0], tools=TOOLS, tool_choice=choice).json()["choices"][0]
    assert len(out["message"]["tool_calls"]) == 2


def test_text_stays_text_without_parsing(tools_client, monkeypatch):
    """tool_choice none (the tools still rendered), no tools, no parser: the text as is."""
    client, tokenizer = tools_client
    none = chat(client, tools=TOOLS, tool_choice="none").json()["choices"][0]
    assert none["message"] == {"role": "assistant", "content": QWEN_OUT}
    assert none["finish_reason"] == "length" and tokenizer.seen[-1][1]["tools"] == TOOLS
    assert chat(client).json()["choices"][0]["message"]["content"] == QWEN_OUT
    plain = TestClient(build_app(RoomyEngine(), ToolTokenizer(), MODEL))
    assert chat(plain, tools=TOOLS).json()["choices"][0]["message"]["content"] == QWEN_OUT
    script(monkeypatch, "Sure <tool_call>\n<function=search>\n")  # truncated: text
    for body in ({}, {"stream": True}):
        r = chat(client, tools=TOOLS, **body)
        content = streamed(r)[0] if body else r.json()["choices"][0]["message"]["content"]
        assert content == "Sure <tool_call>\n<function=search>\n"


@pytest.mark.parametrize(
    "body, fault",
    [
        ({"tool_choice": "required"}, "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope'",
        ),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": TOOLS, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    },
                ]
            },
            "not a JSON object",
        ),
    ],
)
def test_bad_tool_requests_are_400(tools_client, body, fault):
    r = chat(tools_client[0], **body)
    assert r.status_code == 400 and fault in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "parser, template", [("qwen3", CHATML_TEMPLATE), ("minimax_m3", MINIMAX_TEMPLATE)]
)
def test_round_trip_through_the_template(monkeypatch, parser, template):
    """The calls come back in the next request with their results; the template renders
    the assistant turn exactly as the model wrote it, and the results after it."""
    out = rendered(template, "Checking.", CALLS)
    script(monkeypatch, out, size=5)
    tokenizer = load_tokenizer(None)
    tokenizer = Tokenizer(tokenizer._backend, tokenizer.kind, template)
    engine = RoomyEngine()
    client = TestClient(build_app(engine, tokenizer, MODEL, tool_parser=PARSERS[parser]))
    first = [{"role": "user", "content": "weather?"}]
    message = chat(client, messages=first, tools=TOOLS).json()["choices"][0]["message"]
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": f"result {i}"}
        for i, c in enumerate(message["tool_calls"])
    ]
    r = chat(client, messages=[*first, message, *results], tools=TOOLS)
    assert r.status_code == 200
    prompt = tokenizer.decode(engine.added[-1][1])
    assert prompt == tokenizer.apply_chat_template(
        [
            *first,
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {"type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS
                ],
            },
            *results,
        ],
        tools=TOOLS,
    )
    assert out in prompt and "result 0" in prompt and "result 1" in prompt


def test_tokenize_renders_the_tools(tools_client):
    client, tokenizer = tools_client
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    assert client.post("/tokenize", json=body).status_code == 200
    assert tokenizer.seen[-1][1]["tools"] == TOOLS
