"""The OpenAI app over `RemoteEngine` (a worker on loopback) answers as it does over the
in-process engine: chat and completions, whole and streamed, n > 1, stop strings, media,
and the same HTTP status for each kind of engine refusal."""

import base64
import dataclasses
import io
import json
import time

import pytest
from PIL import Image

from sparrow.engine.client import (
    EngineClient,
    EngineError,
    EngineFull,
    EngineHealth,
    EngineInfo,
    EngineStats,
    InvalidRequest,
)
from sparrow.engine.output_processor import OutputDelta
from sparrow.multimodal import QWEN3_5_MOE, MediaLimits
from sparrow.multimodal.pipeline import MediaPipeline
from sparrow.multimodal.video import QWEN3_5_MOE_VIDEO
from sparrow.rpc.client import RemoteEngine
from tests.rpc.conftest import WorkerThread, settled

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from sparrow.server.app import build_app  # noqa: E402


def pipeline() -> MediaPipeline:
    return MediaPipeline(QWEN3_5_MOE, QWEN3_5_MOE_VIDEO, MediaLimits())


def app_over(engine, tokenizer, media=None):
    return build_app(engine, tokenizer, "m", max_body_bytes=8 << 20, media=media or pipeline())


@pytest.fixture(scope="module")
def clients(worker):
    """(remote, local): TestClients of the app over RemoteEngine and over the worker's own
    AsyncEngine (no lifespan: the engine outlives it)."""
    thread, llm = worker
    engine = RemoteEngine(thread.target, llm.tokenizer.decode, poll_s=0.05)
    with TestClient(app_over(engine, llm.tokenizer)) as remote:
        yield remote, TestClient(app_over(thread.engine, llm.tokenizer))


def complete(client, **fields):
    body = {
        "model": "m",
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }
    return client.post("/v1/completions", json=body)


