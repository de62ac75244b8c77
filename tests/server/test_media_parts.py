"""Images and videos in chat completions (`image_url` / `video_url` parts, data URLs), through
TestClient and through the official openai client on a socket, over the real engine on the
tiny Qwen model with a stand-in tower: the prompt grows by each item's placeholder tokens,
the tower sees the preprocessed patches, usage and metrics count them; bad media, unknown
parts and text-only models get a 400 with an OpenAI-style error body. Also /tokenize and
/detokenize on the same app."""

import asyncio
import base64
import io

import pytest
import torch
from PIL import Image

from sparrow.engine.async_engine import AsyncEngine
from sparrow.engine.llm import LLM
from sparrow.loader.random_checkpoint import PRESETS, random_model
from sparrow.multimodal import QWEN3_5_MOE, MediaLimits
from sparrow.multimodal.pipeline import MediaPipeline
from sparrow.multimodal.video import QWEN3_5_MOE_VIDEO
from sparrow.tokenizer import load_tokenizer

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from sparrow.server.app import build_app  # noqa: E402

CFG = PRESETS["qwen3.6-tiny"]


class Tower(torch.nn.Module):
    """Patches [N, D] -> [N / 4, hidden]: the mean of each 2 x 2 group, tiled; records grids."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.grids = []

    def forward(self, patches, grid):
        self.grids.append(grid.tolist())
        means = patches.reshape(-1, 4 * patches.shape[1]).mean(-1, keepdim=True)
        return means.expand(-1, CFG.hidden_size) * 0.01


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="PNG")
    return out.getvalue()


def media_app():
    """(app, engine, tower): the tiny Qwen model seeing through `Tower`."""
    model = random_model(CFG, 0, "cpu", torch.float32)
    model.visual = Tower()
    llm = LLM(model, max_model_len=2048, block_size=16, num_blocks=160)
    llm.tokenizer = load_tokenizer(None)  # the packaged Qwen vocabulary and template
    engine = AsyncEngine(llm, max_waiting=8)
    pipeline = MediaPipeline(QWEN3_5_MOE, QWEN3_5_MOE_VIDEO, MediaLimits())
    app = build_app(engine, llm.tokenizer, "m", max_body_bytes=8 << 20, media=pipeline)
    return app, engine, model.visual


@pytest.fixture(scope="module")
def served():
    app, engine, tower = media_app()
    with TestClient(app) as client:
        yield client, tower
    asyncio.run(engine.shutdown(timeout=30))


def chat(client, parts):
    body = {
        "model": "m",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [{"role": "user", "content": parts}],
    }
    return client.post("/v1/chat/completions", json=body)


def test_image_and_video_parts(served):
    client, tower = served
    text = chat(client, [{"type": "text", "text": "describe"}]).json()["usage"]["prompt_tokens"]
    image = {"type": "image_url", "image_url": {"url": data_url(png(40, 30), "image/png")}}
    reply = chat(client, [{"type": "text", "text": "describe"}, image])
    assert reply.status_code == 200, reply.text
    # 40x30 scales up to 320x224 (the 65,536-pixel floor): 20 x 14 patches, 70 tokens in
    # place of the template's image pad, between its vision start and end
    assert reply.json()["usage"]["prompt_tokens"] == text + 2 + 70
    assert tower.grids[-1] == [[1, 14, 20]]
    av = pytest.importorskip("av")
    from tests.multimodal.test_video_preprocessing import encode

    del av
    video = {"type": "video_url", "video_url": {"url": data_url(encode(9, 48, 64), "video/mp4")}}
    reply = chat(client, [video, {"type": "text", "text": "and this?"}])
    assert reply.status_code == 200, reply.text
    assert tower.grids[-1][0][0] == 2  # 4 sampled frames: 2 temporal groups
    metrics = client.get("/metrics").text
    assert "sparrow_media_items_total 2.0" in metrics


@pytest.mark.parametrize(
    "part, message",
    [
        (
            {"type": "image_url", "image_url": {"url": data_url(b"not an image", "image/png")}},
            "cannot",
        ),
        (
            {"type": "video_url", "video_url": {"url": data_url(b"\x00" * 100, "video/mp4")}},
            "cannot decode video",
        ),
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "local"),
        ({"type": "image_url", "image_url": {}}, "needs"),
        ({"type": "input_audio", "input_audio": {}}, "not supported"),
    ],
)
def test_bad_media_parts_are_400s(served, part, message):
    reply = chat(served[0], [part])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_text_only_models_refuse_media():
    llm = LLM(
        random_model(CFG, 0, "cpu", torch.float32), max_model_len=256, block_size=16, num_blocks=32
    )
    llm.tokenizer = load_tokenizer(None)
    engine = AsyncEngine(llm, max_waiting=8)
    with TestClient(build_app(engine, llm.tokenizer, "m")) as client:
        image = {"type": "image_url", "image_url": {"url": data_url(png(8, 8), "image/png")}}
        reply = chat(client, [image])
    asyncio.run(engine.shutdown(timeout=30))
    assert reply.status_code == 400 and "text only" in reply.json()["error"]["message"]


def test_through_the_openai_client():
    """The official client against the app on a real socket: an image (whole and streamed)
    and a video part."""
    openai = pytest.importorskip("openai")
    import socket
    import threading

    import uvicorn

    app, _, tower = media_app()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        image = {"type": "image_url", "image_url": {"url": data_url(png(64, 48), "image/png")}}
        messages = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=3)
        assert reply.usage.completion_tokens == 3 and reply.usage.prompt_tokens > 64
        stream = client.chat.completions.create(
            model="m", messages=messages, max_tokens=3, stream=True
        )
        assert sum(bool(c.choices and c.choices[0].delta.content is not None) for c in stream)
        pytest.importorskip("av")
        from tests.multimodal.test_video_preprocessing import encode

        clip = data_url(encode(6, 32, 48), "video/mp4")
        video = {"type": "video_url", "video_url": {"url": clip}}
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": [video]}], max_tokens=2
        )
        assert reply.usage.completion_tokens == 2 and tower.grids[-1][0][0] == 2
        with pytest.raises(openai.BadRequestError):
            bad = {"type": "image_url", "image_url": {"url": data_url(b"nope", "image/png")}}
            client.chat.completions.create(
                model="m", max_tokens=2, messages=[{"role": "user", "content": [bad]}]
            )
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_tokenize_and_detokenize(served):
    client = served[0]
    out = client.post("/tokenize", json={"model": "m", "prompt": "hello world"}).json()
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 2048
    text = client.post("/detokenize", json={"model": "m", "tokens": out["tokens"]}).json()
    assert text == {"prompt": "hello world"}
    chat = client.post(
        "/tokenize", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["count"] > 3
    for path, body, status in (
        ("/tokenize", {"model": "m"}, 400),
        ("/tokenize", {"model": "x", "prompt": "a"}, 404),
        ("/detokenize", {"model": "m", "tokens": [10**9]}, 400),
        ("/detokenize", {"model": "m", "tokens": [-1]}, 400),
    ):
        reply = client.post(path, json=body)
        assert reply.status_code == status and "error" in reply.json(), (path, body)
