"""Property tests of the real app (the built-in tiny model, in process) against request bodies
of the right shape holding extreme values: denormal and huge floats, NaN and Infinity as raw
JSON text, ints past 64 bits, negative numbers, empty and 10 KB strings, lone surrogates as
JSON escapes, nested junk and wrong types. Every answer is under 500, and the engine answers
a normal request after each one."""

import json

import pytest

pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")
MODEL = "default"
NORMAL = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}

EXTREME_NUMBERS = [
    5e-324,
    1e-45,
    2.2250738585072014e-308,
    -0.0,
    0.0,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    0.5,
    1.0,
    2.0,
    2.0000001,
    -1,
    0,
    1,
    2,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**64),
    10**30,
    -(10**30),
]
TEXTS = [
    "",
    " ",
    "\x00",
    "\U0001f600" * 50,
    "\u202e\u0301",
    "x" * 10_000,
    "日本語" * 1000,
    "</s><|im_end|>",
    "<|endoftext|>",
    "\\u0000",
    "null",
]
SURROGATES = ["\ud800", "\udfff", "a\ud800b", "\udc00\ud800"]  # JSON escapes of lone halves

numbers = st.sampled_from(EXTREME_NUMBERS) | st.floats() | st.integers()
texts = (
    st.sampled_from(TEXTS)
    | st.text(max_size=40)
    | st.text(st.characters(codec=None, categories=["Co", "Cn", "Zs", "Mn", "Cc"]), max_size=20)
)
surrogates = st.sampled_from(SURROGATES) | st.text(
    st.characters(codec=None, categories=["Cs"]), min_size=1, max_size=4
)
strings = st.integers(0, 7).flatmap(lambda i: surrogates if i == 7 else texts)
scalars = st.none() | st.booleans() | numbers | strings
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
wrong = numbers | junk


def mostly(valid, other=wrong):
    """`valid` eleven times in twelve, `other` otherwise: most bodies pass validation, so the
    extremes reach the engine."""
    return st.integers(0, 11).flatmap(lambda i: other if i == 11 else valid)


def edge(values: list, more=None):
    """One of `values`, or (given) a draw from `more`."""
    return st.sampled_from(values) if more is None else st.sampled_from(values) | more


# in range for the protocol, at its edges; max_tokens stays small (the model runs it) or is
# refused (never None: the default fills the context)
max_tokens = mostly(
    st.integers(1, 3), edge([0, -1, 2**64, 10**30, 10**7, 262144, 262145, 5e-324, 1.5, "3", True])
)
temperature = edge(
    [5e-324, 1e-45, 1e-300, 2.2250738585072014e-308, 0.0, -0.0, 1e-7, 1.9999999, 2.0],
    st.floats(0, 2),
)
top_p = edge([5e-324, 1e-45, 1e-300, 1e-7, 0.9999999, 1.0], st.floats(5e-324, 1))
top_k = edge(
    [0, 1, 2, 248319, 248320, 248321, 2**31, 2**63 - 1, 2**63, 2**64, 10**30], st.integers(0)
)
seed = edge(
    [0, -1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**64), 10**30, -(10**30)],
    st.integers(),
)
stops = strings | st.lists(strings, min_size=1, max_size=4)
content = strings | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": strings}), min_size=1, max_size=2
)
message = st.fixed_dictionaries(
    {
        "role": mostly(st.sampled_from(["user", "system", "assistant", "developer", "tool"])),
        "content": mostly(content),
    }
)
token_ids = st.lists(
    mostly(st.integers(0, 5000), edge([-1, 248319, 248320, 2**31, 2**64])), min_size=1, max_size=20
)
SHARED = {
    "temperature": mostly(temperature),
    "top_p": mostly(top_p),
    "top_k": mostly(top_k),
    "seed": mostly(seed),
    "n": mostly(edge([1, 2, 16]), edge([0, -1, 17, 2**64, 1.5, "2"])),
    "stop": mostly(stops),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": mostly(st.booleans()),
    "user": mostly(texts),
    "unknown_field": junk,
    "frequency_penalty": mostly(st.just(0), numbers),
}
chat_bodies = st.fixed_dictionaries(
    {
        "model": mostly(st.just(MODEL)),
        "max_tokens": max_tokens,
        "messages": mostly(st.lists(message, min_size=1, max_size=2)),
    },
    optional=SHARED
    | {
        "logprobs": mostly(st.booleans()),
        "max_completion_tokens": max_tokens,
        "top_logprobs": mostly(edge([0, 1, 20])),
    },
)
text_bodies = st.fixed_dictionaries(
    {
        "model": mostly(st.just(MODEL)),
        "max_tokens": max_tokens,
        "prompt": mostly(strings | token_ids),
    },
    optional=SHARED
    | {
        "logprobs": mostly(edge([0, 1, 20])),
        "echo": mostly(st.just(False)),
        "suffix": mostly(st.just("")),
    },
)


