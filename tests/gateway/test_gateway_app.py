"""The gateway's app in process over a worker on loopback (a stand-in vision tower): images
and videos preprocessed in a spawned process pool reach the tower; media URLs of private
addresses are refused; hashed API keys and per-key rate limits; the body limit; per-worker
metrics; the server's fuzzed bodies get no 5xx through the gateway."""

import asyncio
import base64
import hashlib
import io
import json

import pytest
from PIL import Image

from sparrow.engine.async_engine import AsyncEngine
from sparrow.gateway.metrics import RouterCollector
from sparrow.gateway.policies import make_policy
from sparrow.gateway.router import Router
from sparrow.multimodal import QWEN3_5_MOE, MediaLimits
from sparrow.multimodal.pipeline import MediaPipeline, media_pool
from sparrow.multimodal.video import QWEN3_5_MOE_VIDEO
from sparrow.rpc.client import RemoteEngine
from sparrow.server.app import build_app
from tests.rpc.conftest import WorkerThread, tiny_llm

pytest.importorskip("grpc")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.multimodal.test_video_preprocessing import encode  # noqa: E402
from tests.server.test_fuzz import chat_bodies  # noqa: E402

KEYS = ["plain-key", "sha256:" + hashlib.sha256(b"hashed-key").hexdigest()]


@pytest.fixture(scope="module")
def gateway():
    """(TestClient of the gateway app, the worker's stand-in tower, the router, the
    tokenizer)."""
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
    pool = media_pool(1)
    media = MediaPipeline(QWEN3_5_MOE, QWEN3_5_MOE_VIDEO, MediaLimits())
    app = build_app(
        router,
        llm.tokenizer,
        "m",
        KEYS,
        1 << 20,
        media=media,
        rate_limit=6000,
        media_executor=pool,
        collectors=[RouterCollector(router)],
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, llm.model.visual, router, llm.tokenizer
    pool.shutdown()
    worker.stop()
    asyncio.run(engine.shutdown(timeout=30))


def _png(width: int, height: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


def _chat(client, url: str | None = None, key: str = "plain-key"):
    content = [{"type": "text", "text": "What is this?"}]
    if url is not None:
        content.append({"type": "image_url", "image_url": {"url": url}})
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "temperature": 0,
    }
    return client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )


def test_images_are_preprocessed_in_the_pool_and_reach_the_tower(gateway):
    client, tower = gateway[:2]
    seen = len(tower.seen)
    r = _chat(client, _png(64, 48))
    assert r.status_code == 200, r.text
    assert len(tower.seen) == seen + 1
    metrics = client.get("/metrics").text
    assert "sparrow_media_bytes_total" in metrics and "sparrow_gateway_worker_healthy" in metrics


def test_videos_are_preprocessed_in_the_pool_and_reach_the_tower(gateway):
    client, tower = gateway[:2]
    seen = len(tower.seen)
    clip = "data:video/mp4;base64," + base64.b64encode(encode(9, 48, 64)).decode()
    body = {
        "model": "m",
        "max_tokens": 3,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": clip}},
                    {"type": "text", "text": "What happens?"},
                ],
            }
        ],
    }
    r = client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": "Bearer plain-key"}
    )
    assert r.status_code == 200, r.text
    assert len(tower.seen) == seen + 1 and tower.seen[-1][1][0][0] > 1  # frames in time


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/x.png",
        "http://10.2.3.4/x.png",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/x.png",
    ],
)
def test_private_media_urls_are_refused(gateway, url):
    r = _chat(gateway[0], url)
    assert r.status_code == 400 and "private" in r.json()["error"]["message"]


def test_keys_are_checked_against_their_digests(gateway):
    client = gateway[0]
    assert _chat(client, key="hashed-key").status_code == 200
    for key in ("wrong", "", "sha256:" + hashlib.sha256(b"hashed-key").hexdigest()):
        r = _chat(client, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client.get("/health").status_code == 200  # not a /v1/ route


def test_rate_limit_answers_429_with_retry_after(gateway):
    _, _, router, tokenizer = gateway
    app = build_app(router, tokenizer, "m", KEYS, rate_limit=3)  # its own buckets
    with TestClient(app) as client:
        codes = [
            client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            for key in ["plain-key"] * 5 + ["hashed-key"]
        ]
    assert [r.status_code for r in codes] == [200] * 3 + [429] * 2 + [200]
    assert int(codes[3].headers["retry-after"]) == 20  # one request every 20 s
    assert codes[3].json()["error"]["type"] == "rate_limit_error"


def test_oversize_body_is_413(gateway):
    client = gateway[0]
    r = client.post(
        "/v1/chat/completions",
        content=b"x" * (2 << 20),
        headers={"Authorization": "Bearer hashed-key", "content-type": "application/json"},
    )
    assert r.status_code == 413


@pytest.mark.parametrize(
    "fields, needle",
    [
        (lambda vocab: {"stop_token_ids": [10**12]}, "stop_token_ids must be in"),
        (lambda vocab: {"stop_token_ids": [vocab]}, "stop_token_ids must be in"),
        (lambda vocab: {"logit_bias": {str(10**12): 1}}, "logit_bias token ids must be in"),
    ],
    ids=["stop-1e12", "stop-vocab", "bias-1e12"],
)
def test_token_ids_outside_the_vocabulary_are_400(gateway, fields, needle):
    """Refused as in process, ids past the wire's uint32 fields included."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = gateway[0].post(
        "/v1/chat/completions",
        json=body | fields(gateway[2].info.vocab_size),
        headers={"Authorization": "Bearer plain-key"},
    )
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=chat_bodies)
def test_fuzzed_bodies_get_no_5xx(gateway, body):
    """The server's fuzz strategy through the gateway: every answer under 500."""
    raw = json.dumps(body, allow_nan=True, ensure_ascii=True)
    r = gateway[0].post(
        "/v1/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json", "Authorization": "Bearer plain-key"},
    )
    assert r.status_code < 500, r.text
