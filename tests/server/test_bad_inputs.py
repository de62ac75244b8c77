"""Bad bodies through the real app (the built-in model) served by uvicorn on a socket: JSON
nested past the depth limit in any field, lone surrogates on /tokenize, strings where OpenAI
wants numbers or booleans, stop token ids outside the vocabulary. Each is a 400 with OpenAI's
error body, and the next request on the same keep-alive connection is served."""

import json
import threading

import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
import uvicorn  # noqa: E402

from sparrow.engine.async_engine import AsyncEngine  # noqa: E402
from sparrow.engine.llm import LLM  # noqa: E402
from sparrow.net import free_port  # noqa: E402
from sparrow.server.app import build_app  # noqa: E402
from sparrow.server.protocol import MAX_DEPTH  # noqa: E402

MODEL = "default"
HELLO = [{"role": "user", "content": "Hello"}]
NORMAL = {"model": MODEL, "messages": HELLO, "max_tokens": 1}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(an httpx client with one pooled connection to the served app, the vocabulary size)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SPARROW_CACHE", str(tmp_path_factory.mktemp("cache")))
    llm = LLM(model=None)
    app = build_app(AsyncEngine(llm, max_waiting=64), llm.tokenizer, MODEL)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    try:
        while not server.started:
            thread.join(0.05)
            assert thread.is_alive(), "the server did not start"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=60) as c:
            yield c, llm.model.config.vocab_size
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        mp.undo()


def local_port(reply) -> int:
    return reply.extensions["network_stream"].get_extra_info("client_addr")[1]


def post(client, path: str, raw: str):
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def refused(client, path: str, raw: str, needle: str) -> dict:
    """Post `raw`: a 400 with OpenAI's error body whose message holds `needle`; then a normal
    request on the same connection is served."""
    r = post(client, path, raw)
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and needle in error["message"], error
    after = client.post("/v1/chat/completions", json=NORMAL)
    assert after.status_code == 200, after.text[:500]
    assert local_port(after) == local_port(r), "the connection was dropped"
    return error


def chat(**fields) -> str:
    return json.dumps(NORMAL | fields)


def lists(depth: int) -> str:
    return "[" * depth + '"x"' + "]" * depth


def objects(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def schema(levels: int, leaf: str = '{"type": "integer"}') -> str:
    """An object schema `levels` deep (two JSON levels each)."""
    head = '{"type": "object", "required": ["a"], "properties": {"a": '
    return head * levels + leaf + "}}" * levels


def with_schema(text: str) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": "S"}}
    return chat(response_format=fmt).replace('"S"', text)


DEEP = [  # each 330+ levels, past the recursion of a naive walk
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "C"}]), lists(500)),
    (
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "C"}}]),
        objects(500),
    ),
    ("/v1/chat/completions", with_schema('"C"'), schema(200)),
    ("/v1/chat/completions", chat(logit_bias={"1": "C"}), lists(500)),
    ("/v1/chat/completions", chat(metadata="C"), objects(500)),
    ("/v1/chat/completions", chat(messages="C"), lists(330)),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "C", "max_tokens": 1}), lists(999)),
    ("/tokenize", json.dumps({"model": MODEL, "messages": "C"}), lists(500)),
    ("/detokenize", json.dumps({"model": MODEL, "tokens": "C"}), lists(500)),
    # past what json.loads itself parses
    ("/v1/chat/completions", chat(metadata="C"), lists(999)),
    ("/v1/chat/completions", chat(metadata="C"), lists(100_000)),
]


@pytest.mark.parametrize("path, body, inner", DEEP)
def test_deep_json_is_400_and_the_connection_lives(served, path, body, inner):
    raw = body.replace('"C"', inner)
    refused(served[0], path, raw, f"too deep: a request body may nest {MAX_DEPTH} levels")


def test_the_depth_limit_is_exact(served):
    """The body is level 1, `metadata` level 2: 63 more levels pass, 64 are refused."""
    client = served[0]
    ok = post(client, "/v1/chat/completions", chat(metadata="C").replace('"C"', lists(63)))
    assert ok.status_code == 200, ok.text[:500]
    refused(client, "/v1/chat/completions", chat(metadata="C").replace('"C"', lists(64)), "deep")