def events(reply) -> list[dict]:
    lines = [x.removeprefix("data: ") for x in reply.text.splitlines() if x.startswith("data")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_completions_equal_the_in_process_engine(clients):
    remote, local = clients
    got, want = complete(remote), complete(local)
    assert got.status_code == 200, got.text
    a, b = got.json()["choices"][0], want.json()["choices"][0]
    assert a["text"] == b["text"] and a["token_ids"] == b["token_ids"]
    assert got.json()["usage"] == want.json()["usage"]
    streamed = events(complete(remote, stream=True))
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == a["text"]


def test_n_choices_and_chat(clients):
    remote, _ = clients
    reply = complete(remote, n=3, temperature=1.0, seed=5)
    assert sorted(c["index"] for c in reply.json()["choices"]) == [0, 1, 2]
    assert reply.json()["usage"]["completion_tokens"] == 24
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    chat = remote.post("/v1/chat/completions", json=body)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    streamed = events(remote.post("/v1/chat/completions", json={**body, "stream": True}))
    assert streamed[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_strings(clients, worker):
    remote, local = clients
    text = complete(remote, max_tokens=12).json()["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    got = complete(remote, max_tokens=12, stop=[stop]).json()["choices"][0]
    want = complete(local, max_tokens=12, stop=[stop]).json()["choices"][0]
    assert got["finish_reason"] == "stop" and got["text"] == want["text"]
    assert stop not in got["text"] and text.startswith(got["text"])
    assert settled(worker[0].engine)


def png(width: int, height: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


def chat_image(client):
    image = {"type": "image_url", "image_url": {"url": png(40, 30)}}
    body = {
        "model": "m",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}],
    }
    return client.post("/v1/chat/completions", json=body)


def test_media_reach_the_tower_intact(clients, worker):
    remote, local = clients
    tower = worker[1].model.visual
    want = chat_image(local)
    local_patches, local_grid = tower.seen[-1]
    got = chat_image(remote)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    patches, grid = tower.seen[-1]
    assert grid == local_grid == [[1, 14, 20]] and patches.equal(local_patches)


class Truncating(MediaPipeline):
    """Drops each item's last patch row: a tensor that does not fit its grid."""

    def expand(self, ids, prepared, video_id):
        ids, media = super().expand(ids, prepared, video_id)
        return ids, [dataclasses.replace(m, pixel_values=m.pixel_values[:-1]) for m in media]


def test_a_bad_tensor_is_a_400(worker):
    thread, llm = worker
    engine = RemoteEngine(thread.target, llm.tokenizer.decode)
    bad = Truncating(QWEN3_5_MOE, QWEN3_5_MOE_VIDEO, MediaLimits())
    with TestClient(app_over(engine, llm.tokenizer, bad)) as client:
        reply = chat_image(client)
    assert reply.status_code == 400 and "does not match" in reply.json()["error"]["message"]


class Refusing(EngineClient):
    """Refuses every request with `error`, or with `fail` set takes it and fails its stream
    after one token."""

    def __init__(self):
        self.error: Exception = InvalidRequest("no")
        self.fail = False

    info = EngineInfo(max_model_len=64, vocab_size=1000, default_stop_token_ids=(2,))

    async def add(self, request_id, prompt_token_ids, params, media=()):
        if not self.fail:
            raise self.error
        return self._failing(request_id)

    async def _failing(self, request_id):
        yield OutputDelta(request_id, [7], "x")
        raise EngineError("the request failed in the engine: device lost")

    def abort(self, request_id):
        pass

    def stats(self):
        return EngineStats(0, 0, 0.0)

    def health(self):
        return EngineHealth(alive=True, accepting=True)

    async def shutdown(self):
        pass


class CharTokenizer:
    def encode(self, text):
        return [ord(c) % 100 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_refusals_and_failures_get_the_in_process_status():
    """Each refusal, and a request failing mid-stream, answer as in process; a worker that
    stops makes the app's /health a 503."""
    refusing = Refusing()
    thread = WorkerThread(refusing)
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    remote = RemoteEngine(thread.target, CharTokenizer().decode, poll_s=0.05)
    with TestClient(build_app(remote, CharTokenizer(), "m")) as client:
        local = TestClient(build_app(refusing, CharTokenizer(), "m"))
        for error in (
            InvalidRequest("too long"),
            EngineFull("queue full"),
            EngineError("the engine stopped"),
            None,
        ):
            refusing.error, refusing.fail = error, error is None
            got = client.post("/v1/completions", json=body)
            want = local.post("/v1/completions", json=body)
            assert got.status_code == want.status_code, (error, got.text)
            assert got.json()["error"]["type"] == want.json()["error"]["type"]
        assert client.get("/health").status_code == 200
        thread.stop()
        deadline = time.monotonic() + 10
        while remote.health().alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.get("/health").status_code == 503


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"choice": ["Paris", "Lyon"]}, "ignore_eos": False},
        {"response_format": {"type": "json_object"}, "ignore_eos": False, "max_tokens": 24},
        {"min_p": 0.2, "temperature": 1.0, "seed": 3, "min_tokens": 4},
        {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
        {"logit_bias": {"11": 100}},
    ],
)
def test_sampling_controls_cross_the_worker_protocol(clients, fields):
    """Structured output, min_p / min_tokens, penalties and logit_bias reach the worker: the
    same tokens as the in-process engine."""
    remote, local = clients
    got, want = complete(remote, **fields), complete(local, **fields)
    assert got.status_code == want.status_code == 200, (got.text, want.text)
    assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    "fields",
    [
        lambda vocab: {"stop_token_ids": [vocab]},
        lambda vocab: {"stop_token_ids": [10**12]},  # past the wire's uint32
        lambda vocab: {"logit_bias": {str(10**12): 1}},
        lambda vocab: {"prompt": [1, 10**12]},
    ],
    ids=["stop-vocab", "stop-1e12", "bias-1e12", "prompt-1e12"],
)
def test_token_ids_outside_the_vocabulary_are_400_as_in_process(clients, worker, fields):
    """Refused with the in-process engine's message, before the ids meet the proto's fields."""
    remote, local = clients
    fields = fields(worker[1].model.config.vocab_size)
    got, want = complete(remote, **fields), complete(local, **fields)
    assert got.status_code == want.status_code == 400, (got.text, want.text)
    assert got.json()["error"]["message"] == want.json()["error"]["message"]
