"""`sparrow gateway` over two `sparrow worker` processes on the built-in model, on loopback,
through the official openai client: chat whole and streamed, n > 1, stop; per-worker state
on /metrics; bad requests leave the breakers closed; a client that goes away frees its
request on the worker; a worker killed mid-stream hands its stream on to the other (the
client sees no break), new requests go to the other, and the worker once restarted is
admitted again."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from sparrow.net import free_port

openai = pytest.importorskip("openai")


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sparrow.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ | {"TRITON_INTERPRET": "0"},
    )


def _worker(port: int) -> subprocess.Popen:
    return _start(
        "worker",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--num-blocks",
        "128",
        "--max-num-seqs",
        "8",
    )


class Cluster:
    def __init__(self, workers: int = 2):
        self.ports = [free_port() for _ in range(workers)]
        self.workers = [_worker(p) for p in self.ports]
        self.port = free_port()
        self.gateway = _start(
            "gateway",
            "--port",
            str(self.port),
            "--policy",
            "round_robin",
            *[a for p in self.ports for a in ("--worker", f"127.0.0.1:{p}")],
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait(lambda: httpx.get(f"{self.url}/health").status_code == 200, 180)
        self._wait(
            lambda: all(
                self.worker_metric("sparrow_gateway_worker_healthy", p) == 1 for p in self.ports
            ),
            180,
        )
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    @staticmethod
    def _wait(ready, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not ready within {timeout} s")

    def worker_metric(self, name: str, port: int) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        found = re.search(rf'{name}{{worker="127.0.0.1:{port}"}} ([0-9.e+-]+)', text)
        assert found is not None, f"no {name} for worker {port} in /metrics: {text[-2000:]}"
        return float(found.group(1))

    def stop(self) -> None:
        for proc in (self.gateway, *self.workers):
            proc.send_signal(signal.SIGTERM)
        for proc in (self.gateway, *self.workers):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.stop()


def _chat(cluster, **fields):
    return cluster.client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hello there"}],
        **{"temperature": 0} | fields,
    )


def test_chat_whole_streamed_and_n(cluster):
    whole = _chat(cluster, max_tokens=6, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    stream = _chat(cluster, max_tokens=6, stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same on either worker
    two = _chat(cluster, max_tokens=4, n=2, extra_body={"ignore_eos": True})
    assert len(two.choices) == 2
    stop = whole.choices[0].message.content[2:5]
    stopped = _chat(cluster, max_tokens=6, stop=[stop], extra_body={"ignore_eos": True})
    assert stop not in stopped.choices[0].message.content


def test_bad_requests_leave_the_breakers_closed(cluster):
    for _ in range(20):
        with pytest.raises(openai.BadRequestError):
            _chat(cluster, max_tokens=100_000)
        with pytest.raises(openai.BadRequestError):
            _chat(cluster, max_tokens=4, temperature=-3)
    for port in cluster.ports:
        assert cluster.worker_metric("sparrow_gateway_worker_breaker_state", port) == 0
        assert cluster.worker_metric("sparrow_gateway_worker_healthy", port) == 1


def _busy(cluster) -> list[int]:
    return [p for p in cluster.ports if cluster.worker_metric("sparrow_gateway_worker_load", p) > 0]


def test_client_going_away_frees_the_request_on_the_worker(cluster):
    body = {
        "model": "default",
        "prompt": "Once upon a time",
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the response
        next(lines)
        Cluster._wait(lambda: len(_busy(cluster)) == 1, 5)
    Cluster._wait(lambda: not _busy(cluster), 15)


def test_worker_killed_mid_stream_then_restarted(cluster):
    body = {
        "model": "default",
        "prompt": "Once upon a time",
        "max_tokens": 600,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        Cluster._wait(lambda: len(_busy(cluster)) == 1, 5)
        (port,) = _busy(cluster)
        victim = cluster.ports.index(port)
        cluster.workers[victim].kill()
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    errors = [event for event in events if "error" in event]
    assert not errors, errors  # it went on at the other worker
    for _ in range(4):  # new requests go to the other worker
        assert _chat(cluster, max_tokens=3).choices[0].finish_reason in ("length", "stop")
    Cluster._wait(lambda: cluster.worker_metric("sparrow_gateway_worker_healthy", port) == 0, 10)
    cluster.workers[victim] = _worker(port)
    Cluster._wait(lambda: cluster.worker_metric("sparrow_gateway_worker_healthy", port) == 1, 180)
    for _ in range(4):
        assert _chat(cluster, max_tokens=3).choices[0].finish_reason in ("length", "stop")
