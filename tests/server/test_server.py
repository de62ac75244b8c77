"""The real server in a subprocess on the built-in small checkpoint, driven with the official
openai client (and raw HTTP for the error cases)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from sparrow.net import free_port

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "test-key"
MODEL = "default"


def _start(cache_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = os.environ | {"SPARROW_CACHE": str(cache_dir)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparrow",
            "serve",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--max-body-bytes",
            "20000",
            "--max-waiting",
            "64",
            *flags,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stdout.read()}")
    else:
        proc.kill()
        pytest.fail("server did not start")
    return proc, base


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, base = _start(tmp_path_factory.mktemp("cache"))
    yield base
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def _chat(client, **kw):
    args = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 12,
        "temperature": 0,
    } | kw
    return client.chat.completions.create(**args)


def test_chat_non_streaming_and_usage(client):
    out = _chat(client)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop") and out.usage.completion_tokens <= 12
    from sparrow.assets import default_checkpoint
    from sparrow.tokenizer import load_tokenizer

    tok = load_tokenizer(default_checkpoint())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
    assert out.usage.prompt_tokens == len(tok.encode(prompt))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streaming_matches_non_streaming(client):
    whole = _chat(client).choices[0].message.content
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_completions_endpoint_and_models(client):
    out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.usage.completion_tokens == 5
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_stop_string(client):
    full = _chat(client, max_tokens=16).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if not stop.strip():
        pytest.skip("generated text too short to pick a stop string")
    out = _chat(client, max_tokens=16, stop=[stop]).choices[0]
    assert out.finish_reason == "stop" and stop not in out.message.content
    assert full.startswith(out.message.content)


def test_seed_determinism_and_n(client):
    a = _chat(client, temperature=1.0, seed=7, n=2)
    b = _chat(client, temperature=1.0, seed=7, n=2)
    assert len(a.choices) == 2
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_16_concurrent_streams(client):
    results, errors = [], []

    def one(i):
        try:
            stream = _chat(client, stream=True, max_tokens=8, temperature=0.5, seed=i)
            results.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 16


def _metric(server, name) -> float:
    text = httpx.get(f"{server}/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(lines[0].split()[1])


def test_disconnect_mid_stream_frees_the_request(server):
    aborted = _metric(server, "sparrow_aborted_requests_total")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2000,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{server}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content": "' in line:
                break  # got a token: hang up
    deadline = time.time() + 30
    while time.time() < deadline:
        if (
            _metric(server, "sparrow_aborted_requests_total") > aborted
            and _metric(server, "sparrow_running_requests") == 0
        ):
            return
        time.sleep(0.2)
    pytest.fail("the request kept running after the client left")


def _post(server, body, key=KEY, raw=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(f"{server}/v1/chat/completions", content=content, headers=headers)


@pytest.mark.parametrize(
    "body, raw, status, needle",
    [
        (None, "{not json", 400, ""),
        ({"model": MODEL}, None, 400, "messages"),
        ({"model": MODEL, "messages": []}, None, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None, 400, "role"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1},
            None,
            400,
            "temperature",
        ),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, None, 404, "gpt-9"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7},
            None,
            400,
            "context limit",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 30000}]}, None, 413, ""),
    ],
)
def test_errors(server, body, raw, status, needle):
    r = _post(server, body, raw=raw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and needle in error["message"]


def test_api_key(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    assert _post(server, body, key=None).status_code == 401
    assert _post(server, body, key="wrong").json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/health").status_code == 200  # health needs no key


def test_fuzzed_bodies_never_5xx(server):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-5, 10**6)
        | st.floats(allow_nan=False)
        | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=8,
    )
    keys = st.sampled_from(
        [
            "model",
            "messages",
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "stop",
            "stream",
            "seed",
            "top_k",
            "prompt",
        ]
    )

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(st.dictionaries(keys, values, max_size=6))
    def check(body):
        body.setdefault("model", MODEL)
        body["max_tokens"] = (
            2 if not isinstance(body.get("max_tokens"), int) else body["max_tokens"]
        )
        r = _post(server, body)
        assert r.status_code < 500, (body, r.text)

    check()
    assert httpx.get(f"{server}/health").status_code == 200


def test_logprobs(client):
    out = _chat(client, max_tokens=4, logprobs=True, top_logprobs=3).choices[0]
    entries = out.logprobs.content
    assert len(entries) >= 1
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert abs(tops[0] - e.logprob) < 1e-5  # greedy: the sampled token is the top one
    text = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=3, temperature=0, logprobs=2
    ).choices[0]
    assert len(text.logprobs.tokens) == 3 and len(text.logprobs.top_logprobs[0]) <= 2
    assert text.logprobs.text_offset[0] == 0
    streamed = list(_chat(client, max_tokens=3, logprobs=True, stream=True))
    assert (
        sum(
            len(c.choices[0].logprobs.content)
            for c in streamed
            if c.choices and c.choices[0].logprobs
        )
        == 3
    )


def test_sigterm_drains_with_the_listener_open(tmp_path):
    """SIGTERM mid-stream: while the stream runs on, new requests get 503 + Retry-After with
    OpenAI's error body (not a refused connection) and /health 503; the stream runs to its
    end, then the server exits 0 and the listener is gone."""
    proc, base = _start(tmp_path, "--drain-timeout", "120")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    # ~1,000 tokens: seconds on a CPU, against the few ms the checks below take
    stream = _chat(client, stream=True, max_tokens=1000, extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    proc.terminate()
    late = _post(base, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert late.status_code == 503 and late.headers["retry-after"] == "1"
    assert late.json()["error"]["type"] == "server_overloaded"
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(bool(c.choices[0].delta.content) for c in chunks) > 100
    assert proc.wait(timeout=60) == 0
    assert "server stopped" in proc.stdout.read()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{base}/health", timeout=2)
