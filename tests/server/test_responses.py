"""OpenAI's Responses API through the official openai SDK: over a scripted engine in process
(the packaged tokenizer and ChatML template: exact prompts, streamed events in order,
reasoning and function-call items, round trips, bad requests, retrieve / delete /
input_items); over the built-in model in process (forced tool calls, json_schema, the prompts
of a continued conversation and the prefix cache they hit); the store alone (expiry, size
cap, a file reopened); `sparrow serve` restarted between turns on one --responses-db; and
the gateway's app over a worker, keeping the store itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import time

import pytest

from sparrow.assets import default_checkpoint
from sparrow.chat_templates import CHATML_TEMPLATE
from sparrow.core.request import FinishReason, RequestOutput
from sparrow.engine.client import EngineError, EngineInfo
from sparrow.net import free_port
from sparrow.server.reasoning import PARSERS as REASONING
from sparrow.server.response_store import ResponseStore, ResponseStoreSettings
from sparrow.server.tool_parsers import PARSERS
from sparrow.tokenizer import load_tokenizer
from tests.server import test_app
from tests.server.test_app import ScriptedEngine
from tests.server.test_tools import CALLS, SCHEMAS, rendered

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from sparrow.server.app import build_app  # noqa: E402

MODEL = "default"
TOKENIZER = load_tokenizer(None)  # the packaged vocabulary and ChatML template
BUILTIN = load_tokenizer(default_checkpoint())  # the built-in model's
FLAT_TOOLS = [{"type": "function", "name": n, "parameters": p} for n, p in SCHEMAS.items()]
NESTED_TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}} for n, p in SCHEMAS.items()
]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]


class StopEngine(ScriptedEngine):
    """Writes `test_app.PIECES` one token each and ends with a stop token (at max_tokens:
    length); room for prompts that carry tools."""

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(max_model_len=8192, vocab_size=1 << 20, default_stop_token_ids=())

    async def _stream(self, request_id, params):
        tokens = list(test_app.PIECES)
        n = min(params.max_tokens, len(tokens))
        for i, token in enumerate(tokens[:n]):
            await asyncio.sleep(0)
            if self.fail_after == i:
                raise EngineError("the engine stopped: device lost")
            end = FinishReason.STOP if n == len(tokens) else FinishReason.LENGTH
            out = RequestOutput(request_id, [token], end if i == n - 1 else None)
            for delta in self.processor.process([out]):
                yield delta

    def prompt(self, i: int = -1) -> str:
        return TOKENIZER.decode(self.added[i][1])


def script(monkeypatch, text: str, size: int = 4) -> None:
    """The engine writes `text`, `size` characters a token."""
    pieces = {i + 1: text[i * size : (i + 1) * size] for i in range((len(text) + size - 1) // size)}
    monkeypatch.setattr(test_app, "PIECES", pieces)


@pytest.fixture
def serve():
    """serve(**build_app keywords) -> (engine, SDK client, TestClient) over a StopEngine."""
    with contextlib.ExitStack() as stack:

        def start(**kwargs):
            engine = StopEngine()
            http = stack.enter_context(TestClient(build_app(engine, TOKENIZER, MODEL, **kwargs)))
            sdk = openai.OpenAI(
                base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
            )
            return engine, sdk, http

        yield start


def chatml(messages: list[dict], **kwargs) -> str:
    return TOKENIZER.apply_chat_template(messages, **kwargs)


def test_create_whole_and_streamed(serve, monkeypatch):
    script(monkeypatch, "Hello world!")
    engine, client, _ = serve()
    r = client.responses.create(
        model=MODEL, input="hi", instructions="Be brief.", metadata={"k": "v"}, user="u1"
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello world!" and r.incomplete_details is None
    (item,) = r.output
    assert (item.type, item.role, item.status, item.content[0].type) == (
        "message",
        "assistant",
        "completed",
        "output_text",
    )
    assert (r.metadata, r.user, r.instructions, r.model) == ({"k": "v"}, "u1", "Be brief.", MODEL)
    prompt = chatml([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert engine.prompt() == prompt
    n = len(engine.added[-1][1])
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (n, 3, n + 3)

    events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    assert [e.type for e in events] == [
        *TEXT_EVENTS,
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type.endswith(".delta")) == "Hello world!"
    assert events[-1].response.output_text == "Hello world!"
    assert events[-1].response.output[0].id == events[2].item.id
    with client.responses.stream(model=MODEL, input="hi") as stream:
        assert stream.get_final_response().output_text == "Hello world!"


def test_max_output_tokens_ends_incomplete(serve, monkeypatch):
    script(monkeypatch, "Hello world!")
    _, client, _ = serve()
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Hello wo" and r.output[0].status == "incomplete"
    events = list(
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_engine_failure(serve, monkeypatch):
    """Mid-stream: a response.failed event ends the stream; whole: a 500. Nothing stored."""
    script(monkeypatch, "Hello world!")
    engine, client, http = serve()
    engine.fail_after = 1
    events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    assert (
        events[-1].type == "response.failed" and "device lost" in events[-1].response.error.message
    )
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model=MODEL, input="hi")
    assert "sparrow_responses_stored 0.0" in http.get("/metrics").text


def test_reasoning_items_and_effort(serve, monkeypatch):
    """The ChatML template opens a think block: reasoning until `</think>` is a reasoning
    item; effort "none" asks the template for no thinking."""
    script(monkeypatch, "plan it</think>\n\nAnswer!", size=3)
    engine, client, _ = serve(reasoning=REASONING["qwen3"])
    r = client.responses.create(model=MODEL, input="hi")
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "plan it"
    assert message.type == "message" and r.output_text == "Answer!"
    assert r.usage.output_tokens_details.reasoning_tokens == 5  # "plan it</think>\n" in 3s
    events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == "plan it"
    client.responses.create(model=MODEL, input="hi", reasoning={"effort": "none"})
    assert engine.prompt().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the next turn: this template drops the earlier turn's reasoning
    client.responses.create(model=MODEL, input="and?", previous_response_id=r.id)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Answer!"}]
    assert engine.prompt() == chatml([*turns, {"role": "user", "content": "and?"}])


def test_function_call_round_trip(serve, monkeypatch):
    out = rendered(CHATML_TEMPLATE, "Checking.", CALLS)
    script(monkeypatch, out)
    engine, client, _ = serve(tool_parser=PARSERS["qwen3"])
    r = client.responses.create(model=MODEL, input="weather?", tools=FLAT_TOOLS)
    message, *calls = r.output
    assert message.type == "message" and r.output_text == "Checking."
    assert [(c.type, c.name, json.loads(c.arguments)) for c in calls] == [
        ("function_call", n, a) for n, a in CALLS
    ]
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)
    events = list(
        client.responses.create(model=MODEL, input="weather?", tools=FLAT_TOOLS, stream=True)
    )
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [a for _, a in CALLS]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "function_call", "function_call"]

    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": f"result {i}"}
        for i, c in enumerate(calls)
    ]
    client.responses.create(model=MODEL, input=results, tools=FLAT_TOOLS, previous_response_id=r.id)
    assistant = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS
        ],
    }
    tools_out = [{"role": "tool", "content": f"result {i}"} for i in range(2)]
    expected = chatml(
        [{"role": "user", "content": "weather?"}, assistant, *tools_out], tools=NESTED_TOOLS
    )
    assert engine.prompt() == expected and out in expected  # the call as the model wrote it
    # the same conversation sent whole, without the store
    history = [
        {"role": "user", "content": "weather?"},
        *[c.model_dump() for c in r.output],
        *results,
    ]
    client.responses.create(model=MODEL, input=history, tools=FLAT_TOOLS, store=False)
    assert engine.prompt() == expected
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL, input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]
        )
    assert e.value.body["param"] == "input[0].call_id" and "nope" in e.value.body["message"]


def test_retrieve_delete_and_input_items(serve, monkeypatch):
    script(monkeypatch, "Hello world!")
    _, client, http = serve()
    items = [{"role": "user", "content": f"part {i}"} for i in range(3)]
    r = client.responses.create(model=MODEL, input=items)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    listed = client.responses.input_items.list(r.id)
    assert [i.content[0].text for i in listed.data] == ["part 2", "part 1", "part 0"]  # desc
    page = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert page.has_more and len(page.data) == 2
    assert [i.content[0].text for i in page] == ["part 0", "part 1", "part 2"]  # pages on
    client.responses.delete(r.id)
    for call in (
        lambda: client.responses.retrieve(r.id),
        lambda: client.responses.delete(r.id),
        lambda: client.responses.input_items.list(r.id),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert r.id in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"
    metrics = http.get("/metrics").text
    assert 'sparrow_requests_total{endpoint="responses",status="404"} 3.0' in metrics
    assert 'sparrow_requests_total{endpoint="responses",status="200"}' in metrics
    assert "sparrow_responses_stored 0.0" in metrics


def test_store_false_and_unknown_previous_response(serve, monkeypatch):
    script(monkeypatch, "Hello world!")
    _, client, _ = serve()
    r = client.responses.create(
        model=MODEL, input="hi", store=False, include=["reasoning.encrypted_content"]
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    for previous in (r.id, "resp_unknown"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="more", previous_response_id=previous)
        assert e.value.body["param"] == "previous_response_id"
        assert e.value.body["code"] == "previous_response_not_found"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}
                ]
            },
            "input",
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}
                ]
            },
            "input[0].arguments",
        ),
        ({"input": []}, "input"),
        ({"input": [{"type": [None]}]}, "input[0].type"),  # a type that is not a string
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, None),
        ({"background": True}, None),
        ({"reasoning": {"effort": "max"}}, None),
        ({"include": ["message.output_text.logprobs"]}, None),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_requests_are_400(serve, fields, param):
    _, _, http = serve()
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi"} | fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_store_expiry_size_cap_and_reopen(tmp_path):
    now = [1000.0]
    path = str(tmp_path / "responses.db")

    def store(**kw):
        return ResponseStore(ResponseStoreSettings(path, **kw), clock=lambda: now[0])

    def put(s, i, pad=0):
        return asyncio.run(s.put({"id": f"r{i}", "pad": "x" * pad}, [], [], []))

    def stored(s):
        return [i for i in range(6) if asyncio.run(s.get(f"r{i}")) is not None]

    s = store(ttl_s=10.0)
    assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    put(s, 0)
    now[0] += 5
    put(s, 1)
    now[0] += 6  # r0 is past its 10 s, r1 is not
    assert stored(s) == [1]
    put(s, 2)
    assert s.evicted["expired"] == 1 and s.count == 2
    s.close()
    s = store(ttl_s=None, max_mb=3000 / (1 << 20))  # reopened: what was stored is there
    assert stored(s) == [1, 2]
    for i in (3, 4, 5):
        assert put(s, i, pad=1200)
    assert stored(s) == [4, 5] and s.bytes <= 3000 and s.evicted["size"] == 3
    assert not put(s, 0, pad=4000)  # alone over the cap: not stored
    assert stored(s) == [4, 5]
    s.close()


# The built-in model, in process -------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    """(engine, SDK client, the prompts the engine was given) over the built-in model."""
    from sparrow.engine.async_engine import AsyncEngine
    from sparrow.engine.llm import LLM

    llm = LLM(model=None, block_size=16)
    engine = AsyncEngine(llm)
    prompts = []
    add = engine.add

    async def recorded(request_id, ids, params, media=()):
        prompts.append(list(ids))
        return await add(request_id, ids, params, media)

    engine.add = recorded
    app = build_app(engine, llm.tokenizer, MODEL, tool_parser=PARSERS["qwen3"])
    with TestClient(app) as http:
        yield (
            engine,
            openai.OpenAI(
                base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
            ),
            prompts,
        )


def test_forced_tool_calls_and_round_trip(real):
    _, client, _ = real
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice=named,
        max_output_tokens=24,
        temperature=0,
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice=named,
            max_output_tokens=24,
            temperature=0,
            stream=True,
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments  # streamed as written, the same as whole
    r = client.responses.create(
        model=MODEL,
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    assert [o.type for o in r.output] == ["function_call"] and r.output[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": r.output[0].call_id, "output": "sunny"}
    after = client.responses.create(
        model=MODEL,
        input=[result],
        previous_response_id=r.id,
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
    )
    assert after.status in ("completed", "incomplete")


def test_json_schema_text_format(real):
    _, client, _ = real
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "item", "schema": schema, "strict": True}
    r = client.responses.create(
        model=MODEL, input="An item", text={"format": fmt}, max_output_tokens=20, temperature=0
    )
    assert r.status == "completed" and 0 <= json.loads(r.output_text)["n"] <= 9
    r = client.responses.create(
        model=MODEL,
        input="An item",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        temperature=0,
    )
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict)


def test_continued_prompts_extend_the_previous_turn(real):
    """Turn N + 1's prompt is turn N's prompt and output ids as they ran (the `<think>\\n` its
    generation prompt opened and the reply as the model wrote it), then the template's render
    of the new input; the prefix cache serves turn N's blocks."""
    engine, client, prompts = real
    instructions = "You write Python for the standard library. " * 4
    previous, turns = None, []
    for text in ("Tell me about the os module", "And sys?", "And re?"):
        before = engine.stats().prefix_hit_rate * sum(len(p) for p in prompts)
        r = client.responses.create(
            model=MODEL,
            input=text,
            instructions=instructions,
            previous_response_id=previous,
            max_output_tokens=6,
            temperature=0,
        )
        hits = engine.stats().prefix_hit_rate * sum(len(p) for p in prompts) - before
        assert r.usage.input_tokens == len(prompts[-1])
        if turns:
            last, out = turns[-1]
            assert prompts[-1][: len(last)] == last
            assert BUILTIN.decode(prompts[-1][len(last) :]).endswith(
                f"{text}<|im_end|>\n<|im_start|>assistant\n<think>\n"
            )
            assert len(prompts[-1]) > len(last) + out
            assert round(hits) >= (len(last) - 1) // 16 * 16  # turn N's prompt, whole blocks
        turns.append((prompts[-1], r.usage.output_tokens))
        previous = r.id


