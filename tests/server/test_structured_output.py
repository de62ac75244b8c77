"""Structured output through the OpenAI app over the built-in random-weight model:
response_format and vLLM's structured_outputs, streamed and not; bad grammars are 400s."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from sparrow.engine.async_engine import AsyncEngine  # noqa: E402
from sparrow.engine.llm import LLM  # noqa: E402
from sparrow.server.app import build_app  # noqa: E402

MODEL = "default"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "count", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "item", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def client():
    llm = LLM(model=None)
    with TestClient(build_app(AsyncEngine(llm), llm.tokenizer, MODEL)) as client:
        yield client


def chat(client, **fields):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe an item"}],
        "max_tokens": 60,
        "temperature": 0,
        **fields,
    }
    return client.post("/v1/chat/completions", json=body)


def fits(value: dict) -> bool:
    return (
        set(value) == {"name", "count", "tags"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 6
        and 0 <= value["count"] <= 99
        and all(t in ("x", "y") for t in value["tags"])
        and len(value["tags"]) <= 2
    )


def test_chat_json_schema(client):
    reply = chat(client, response_format=JSON_SCHEMA_FORMAT, n=2)
    assert reply.status_code == 200, reply.text
    for choice in reply.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        assert fits(json.loads(choice["message"]["content"]))


def test_chat_json_schema_streamed(client):
    reply = chat(client, response_format=JSON_SCHEMA_FORMAT, stream=True)
    assert reply.status_code == 200, reply.text
    lines = [x.removeprefix("data: ") for x in reply.text.splitlines() if x.startswith("data")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert fits(json.loads(text))
    assert (
        text
        == chat(client, response_format=JSON_SCHEMA_FORMAT).json()["choices"][0]["message"][
            "content"
        ]
    )


def test_completions_structured_outputs(client):
    def complete(**fields):
        body = {
            "model": MODEL,
            "prompt": "The answer is",
            "max_tokens": 20,
            "temperature": 0,
            **fields,
        }
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    assert complete(structured_outputs={"choice": ["alpha", "beta"]}) in ("alpha", "beta")
    pattern = r"\d{3}-[A-Z]{2}"
    assert re.fullmatch(pattern, complete(structured_outputs={"regex": pattern}))
    assert fits(json.loads(complete(structured_outputs={"json": SCHEMA}, max_tokens=60)))


def test_json_object(client):
    close = [
        str(i)
        for i in client.post("/tokenize", json={"model": MODEL, "prompt": "{}"}).json()["tokens"]
    ]
    reply = chat(
        client, response_format={"type": "json_object"}, logit_bias=dict.fromkeys(close, 50)
    )
    assert reply.status_code == 200, reply.text
    assert isinstance(json.loads(reply.json()["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize(
    "fields, needle",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            'Unsupported type "foo"',
        ),
        ({"structured_outputs": {"regex": "(("}}, "parenthesis is not closed"),
        ({"structured_outputs": {"choice": []}}, "non-empty list"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "not both",
        ),
    ],
)
def test_bad_grammars_are_400s(client, fields, needle):
    reply = chat(client, **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert needle in reply.json()["error"]["message"]


def test_with_a_reasoning_parser_the_grammar_applies_after_the_think_block():
    """The built-in template leaves the model inside a think block: the think text is free
    (here closed at once: the end marker's logit is raised), the content follows the
    grammar."""
    from sparrow.server.reasoning import PARSERS

    llm = LLM(model=None)
    end = llm.tokenizer.token_id("</think>")
    app = build_app(AsyncEngine(llm), llm.tokenizer, MODEL, reasoning=PARSERS["qwen3"])
    with TestClient(app) as client:
        reply = chat(
            client, structured_outputs={"choice": ["yes", "no"]}, logit_bias={str(end): 40}
        )
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and not message.get("reasoning_content")
