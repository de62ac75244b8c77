"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens). Through the official
anthropic client against `sparrow serve` on the built-in model: create with a system
prompt, max_tokens and stop sequences; streams (their events in order, their final message
the whole one); token counts; a forced tool call and its result sent back; thinking blocks;
x-api-key; Anthropic's error bodies and their counts in /metrics. Over a scripted engine:
reasoning, text and parsed tool calls as blocks, whole and streamed alike. Once through a
gateway over a worker, with images."""

import asyncio
import base64
import io
import json
import re

import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from sparrow.engine.client import EngineFull  # noqa: E402
from sparrow.server.app import build_app  # noqa: E402
from sparrow.server.reasoning import PARSERS as REASONING  # noqa: E402
from sparrow.server.tool_parsers import PARSERS  # noqa: E402
from tests.server.test_live import live  # noqa: E402
from tests.server.test_server import KEY, MODEL, _start  # noqa: E402
from tests.server.test_tools import (  # noqa: E402
    CALLS,
    QWEN_OUT,
    SCHEMAS,
    RoomyEngine,
    ToolTokenizer,
    script,
)

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0}  # not a parameter of the client's create: sent as extra_body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, base = _start(tmp_path_factory.mktemp("cache"), "--reasoning-parser", "auto")
    yield base
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def fields(**kw) -> dict:
    """A greedy request of 6 tokens with thinking off (the template opens a think block
    unless told not to), `kw` on top."""
    body = {"model": MODEL, "max_tokens": 6, "messages": ASK, "thinking": {"type": "disabled"}}
    return body | {"extra_body": GREEDY} | kw


def blocks(message) -> list[dict]:
    """A message's content as JSON (a stream's final message has parsed blocks)."""
    return [b.model_dump(exclude_none=True) for b in message.content]


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def post(base: str, body, path: str = "/v1/messages", **headers) -> httpx.Response:
    """`body` as JSON text (lone surrogates as escapes, NaN as is) or as the bytes given;
    `headers` by their names in Python (x_api_key=None: no key)."""
    given = {k.replace("_", "-"): v for k, v in headers.items()}
    headers = {"x-api-key": KEY, "content-type": "application/json"} | given
    headers = {k: v for k, v in headers.items() if v is not None}
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(f"{base}{path}", content=content, headers=headers, timeout=60)


def rebuilt(text: str) -> tuple[list[str], dict]:
    """A stream's event names, and the message its events build (a tool call's input
    parsed from its JSON deltas)."""
    names, message, partial = [], None, {}
    for event in filter(None, text.split("\n\n")):
        head, data = event.split("\n")
        name, data = head.removeprefix("event: "), json.loads(data.removeprefix("data: "))
        assert data["type"] == name
        names.append(name)
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(data["content_block"])
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] = (block[key] if key != "signature" else "") + delta[key]
        elif name == "content_block_stop" and data["index"] in partial:
            message["content"][data["index"]]["input"] = json.loads(partial.pop(data["index"]))
        elif name == "message_delta":
            message |= data["delta"]
            message["usage"] |= data["usage"]
    return names, message


def test_create_with_system_max_tokens_and_stop_sequences(client):
    whole = client.messages.create(**fields(system="You write Python.", max_tokens=8))
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL and [b.type for b in whole.content] == ["text"]
    assert (whole.stop_reason, whole.stop_sequence) == ("max_tokens", None)
    assert whole.usage.output_tokens == 8
    bare = client.messages.create(**fields(max_tokens=1))
    assert whole.usage.input_tokens > bare.usage.input_tokens  # the system turn
    text = text_of(whole)
    stop = text[len(text) // 2 :][:2]
    cut = client.messages.create(
        **fields(system="You write Python.", max_tokens=8, stop_sequences=["never~seen", stop])
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text_of(cut) == text[: text.find(stop)] and cut.usage.output_tokens <= 8


def test_stream_events_in_order_and_the_final_message(client, server):
    whole = client.messages.create(**fields())
    with client.messages.stream(**fields()) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert blocks(final) == blocks(whole) and final.usage == whole.usage
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, None)
    body = fields(stream=True) | GREEDY
    del body["extra_body"]
    raw = post(server, body)
    assert raw.headers["content-type"].startswith("text/event-stream")
    names, message = rebuilt(raw.text)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert message["content"] == blocks(whole)
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 6


def test_count_tokens(client):
    body = {"model": MODEL, "messages": ASK, "system": "Be brief."}
    body |= {"thinking": {"type": "disabled"}}  # as `fields` asks: the template closes the block
    counted = client.messages.count_tokens(**body)
    created = client.messages.create(**fields(**body, max_tokens=1))
    assert counted.input_tokens == created.usage.input_tokens
    assert client.messages.count_tokens(**body, tools=[WEATHER]).input_tokens > counted.input_tokens


def test_a_forced_tool_call_and_its_result(client):
    ask = [{"role": "user", "content": "The weather in Paris?"}]
    forced = fields(messages=ask, tools=[WEATHER, TIME], max_tokens=60)
    first = client.messages.create(**forced, tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use" and len(first.content) == 1
    call = first.content[0]
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")
    with client.messages.stream(**forced, tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", call.name, call.input)
    ]
    anyone = client.messages.create(**forced, tool_choice={"type": "any"})
    assert anyone.stop_reason == "tool_use" and anyone.content[0].name in (
        "get_weather",
        "get_time",
    )

    def turn(**result) -> list:
        answer = {"type": "tool_result", "tool_use_id": call.id, **result}
        return [
            *ask,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [answer]},
        ]

    second = client.messages.create(**fields(messages=turn(content="18 C"), tools=[WEATHER, TIME]))
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result
    assert second.stop_reason == "max_tokens"
    count = {"model": MODEL, "tools": [WEATHER, TIME]}
    plain = client.messages.count_tokens(**count, messages=turn(content="18 C"))
    failed = client.messages.count_tokens(**count, messages=turn(content="18 C", is_error=True))
    blocks = client.messages.count_tokens(
        **count, messages=turn(content=[{"type": "text", "text": "18 C"}])
    )
    assert failed.input_tokens > plain.input_tokens == blocks.input_tokens


def test_output_config_format(client):
    schema = WEATHER["input_schema"]
    config = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    out = client.messages.create(**fields(max_tokens=40, extra_body=GREEDY | config))
    assert json.loads(text_of(out))["city"] in ("Paris", "Rome")
    assert out.stop_reason == "end_turn"


def test_thinking_blocks(client):
    thinking = fields(thinking={"type": "enabled", "budget_tokens": 1024})
    whole = client.messages.create(**thinking)
    block = whole.content[0]
    assert (
        block.type == "thinking"
        and block.thinking
        and re.fullmatch("[0-9a-f]{64}", block.signature)
    )
    with client.messages.stream(**thinking) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole)
    assert "thinking" in kinds and "signature" in kinds
    history = [
        *ASK,
        {"role": "assistant", "content": whole.content},
        {"role": "user", "content": "Go on."},
    ]
    assert client.messages.create(**thinking | {"messages": history}).usage.output_tokens == 6
    omitted = client.messages.create(
        **thinking | {"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}
    )
    assert omitted.content[0].thinking == "" and omitted.content[0].signature == block.signature


def test_x_api_key(server):
    body = {"model": MODEL, "max_tokens": 1, "messages": ASK}
    for key in (None, "wrong"):
        r = post(server, body, x_api_key=key)
        assert r.status_code == 401
        assert r.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "missing or wrong API key"},
        }
    assert post(server, body, anthropic_version="any value").status_code == 200
    assert post(server, body, x_api_key=None, authorization=f"Bearer {KEY}").status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**body)


USER = {"role": "user", "content": "x"}
PNG = "iVBORw0KGgo="  # the PNG signature alone: no image
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
INVALID = (400, "invalid_request_error")


def req(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 1, "messages": [USER]} | fields


def user(*blocks: dict) -> dict:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize(
    "body, path, answer, needle",
    [
        ({"model": MODEL, "messages": [USER]}, None, INVALID, "max_tokens"),
        (req(**user({"type": "video"})), None, INVALID, "'video'"),
        (req(**user({"type": "tool_result", "tool_use_id": "toolu_x"})), None, INVALID, "toolu_x"),
        (
            req(**user({"type": "tool_use", "id": "a", "name": "f", "input": {}})),
            None,
            INVALID,
            "may not",
        ),
        (req(**user(IMAGE)), None, INVALID, "text only"),
        (req(model="claude-9"), None, (404, "not_found_error"), "claude-9"),
        (req(temperature=1.5), None, INVALID, "temperature"),
        (req(thinking={"type": "enabled"}), None, INVALID, "budget_tokens"),
        (req(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), None, INVALID, "nope"),
        (req(stop_sequences=[""]), None, INVALID, "stop_sequences"),
        (req(tools=[{"type": "web_search_20250305", "name": "ws"}]), None, INVALID, "tools"),
        (req(max_tokens=10**7), None, INVALID, "context limit"),
        (b"{not json", None, INVALID, ""),
        (
            req(messages=[{"role": "user", "content": "x" * 30000}]),
            None,
            (413, "request_too_large"),
            "",
        ),
        (req(), "/v1/messages/nope", (404, "not_found_error"), ""),
        (
            {"model": "claude-9", "messages": [USER]},
            "/v1/messages/count_tokens",
            (404, "not_found_error"),
            "claude-9",
        ),
    ],
)
def test_errors_in_anthropic_shape(server, body, path, answer, needle):
    r = post(server, body, path or "/v1/messages")
    status, kind = answer
    assert r.status_code == status, r.text
    out = r.json()
    assert out["type"] == "error" and out["error"]["type"] == kind, out
    assert needle in out["error"]["message"] and set(out["error"]) == {"type", "message"}


def test_errors_are_counted(server):
    post(server, {"model": MODEL, "messages": [USER]})
    post(server, {"model": MODEL, "messages": [USER]}, "/v1/messages/count_tokens")
    metrics = httpx.get(f"{server}/metrics").text
    assert 'sparrow_requests_total{endpoint="messages",status="400"}' in metrics
    assert 'sparrow_requests_total{endpoint="count_tokens",status="200"}' in metrics


def test_fuzzed_bodies_never_5xx(server):
    """Bodies of the right shape holding extreme values and junk (the strategies of
    test_fuzz): every answer is under 500, errors in Anthropic's shape."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.server.test_fuzz import junk, max_tokens, mostly, stops, strings, temperature

    def block(*kinds: str, **fields) -> st.SearchStrategy:
        return st.fixed_dictionaries({"type": st.sampled_from(kinds), **fields})

    blocks = st.lists(
        block("text", text=strings)
        | block("image", source=junk)
        | block("tool_use", id=strings, name=strings, input=junk)
        | block("tool_result", tool_use_id=strings, content=junk, is_error=junk)
        | block("thinking", thinking=strings, signature=strings)
        | junk,
        max_size=3,
    )
    message = st.fixed_dictionaries(
        {
            "role": mostly(st.sampled_from(["user", "assistant"])),
            "content": mostly(strings | blocks),
        }
    )
    tool = st.fixed_dictionaries({"name": strings, "input_schema": mostly(st.just({}), junk)})
    bodies = st.fixed_dictionaries(
        {
            "model": mostly(st.just(MODEL)),
            "max_tokens": max_tokens,
            "messages": mostly(st.lists(message, min_size=1, max_size=3)),
        },
        optional={
            "system": mostly(strings | blocks),
            "stop_sequences": mostly(stops),
            "temperature": mostly(temperature),
            "stream": mostly(st.booleans()),
            "tools": mostly(st.lists(tool, max_size=2)),
            "tool_choice": mostly(block("auto", "any", "tool", "none", name=strings)),
            "thinking": mostly(block("enabled", "disabled", budget_tokens=junk)),
            "metadata": junk,
        },
    )

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies)
    def check(body):
        r = post(server, body)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert r.json()["type"] == "error", r.text

    check()
    assert post(server, req()).status_code == 200