def test_a_new_setup_renders_the_history_again(real):
    """Other instructions than the previous turn's: its tokens are not the new prompt's
    start; the stored conversation is rendered through the template with the new ones."""
    _, client, prompts = real
    first = client.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=3, temperature=0
    )
    client.responses.create(
        model=MODEL,
        input="More?",
        instructions="Be thorough.",
        previous_response_id=first.id,
        max_output_tokens=3,
        temperature=0,
    )
    messages = [
        {"role": "system", "content": "Be thorough."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More?"},
    ]
    assert prompts[-1] == BUILTIN.encode_chat(messages)


# `sparrow serve` and the gateway ------------------------------------------------------------


def _serve(db: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparrow", "serve", "--port", str(port), "--block-size", "16"]
        + ["--responses-db", db],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ | {"TRITON_INTERPRET": "0"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        assert proc.poll() is None, "the server exited"
        time.sleep(0.3)
    proc.kill()
    pytest.fail("the server did not start")


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_conversation_survives_a_restart(tmp_path):
    """Three turns on `sparrow serve`, restarted on the same --responses-db between turns 2
    and 3: each turn's prompt extends the one before by its output and the new input, turn
    3's too, from the stored tokens."""
    db = str(tmp_path / "responses.db")
    instructions = "Answer in Python. " * 8
    previous, before = None, None
    proc, base = _serve(db)
    try:
        for i, text in enumerate(("Tell me about os", "And sys?", "And re?")):
            if i == 2:  # the restart
                proc.terminate()
                assert proc.wait(timeout=60) == 0
                proc, base = _serve(db)
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            r = client.responses.create(
                model=MODEL,
                input=text,
                instructions=instructions,
                previous_response_id=previous,
                max_output_tokens=5,
                temperature=0,
            )
            new = len(BUILTIN.encode(text))
            if before is not None:
                assert r.usage.input_tokens > before.input_tokens + before.output_tokens + new
            before, previous = r.usage, r.id
        assert client.responses.retrieve(previous).previous_response_id is not None
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_gateway_keeps_the_store(tmp_path):
    """The gateway's app over a worker: the gateway holds the responses (its database), the
    worker only runs prompts."""
    from sparrow.engine.async_engine import AsyncEngine
    from sparrow.engine.llm import LLM
    from sparrow.gateway.app import GatewaySettings, build_gateway
    from tests.rpc.conftest import WorkerThread

    engine = AsyncEngine(LLM(model=None))
    worker = WorkerThread(engine)
    db = str(tmp_path / "gateway.db")
    settings = GatewaySettings(
        [worker.target], default_checkpoint(), MODEL, response_store=ResponseStoreSettings(db)
    )
    app, _, _ = build_gateway(settings)
    try:
        with TestClient(app) as http:
            client = openai.OpenAI(
                base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
            )
            first = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
            second = client.responses.create(
                model=MODEL, input="And?", previous_response_id=first.id, max_output_tokens=4
            )
            assert second.usage.input_tokens > first.usage.input_tokens
        rows = sqlite3.connect(db).execute("SELECT id FROM responses ORDER BY seq").fetchall()
        assert [r for (r,) in rows] == [first.id, second.id]
    finally:
        worker.stop()
        asyncio.run(engine.shutdown(timeout=30))
