"""The HTTP app over a scripted EngineClient (no model, in process): it plays a fixed token
stream through the real output processor, as the gateway's gRPC client will, so the app is
seen to need nothing but the interface."""

import asyncio
import json

import pytest

from sparrow.core.request import FinishReason, RequestOutput
from sparrow.core.sampling_params import SamplingParams, TokenLogprob
from sparrow.engine.client import (
    EngineClient,
    EngineError,
    EngineFull,
    EngineHealth,
    EngineInfo,
    EngineStats,
    InvalidRequest,
)
from sparrow.engine.output_processor import OutputProcessor

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from sparrow.server.app import build_app  # noqa: E402

PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}
MODEL = "scripted"


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text]

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


class ScriptedEngine(EngineClient):
    def __init__(self):
        self.processor = OutputProcessor(
            lambda ids: "".join(PIECES.get(i, f"#{i}") for i in ids), on_stop=self.abort
        )
        self.added: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.refusal: Exception | None = None
        self.fail_after: int | None = None  # tokens, then EngineError
        self.alive = True

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(max_model_len=64, vocab_size=50, default_stop_token_ids=())

    async def add(self, request_id, prompt_token_ids, params, media=()):
        if self.refusal is not None:
            raise self.refusal
        self.added.append((request_id, prompt_token_ids, params))
        self.processor.add(request_id, params)
        return self._stream(request_id, params)

    async def _stream(self, request_id, params):
        n = min(params.max_tokens, len(PIECES))
        for i, token in enumerate(list(PIECES)[:n]):
            await asyncio.sleep(0)
            if self.fail_after == i:
                raise EngineError("the engine stopped: device lost")
            lp = [TokenLogprob(token, -0.5, ((token, -0.5), (5, -2.0)))]
            out = RequestOutput(
                request_id, [token], FinishReason.LENGTH if i == n - 1 else None, lp
            )
            if i == 0 and params.prompt_logprobs is not None:  # the prompt's token p: -p, rank p
                prompt = next(ids for rid, ids, _ in self.added if rid == request_id)
                out.prompt_logprobs = [
                    TokenLogprob(t, -float(t), ((1, -1.0), (2, -2.0))[: params.prompt_logprobs], t)
                    for t in prompt[1:]
                ]
            for delta in self.processor.process([out]):
                yield delta
                if delta.finish_reason is not None:
                    return

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.processor.abort(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(waiting=0, running=len(self.processor), kv_usage=0.25)

    def health(self) -> EngineHealth:
        return EngineHealth(alive=self.alive, accepting=self.alive)

    async def shutdown(self) -> None:
        self.alive = False


@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def client(engine):
    return TestClient(build_app(engine, CharTokenizer(), MODEL))


def chat(client, **body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | body
    return client.post("/v1/chat/completions", json=body)


def events(response) -> list:
    lines = [ln.removeprefix("data: ") for ln in response.text.split("\n\n") if ln]
    return [ln if ln == "[DONE]" else json.loads(ln) for ln in lines]


def test_chat_whole_response_and_usage(client, engine):
    out = chat(client, max_tokens=5).json()
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hello world!"}
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["logprobs"] is None
    prompt = len(CharTokenizer().encode("<user>hi"))
    assert out["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 5,
        "total_tokens": prompt + 5,
    }
    assert engine.added[0][1] == CharTokenizer().encode("<user>hi")


def test_stop_string_is_applied_behind_the_interface(client, engine):
    out = chat(client, max_tokens=5, stop=["o w"]).json()["choices"][0]
    assert out["message"]["content"] == "Hell" and out["finish_reason"] == "stop"
    assert engine.aborted == [engine.added[0][0]]  # the processor told the engine to stop it


def test_stream_chunks_n_and_usage(client, engine):
    r = chat(client, max_tokens=4, n=2, seed=7, stream=True, stream_options={"include_usage": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r)
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] == 8
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    for index in (0, 1):
        parts = [c["choices"][0] for c in chunks[2:-2] if c["choices"][0]["index"] == index]
        assert "".join(p["delta"]["content"] for p in parts) == "Hello world"
        assert parts[-1]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert [p.seed for _, _, p in engine.added] == [7, 8]


def test_completions_logprobs(client):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 1}
    out = client.post("/v1/completions", json=body).json()["choices"][0]
    assert out["text"] == "Hello wor"
    assert out["logprobs"]["tokens"] == ["Hel", "lo", " wor"]
    assert out["logprobs"]["text_offset"] == [0, 3, 5]
    assert out["logprobs"]["top_logprobs"][0] == {"Hel": -0.5, "!": -2.0}
    lp = chat(client, max_tokens=2, logprobs=True, top_logprobs=2).json()["choices"][0]
    first = lp["logprobs"]["content"][0]
    assert first["token"] == "Hel" and first["bytes"] == list(b"Hel")
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.5, -2.0]