class Server:
    """The app over a fresh engine; rebuilt when a request left the engine dead, so that one
    failure does not make every later example fail too."""

    def __init__(self):
        self.client: TestClient | None = None
        self.rebuilds = 0

    def ensure(self) -> TestClient:
        if self.client is not None and self.client.get("/health").status_code == 200:
            return self.client
        self.close()
        from sparrow.config import EngineConfig
        from sparrow.engine.async_engine import AsyncEngine
        from sparrow.engine.llm import LLM
        from sparrow.server.app import build_app

        llm = LLM(config=EngineConfig.from_kwargs(model=None))
        app = build_app(AsyncEngine(llm, max_waiting=64), llm.tokenizer, MODEL)
        self.client = TestClient(app, raise_server_exceptions=False).__enter__()
        self.rebuilds += 1
        return self.client

    def close(self) -> None:
        if self.client is not None:
            self.client.__exit__(None, None, None)
            self.client = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPARROW_CACHE", str(tmp_path_factory.mktemp("cache")))
    s = Server()
    yield s
    s.close()
    mp.undo()


def send(client: TestClient, path: str, body: dict):
    """`body` as JSON text: NaN and +-Infinity as bare words, lone surrogates as \\u escapes."""
    raw = json.dumps(body, allow_nan=True, ensure_ascii=True)
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def check(server: Server, path: str, body: dict) -> None:
    client = server.ensure()
    r = send(client, path, body)
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many got past validation
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text[:500]
        return  # refused before the engine stepped it
    if body.get("stream") is True:
        assert "[DONE]" in r.text and '"error"' not in r.text, r.text[-500:]
    after = client.post("/v1/chat/completions", json=NORMAL)
    assert after.status_code == 200, ("the engine stopped answering", after.text[:500])


SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=SLOW_IS_FINE)


@FUZZ
@given(body=chat_bodies)
def test_chat_extreme_bodies_never_5xx(server, body):
    check(server, "/v1/chat/completions", body)


@FUZZ
@given(body=text_bodies)
def test_completion_extreme_bodies_never_5xx(server, body):
    check(server, "/v1/completions", body)


@pytest.mark.parametrize(
    "path, raw",
    [
        (
            "/v1/chat/completions",
            '{"model": "default", "messages": [{"role": "user", "content": '
            '"hi"}], "max_tokens": 2, "temperature": NaN}',
        ),
        (
            "/v1/chat/completions",
            '{"model": "default", "messages": [{"role": "user", "content": '
            '"hi"}], "max_tokens": 2, "top_p": -Infinity}',
        ),
        ("/v1/completions", '{"model": "default", "prompt": "\\ud800", "max_tokens": 2}'),
        (
            "/v1/completions",
            '{"model": "default", "prompt": "hi", "max_tokens": 2, "seed": 18446744073709551616}',
        ),
        (
            "/v1/completions",
            '{"model": "default", "prompt": "hi", "max_tokens": 2, "temperature": 1e-45}',
        ),
        (
            "/v1/completions",
            '{"model": "default", "prompt": "hi", "max_tokens": 2, "temperature": 5e-324}',
        ),
        (
            "/v1/completions",
            '{"model": "default", "prompt": " ", "max_tokens": 1, "top_p": 5e-324}',
        ),
        ("/v1/completions", '{"model": "default", "prompt": [1, 2], "max_tokens": 1e400}'),
        (
            "/v1/chat/completions",
            '{"model": "default", "messages": [{"role": "user", "content": '
            '"hi"}], "max_tokens": 2, "stop": ["\\udfff"]}',
        ),
    ],
)
def test_known_extremes_never_5xx(server, path, raw):
    """Raw bodies hypothesis may not reach: each is answered under 500, and the engine keeps
    answering."""
    client = server.ensure()
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500])
    after = client.post("/v1/chat/completions", json=NORMAL)
    assert after.status_code == 200, ("the engine stopped answering", after.text[:500])


item = st.fixed_dictionaries(
    {"type": mostly(st.sampled_from(["message", "function_call", "function_call_output"]))},
    optional={
        "role": mostly(st.sampled_from(["user", "assistant", "system", "developer"])),
        "content": mostly(content),
        "call_id": strings,
        "name": strings,
        "arguments": strings,
        "output": junk,
    },
)
response_bodies = st.fixed_dictionaries(
    {"model": mostly(st.just(MODEL)), "input": mostly(strings | st.lists(item, max_size=3))},
    optional={
        "instructions": mostly(strings),
        "max_output_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stream": mostly(st.booleans()),
        "store": mostly(st.booleans()),
        "previous_response_id": strings,
        "tools": mostly(
            st.lists(
                st.fixed_dictionaries(
                    {"type": mostly(st.just("function")), "name": strings},
                    optional={"parameters": mostly(st.just({}), junk)},
                ),
                max_size=2,
            )
        ),
        "tool_choice": mostly(st.sampled_from(["auto", "none", "required"])),
        "text": mostly(
            st.fixed_dictionaries(
                {
                    "format": mostly(
                        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
                    )
                }
            )
        ),
        "reasoning": mostly(
            st.fixed_dictionaries({"effort": mostly(st.sampled_from(["low", "none"]))})
        ),
    },
)


@FUZZ
@given(body=response_bodies)
def test_responses_extreme_bodies_never_5xx(server, body):
    """/v1/responses, whole and streamed: under 500 with an OpenAI error body, a stream never
    fails, and the engine answers after."""
    client = server.ensure()
    r = send(client, "/v1/responses", body)
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text[:500]
        return
    if body.get("stream") is True:
        assert "response.failed" not in r.text, r.text[-500:]
    after = client.post("/v1/chat/completions", json=NORMAL)
    assert after.status_code == 200, ("the engine stopped answering", after.text[:500])
