"""The app under a real uvicorn (in process, on a thread) over scripted engines: the event
loop keeps serving while a 1 MB prompt is tokenised, and a body that trickles in is cut off
with a 408."""

import contextlib
import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from test_app import MODEL, CharTokenizer  # noqa: E402
from test_limits import EndlessEngine  # noqa: E402

from sparrow.engine.client import EngineInfo  # noqa: E402
from sparrow.net import free_port  # noqa: E402
from sparrow.server.app import TEXT_THREADS, build_app  # noqa: E402


@contextlib.contextmanager
def live(app):
    """`app` served by uvicorn on a thread; yields (host, port)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(30)


class LongContext(EndlessEngine):
    @property
    def info(self) -> EngineInfo:  # a 1 MB prompt is under its byte limit
        return EngineInfo(max_model_len=1 << 16, vocab_size=50, default_stop_token_ids=())


class GatedTokenizer(CharTokenizer):
    """Long texts: `entered` is set, then encoding waits for `release`, so a tokenisation
    is in flight for as long as the test likes."""

    def __init__(self):
        self.entered, self.release, self.threads = threading.Event(), threading.Event(), []

    def encode(self, text: str) -> list[int]:
        if len(text) > 1000:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.release.wait(60)
        return super().encode(text)


class Stream:
    """A streamed completion read on a thread; `wait_for(n)`: n chunks have arrived."""

    def __init__(self, base: str):
        self.chunks, self.done, self.ready = 0, threading.Event(), threading.Condition()
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 10, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self.thread.start()

    def _read(self, base: str, body: dict) -> None:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    with self.ready:
                        self.chunks += 1
                        self.ready.notify_all()
                if self.done.is_set():
                    return

    def wait_for(self, n: int, timeout: float = 10) -> bool:
        with self.ready:
            return self.ready.wait_for(lambda: self.chunks >= n, timeout)


def test_the_event_loop_serves_while_a_1mb_prompt_is_tokenised():
    """While the tokenisation of a 1 MB /tokenize is held in flight, /health answers and a
    running stream keeps getting chunks (on the event loop it would stall both until the
    tokeniser let go); it runs on the app's text threads."""
    tokenizer = GatedTokenizer()
    app = build_app(LongContext(), tokenizer, MODEL, max_body_bytes=2 << 20)
    with live(app) as (host, port):
        base, big = f"http://{host}:{port}", {}
        stream = Stream(base)
        assert stream.wait_for(3)

        def tokenize():
            prompt = {"model": MODEL, "prompt": "x" * 1_000_000}
            big["r"] = httpx.post(f"{base}/tokenize", json=prompt, timeout=60)

        sender = threading.Thread(target=tokenize, daemon=True)
        sender.start()
        try:
            assert tokenizer.entered.wait(30)
            seen = stream.chunks
            assert httpx.get(f"{base}/health", timeout=10).status_code == 200
            assert stream.wait_for(seen + 5)
            assert sender.is_alive() and not tokenizer.release.is_set()
        finally:
            tokenizer.release.set()
            stream.done.set()
        sender.join(30)
        assert big["r"].status_code == 200 and big["r"].json()["count"] == 1_000_000
    assert tokenizer.threads == ["sparrow-text_0"] and 1 <= TEXT_THREADS <= 4


def test_a_body_that_trickles_in_is_cut_off_with_408():
    """1 byte per 0.2 s against a 0.5 s body deadline: a 408 with OpenAI's error body and
    the connection closed, well before the body would have arrived (about 10 s). Streams
    outlast the deadline: it holds only while the body arrives."""
    app = build_app(EndlessEngine(), CharTokenizer(), MODEL, body_timeout_s=0.5)
    with live(app) as (host, port):
        stream = Stream(f"http://{host}:{port}")
        assert stream.wait_for(1)
        start = time.monotonic()
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        reply = b""
        with socket.create_connection((host, port)) as sock:
            sock.sendall(head.encode())
            sock.settimeout(0.2)  # the pace of the bytes sent
            for i in range(len(body)):
                try:
                    sock.sendall(body[i : i + 1])
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:  # reset: the server closed the connection
                    break
                reply += data
                if not data:
                    break
            sock.settimeout(10)
            with contextlib.suppress(OSError):
                while data := sock.recv(65536):
                    reply += data
        elapsed = time.monotonic() - start
        assert stream.wait_for(stream.chunks + 3) and stream.thread.is_alive()
        stream.done.set()
    status, _, rest = reply.partition(b"\r\n")
    headers, _, payload = rest.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408"), reply
    assert b"connection: close" in headers.lower()
    error = json.loads(payload)["error"]
    assert error["code"] == 408 and "within 0.5 s" in error["message"]
    assert elapsed < 5