def test_blocks_of_a_scripted_engine_whole_and_streamed(monkeypatch):
    """Reasoning, text and the model's own tool-call markup (tool_choice auto) as blocks;
    the stream builds the whole response's message."""
    script(monkeypatch, "<think>plan it</think>\n\n" + QWEN_OUT)
    app = build_app(
        RoomyEngine(),
        ToolTokenizer(),
        "scripted",
        reasoning=REASONING["qwen3"],
        tool_parser=PARSERS["qwen3"],
    )
    client = TestClient(app)
    tools = [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()]
    body = {"model": "scripted", "max_tokens": 1000, "messages": ASK, "tools": tools}
    whole = client.post("/v1/messages", json=body).json()
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, *calls = whole["content"]
    assert thinking["thinking"] == "plan it" and text == {"type": "text", "text": "Checking."}
    assert [(c["name"], c["input"]) for c in calls] == CALLS
    assert whole["stop_reason"] == "tool_use"
    _, message = rebuilt(client.post("/v1/messages", json=body | {"stream": True}).text)
    for a, b in zip(message["content"], whole["content"], strict=True):
        assert {**a, "id": None} == {**b, "id": None}
    assert message["stop_reason"] == "tool_use" and message["usage"] == whole["usage"]
    one = body | {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    assert [b["type"] for b in client.post("/v1/messages", json=one).json()["content"]][2:] == [
        "tool_use"
    ]


def test_engine_failures_in_anthropic_shape(monkeypatch):
    """A stream the engine fails mid-way ends with an error event; a whole response gets
    a 500, a full queue a 503 overloaded_error, a bug a 500 api_error."""
    script(monkeypatch, "Hello world, at some length.")
    engine = RoomyEngine()
    app = build_app(engine, ToolTokenizer(), "scripted")
    client = TestClient(app, raise_server_exceptions=False)
    body = {"model": "scripted", "max_tokens": 100, "messages": ASK}
    engine.fail_after = 3
    text = client.post("/v1/messages", json=body | {"stream": True}).text
    names, _ = rebuilt(text)
    assert names[:2] == ["message_start", "ping"] and names[-1] == "error"
    error = json.loads(text.strip().split("\n")[-1].removeprefix("data: "))["error"]
    assert error["type"] == "api_error" and "device lost" in error["message"]
    cases = [(None, 500, "api_error", "device lost")]
    cases += [(EngineFull("the queue is full"), 503, "overloaded_error", "queue is full")]
    cases += [(RuntimeError("a bug"), 500, "api_error", "a bug")]
    for refusal, status, kind, needle in cases:
        engine.refusal = refusal
        r = client.post("/v1/messages", json=body)
        assert r.status_code == status and r.json()["error"]["type"] == kind
        assert needle in r.json()["error"]["message"]


def png_base64(width: int, height: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_through_a_gateway_with_images():
    """A gateway over a worker (the tiny Qwen model, a stand-in vision tower): images as
    base64 and URL sources are preprocessed and counted like image_url parts."""
    pytest.importorskip("grpc")
    from sparrow.engine.async_engine import AsyncEngine
    from sparrow.gateway.policies import make_policy
    from sparrow.gateway.router import Router
    from sparrow.multimodal import QWEN3_5_MOE, MediaLimits
    from sparrow.multimodal.pipeline import MediaPipeline
    from sparrow.multimodal.video import QWEN3_5_MOE_VIDEO
    from sparrow.rpc.client import RemoteEngine
    from tests.rpc.conftest import WorkerThread, tiny_llm

    llm = tiny_llm()
    engine = AsyncEngine(llm, max_waiting=8)
    worker = WorkerThread(engine)
    router = Router(
        [worker.target],
        lambda a: RemoteEngine(a, llm.tokenizer.decode, poll_s=0.05),
        make_policy("least_load"),
        wait_s=30,
        decode=llm.tokenizer.decode,
        special_ids=llm.tokenizer.skipped_ids,
    )
    media = MediaPipeline(QWEN3_5_MOE, QWEN3_5_MOE_VIDEO, MediaLimits())
    app = build_app(router, llm.tokenizer, "m", "gateway-key", 1 << 20, media=media)
    data = png_base64(40, 30)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    by_url = {"type": "image", "source": {"type": "url", "url": f"data:image/png;base64,{data}"}}
    text = {"type": "text", "text": "describe"}
    try:
        with live(app) as (host, port):
            client = anthropic.Anthropic(
                base_url=f"http://{host}:{port}", api_key="gateway-key", max_retries=0
            )
            plain = client.messages.count_tokens(
                model="m", messages=[{"role": "user", "content": [text]}]
            )
            body = {"model": "m", "max_tokens": 3, "extra_body": GREEDY}
            seen = [{"role": "user", "content": [text, image]}]
            whole = client.messages.create(**body, messages=seen)
            # 40x30 scales up to 320x224: 70 tokens in place of the template's image pad,
            # between its vision start and end
            assert whole.usage.input_tokens == plain.input_tokens + 2 + 70
            assert whole.usage.output_tokens == 3 and whole.stop_reason == "max_tokens"
            assert (
                client.messages.count_tokens(model="m", messages=seen).input_tokens
                == whole.usage.input_tokens
            )
            with client.messages.stream(
                **body, messages=[{"role": "user", "content": [text, by_url]}]
            ) as s:
                final = s.get_final_message()
            assert blocks(final) == blocks(whole) and final.usage == whole.usage
    finally:
        worker.stop()
        asyncio.run(engine.shutdown(timeout=30))
