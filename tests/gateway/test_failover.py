"""Streams outlive their workers: `sparrow gateway` over three `sparrow worker` processes
on the built-in model, each stream of 8 greedy and 8 seeded ones (logprobs, a stop string, a
penalty and a JSON schema among them) faulted at a random point: its worker SIGKILLed or
SIGSTOPped (ejected by its health polls). Every stream completes and carries the tokens,
text and logprobs of the same request run undisturbed."""

import json
import random
import signal

import httpx
import pytest

from tests.gateway.test_gateway_processes import Cluster, _worker

pytest.importorskip("openai")

# long enough that generation is still running when a reader behind it strikes early on
MAX_TOKENS = 256


def _bodies() -> list[tuple[str, dict]]:
    """(endpoint, body): 8 greedy, then 8 seeded."""
    prompts = ["Once upon a time", "def main():", "import os\n", "The quick brown fox"]
    out = []
    for sampled in (False, True):
        for i in range(8):
            body = {
                "model": "default",
                "max_tokens": MAX_TOKENS,
                "stream": True,
                "ignore_eos": True,
                "logprobs": 2,
                "return_token_ids": True,
                "temperature": 0.9 if sampled else 0.0,
            } | ({"seed": 100 + i, "top_p": 0.95} if sampled else {})
            if i == 1:
                body["frequency_penalty"] = 0.7
            if i == 2:
                body["stop"] = ["\n\n"]
            if i == 3:  # a grammar: the chat endpoint with a JSON schema
                schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
                body |= {
                    "messages": [{"role": "user", "content": "A number as JSON"}],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "n", "schema": schema},
                    },
                    "logprobs": True,
                    "top_logprobs": 2,
                    "ignore_eos": False,
                }
                out.append(("/v1/chat/completions", body))
                continue
            out.append(("/v1/completions", body | {"prompt": prompts[i % len(prompts)]}))
    return out


def _events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])
        elif line == "data: [DONE]":
            yield "[DONE]"


def _summary(events: list) -> dict:
    """The stream's tokens, text, logprobs, finish reason and whether it ended cleanly."""
    tokens, text, logprobs, finish = [], "", [], None
    for e in events:
        if e == "[DONE]":
            continue
        assert "error" not in e, e
        for c in e["choices"]:
            delta = c.get("delta", c)
            text += delta.get("content") or c.get("text") or ""
            tokens += delta.get("token_ids") or c.get("token_ids") or []
            lp = c.get("logprobs") or {}
            logprobs += [x["logprob"] for x in lp.get("content") or []]
            logprobs += lp.get("token_logprobs") or []
            finish = c.get("finish_reason") or finish
    return {
        "tokens": tokens,
        "text": text,
        "logprobs": logprobs,
        "finish": finish,
        "done": events[-1:] == ["[DONE]"],
    }


def _stream(cluster: Cluster, endpoint: str, body: dict, fault=None) -> dict:
    """Run one stream; `fault(events_so_far)` is called after each event until it returns
    True (it has struck)."""
    events = []
    with httpx.stream("POST", cluster.url + endpoint, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for e in _events(r):
            events.append(e)
            if fault is not None and fault(events):
                fault = None
    return _summary(events)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(workers=3)
    yield c
    c.stop()


def _healthy(cluster: Cluster) -> bool:
    return all(
        cluster.worker_metric("sparrow_gateway_worker_healthy", p) == 1 for p in cluster.ports
    )


def test_streams_survive_their_worker_killed_or_frozen(cluster):
    bodies = _bodies()
    reference = [_stream(cluster, endpoint, body) for endpoint, body in bodies]
    assert all(ref["done"] and ref["tokens"] for ref in reference)
    rng = random.Random(0)
    faults = 0
    for i, ((endpoint, body), ref) in enumerate(zip(bodies, reference, strict=True)):
        Cluster._wait(lambda: _healthy(cluster), 180)
        at = rng.randint(1, max(1, len(ref["tokens"]) // 8))
        frozen = i % 2 == 1
        struck = []

        def fault(events, at=at, frozen=frozen, struck=struck):
            if len(events) < at:
                return False
            busy = [
                p
                for p in cluster.ports
                if cluster.worker_metric("sparrow_gateway_worker_load", p) > 0
            ]
            if not busy:
                return False
            victim = cluster.ports.index(busy[0])
            proc = cluster.workers[victim]
            proc.send_signal(signal.SIGSTOP if frozen else signal.SIGKILL)
            struck.append(victim)
            return True

        got = _stream(cluster, endpoint, body, fault)
        faults += len(struck)
        for victim in struck:  # bring the worker back for the next stream
            proc = cluster.workers[victim]
            if frozen:
                proc.send_signal(signal.SIGCONT)
            else:
                proc.wait(30)
                cluster.workers[victim] = _worker(cluster.ports[victim])
        assert got["done"] and got["finish"] == ref["finish"], (i, got, ref)
        assert got["tokens"] == ref["tokens"] and got["text"] == ref["text"], i
        assert got["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-4), i
    resumed = sum(
        cluster.worker_metric("sparrow_gateway_worker_resumed_total", p) for p in cluster.ports
    )
    assert faults >= 12 and resumed >= faults // 2  # most faults strike a running stream