@pytest.mark.parametrize(
    "refusal, status, kind",
    [
        (
            InvalidRequest("prompt + max_tokens exceeds the context limit of 64"),
            400,
            "invalid_request_error",
        ),
        (EngineFull("8 requests are already waiting"), 503, "server_overloaded"),
        (EngineError("the engine stopped"), 503, "server_error"),
    ],
)
def test_refusals_become_error_bodies(client, engine, refusal, status, kind):
    engine.refusal = refusal
    r = chat(client)
    assert r.status_code == status and r.json()["error"]["type"] == kind
    assert r.json()["error"]["message"] == str(refusal)
    assert (r.headers.get("retry-after") == "1") == isinstance(refusal, EngineFull)


def test_engine_failure_mid_request(client, engine):
    engine.fail_after = 2
    r = chat(client, max_tokens=5)
    assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
    chunks = events(chat(client, max_tokens=5, stream=True))
    assert chunks[-1] == "[DONE]" and "device lost" in chunks[-2]["error"]["message"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-2]) == "Hello"


def test_unknown_model_health_and_metrics(client, engine):
    r = chat(client, model="gpt-9")
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    assert client.get("/health").json() == {"status": "ok"}
    assert "sparrow_kv_cache_usage 0.25" in client.get("/metrics").text
    engine.alive = False
    assert client.get("/health").status_code == 503


def test_prompt_logprobs_in_vllm_shape(client, engine):
    """Completions: in each choice; chat: beside the choices. Only the first of the n choices
    asks the engine for them."""
    body = {"model": MODEL, "prompt": [3, 1, 2], "max_tokens": 2, "n": 2, "prompt_logprobs": 1}
    out = client.post("/v1/completions", json=body).json()
    assert [c["prompt_logprobs"] for c in out["choices"]] == [
        [
            None,
            {"1": {"logprob": -1.0, "rank": 1, "decoded_token": "Hel"}},
            {
                "2": {"logprob": -2.0, "rank": 2, "decoded_token": "lo"},
                "1": {"logprob": -1.0, "rank": 1, "decoded_token": "Hel"},
            },
        ]
    ] * 2
    assert [p.prompt_logprobs for _, _, p in engine.added] == [1, None]
    out = chat(client, max_tokens=1, prompt_logprobs=0).json()
    prompt = CharTokenizer().encode("<user>hi")
    assert len(out["prompt_logprobs"]) == len(prompt) and out["prompt_logprobs"][0] is None
    assert out["prompt_logprobs"][1] == {
        str(prompt[1]): {"logprob": -prompt[1], "rank": prompt[1], "decoded_token": f"#{prompt[1]}"}
    }
    assert "prompt_logprobs" not in out["choices"][0]
    plain = client.post("/v1/completions", json=body | {"prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs: Input should be less than or equal to 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs: Input should be greater than or equal to 0"),
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs is not available with stream"),
    ],
)
def test_prompt_logprobs_refusals(client, body, message):
    for r in (
        chat(client, **body),
        client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"} | body),
    ):
        assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_special_tokens_are_skipped_unless_kept(client, engine):
    """With token 5 ("!") special: left out of the text unless skip_special_tokens is false,
    streamed or not."""
    engine.processor.special_ids = frozenset({5})
    assert chat(client).json()["choices"][0]["message"]["content"] == "Hello world"
    kept = chat(client, skip_special_tokens=False).json()["choices"][0]["message"]["content"]
    assert kept == "Hello world!"
    body = {"model": MODEL, "prompt": "hi", "stream": True, "skip_special_tokens": False}
    chunks = events(client.post("/v1/completions", json=body))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello world!"
    assert [p.skip_special_tokens for _, _, p in engine.added] == [True, False, False]


def test_token_ids_come_back_when_asked_for(client):
    """vLLM's `return_token_ids`: the generated ids per choice, and per chunk when streamed."""
    body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 4, "return_token_ids": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["token_ids"] == [1, 2, 3, 4] and whole["text"] == "Hello world"
    chunks = events(client.post("/v1/completions", json=body | {"stream": True}))
    streamed = [i for c in chunks[:-1] for ch in c["choices"] for i in ch["token_ids"]]
    assert streamed == [1, 2, 3, 4]
    plain = client.post("/v1/completions", json=body | {"return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]


def test_sampling_controls_reach_the_engine(client, engine):
    reply = chat(
        client,
        min_p=0.1,
        min_tokens=2,
        logit_bias={"3": 5, "4": -100},
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
    )
    assert reply.status_code == 200, reply.text
    params = engine.added[-1][2]
    assert (params.min_p, params.min_tokens) == (0.1, 2)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert params.repetition_penalty == 1.2
    chat(client, stop_token_ids=[7, 9])
    assert engine.added[-1][2].stop_token_ids == (7, 9)  # the scripted model has no end ids
    assert params.logit_bias == ((3, 5.0), (4, -100.0))
    for bad in (
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"3": 500}},
        {"min_p": 2},
        {"presence_penalty": 3},
        {"repetition_penalty": 0},
    ):
        reply = chat(client, **bad)
        assert reply.status_code == 400 and "error" in reply.json(), bad
