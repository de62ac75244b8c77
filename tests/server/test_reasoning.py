"""Reasoning apart from content: the splitter at every split of its input, and chat
completions with `--reasoning-parser` (whole and streamed; the prompt opening the block or
the output), `chat_template_kwargs` reaching the template."""

import json

import pytest

from sparrow.server.reasoning import PARSERS, ReasoningSplitter
from tests.server import test_app
from tests.server.test_app import MODEL, CharTokenizer, ScriptedEngine, events

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from sparrow.server.app import build_app  # noqa: E402

QWEN = PARSERS["qwen3"]


def split_all(text: str, inside: bool, cuts: list[int]) -> tuple[str, str]:
    splitter = ReasoningSplitter(QWEN, inside)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    parts = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize(
    "text, inside, expected",
    [
        ("<think>\nplan a\nb</think>\n\nthe answer", False, ("\nplan a\nb", "the answer")),
        ("plan</think>\n\nanswer", True, ("plan", "answer")),
        ("  <think>x</think>y", False, ("x", "y")),
        ("no markers at all", False, ("", "no markers at all")),
        ("an answer, then <think>x</think>", False, ("", "an answer, then <think>x</think>")),
        ("truncated reasoning </thi", True, ("truncated reasoning </thi", "")),
        ("<thi", False, ("", "<thi")),
        ("</think>\n\n\n", True, ("", "")),
    ],
)
def test_splitter_at_every_cut(text, inside, expected):
    for cut in range(len(text) + 1):
        assert split_all(text, inside, [cut]) == expected, cut
    assert split_all(text, inside, list(range(1, len(text)))) == expected  # char by char


class OpeningTokenizer(CharTokenizer):
    """A template that opens a think block and takes keyword arguments."""

    def __init__(self):
        self.kwargs = []

    def apply_chat_template(self, messages, **kwargs):
        self.kwargs.append(kwargs)
        opened = "" if kwargs.get("enable_thinking") is False else "<think>\n"
        return super().apply_chat_template(messages) + opened

    def encode_chat(self, messages, **kwargs):
        return self.encode(self.apply_chat_template(messages, **kwargs))


@pytest.fixture
def thinking(monkeypatch):
    pieces = {1: "<thi", 2: "nk>plan", 3: " it</th", 4: "ink>\n\nAns", 5: "wer!"}
    monkeypatch.setattr(test_app, "PIECES", pieces)
    return TestClient(build_app(ScriptedEngine(), CharTokenizer(), MODEL, reasoning=QWEN))


def chat(client, **body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | body
    return client.post("/v1/chat/completions", json=body)


def test_whole_and_streamed(thinking):
    message = chat(thinking).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "plan it" and message["content"] == "Answer!"
    chunks = events(chat(thinking, stream=True))[1:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan it"
    assert "".join(d.get("content", "") for d in deltas) == "Answer!"


def test_prompt_that_opens_the_block_and_template_kwargs(monkeypatch):
    monkeypatch.setattr(test_app, "PIECES", {1: "plan", 2: "</think>", 3: "done"})
    tokenizer = OpeningTokenizer()
    client = TestClient(build_app(ScriptedEngine(), tokenizer, MODEL, reasoning=QWEN))
    message = chat(client).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan", "done")
    off = chat(client, chat_template_kwargs={"enable_thinking": False}).json()
    assert {"enable_thinking": False} in tokenizer.kwargs
    assert off["choices"][0]["message"]["content"] == "plan</think>done"
    bad = chat(client, chat_template_kwargs={"messages": []})
    assert bad.status_code == 400 and "chat_template_kwargs" in json.dumps(bad.json())


def test_without_a_parser_all_text_is_content(monkeypatch):
    monkeypatch.setattr(test_app, "PIECES", {1: "<think>x", 2: "</think>y"})
    client = TestClient(build_app(ScriptedEngine(), CharTokenizer(), MODEL))
    message = chat(client).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>x</think>y"}