def test_schemas_at_the_limit_compile_or_are_400(served):
    """Schemas as deep as the body allows are served; one xgrammar refuses is a 400, and so
    is JSON text nested 100,000 deep inside a string (xgrammar's own recursion guard)."""
    client = served[0]
    levels = (MAX_DEPTH - 4) // 2  # body, response_format, json_schema, schema
    arrays = "{" + '"type": "array", "items": {' * (MAX_DEPTH - 4) + "}" * (MAX_DEPTH - 3)
    for text in (schema(levels), arrays):
        r = post(client, "/v1/chat/completions", with_schema(text))
        assert r.status_code == 200, r.text[:500]
    bad = schema(levels, '{"type": "no such type"}')
    refused(client, "/v1/chat/completions", with_schema(bad), "structured output")
    deep_text = chat(structured_outputs={"json": lists(100_000)})
    refused(client, "/v1/chat/completions", deep_text, "structured output")


@pytest.mark.parametrize(
    "raw, where",
    [
        ('{"model": "default", "prompt": "a\\ud800"}', "prompt holds a string"),
        (
            '{"model": "default", "messages": [{"role": "user", "content": "\\udfffa"}]}',
            "messages.0.content holds a string",
        ),
        (
            '{"model": "default", "messages": [{"role": "user", "content": "a"}], '
            '"chat_template_kwargs": {"\\ud800": 1}}',
            "chat_template_kwargs has a key",
        ),
    ],
)
def test_lone_surrogate_in_tokenize_is_400(served, raw, where):
    refused(served[0], "/tokenize", raw, f"{where} with a lone UTF-16 surrogate")


@pytest.mark.parametrize(
    "path, fields, needle",
    [
        ("/v1/completions", {"stream": "yes"}, "stream: Input should be a valid boolean"),
        ("/v1/completions", {"max_tokens": "10"}, "max_tokens: expected an integer, got a string"),
        ("/v1/completions", {"n": "2"}, "n: expected an integer, got a string"),
        ("/v1/completions", {"max_tokens": 1.5}, "max_tokens: Input should be a valid integer"),
        ("/v1/completions", {"max_tokens": True}, "max_tokens: expected an integer, got a bool"),
        ("/v1/completions", {"temperature": "0.5"}, "temperature: expected a number"),
        ("/v1/completions", {"top_p": True}, "top_p: expected a number, got a boolean"),
        ("/v1/completions", {"seed": "7"}, "seed: expected an integer"),
        ("/v1/completions", {"logprobs": "1"}, "logprobs: expected an integer"),
        ("/v1/completions", {"prompt": ["1", "2"]}, "prompt.list"),
        ("/v1/completions", {"stop_token_ids": ["1"]}, "stop_token_ids.0: expected an integer"),
        ("/v1/completions", {"logit_bias": {"1": "5"}}, "logit_bias.1: expected a number"),
        ("/v1/completions", {"ignore_eos": 1}, "ignore_eos: Input should be a valid boolean"),
        ("/v1/completions", {"stream_options": {"include_usage": "yes"}}, "include_usage"),
        ("/v1/chat/completions", {"logprobs": "true"}, "logprobs: Input should be a valid bool"),
        ("/v1/chat/completions", {"top_logprobs": "2"}, "top_logprobs: expected an integer"),
        ("/v1/chat/completions", {"max_completion_tokens": "5"}, "max_completion_tokens:"),
        ("/detokenize", {"tokens": ["1"]}, "tokens.0: expected an integer"),
    ],
)
def test_strings_for_numbers_and_booleans_are_400(served, path, fields, needle):
    base = {"model": MODEL, "max_tokens": 1}
    base |= {"messages": HELLO} if "chat" in path else {"prompt": "hi"}
    if path == "/detokenize":
        base = {"model": MODEL}
    refused(served[0], path, json.dumps(base | fields), needle)


def test_json_numbers_pass_as_openai_takes_them(served):
    """Ints for floats, and integral floats for ints."""
    body = NORMAL | {"max_tokens": 2.0, "temperature": 1, "top_p": 1, "logit_bias": {"1": 1}}
    r = served[0].post("/v1/chat/completions", json=body | {"stream": False, "n": 2.0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text[:500]


@pytest.mark.parametrize("ids", [[10**12], ["vocab"], [5, -1], [2**32]])
def test_stop_token_ids_outside_the_vocabulary_are_400(served, ids):
    client, vocab = served
    ids = [vocab if i == "vocab" else i for i in ids]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop_token_ids": ids}
    refused(client, "/v1/completions", json.dumps(body), "stop_token_ids")
