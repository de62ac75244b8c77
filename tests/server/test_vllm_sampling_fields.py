"""vLLM's `prompt_logprobs` and `skip_special_tokens` through the HTTP app and the official
openai client, over the built-in default model in process."""

import math

import pytest
import torch

from sparrow.engine.async_engine import AsyncEngine
from sparrow.engine.llm import LLM
from sparrow.worker.sequences import SequenceBatch

openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402

from sparrow.server.app import build_app  # noqa: E402

MODEL = "default"
PROMPT = (
    'def add(a, b):\n    """The sum of a and b."""\n    return a + b\n\n\n'
    "def sub(a, b):\n    return a - b\n"
)  # 37 tokens: three chunks of at most 16


@pytest.fixture(scope="module")
def served():
    """(openai client over the app, the LLM behind it)."""
    llm = LLM(block_size=16, max_num_batched_tokens=16)  # prompts prefill in chunks
    with TestClient(build_app(AsyncEngine(llm), llm.tokenizer, MODEL)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http), llm


def test_completion_prompt_logprobs_equal_a_whole_prompt_forward(served):
    client, llm = served
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, n=2, extra_body={"prompt_logprobs": 2}
    )
    ids = llm.tokenizer.encode(PROMPT)
    hidden = SequenceBatch(llm.model, 1, len(ids)).forward([ids])
    ref = torch.log_softmax(llm.model.logits(hidden).double(), dim=-1)
    for choice in out.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for p, position in enumerate(got[1:]):
            entry = position[str(ids[p + 1])]
            assert math.isclose(entry["logprob"], ref[p, ids[p + 1]].item(), abs_tol=1e-4)
            assert entry["decoded_token"] == llm.tokenizer.decode([ids[p + 1]])
            top = sorted(position.values(), key=lambda e: e["rank"])[:2]
            assert [e["rank"] for e in top] == [1, 2]
            assert top[0]["logprob"] == pytest.approx(ref[p].max().item(), abs=1e-4)


def test_chat_prompt_logprobs_beside_the_choices(served):
    client, llm = served
    messages = [{"role": "user", "content": "hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    body = raw.http_response.json()
    ids = llm.tokenizer.encode_chat(messages)
    assert len(body["prompt_logprobs"]) == len(ids) and body["prompt_logprobs"][0] is None
    assert [list(p) for p in body["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    with pytest.raises(openai.BadRequestError, match="less than or equal to 20"):
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 21}
        )
    with pytest.raises(openai.BadRequestError, match="not available with stream"):
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_keeps_their_text(served, stream):
    """`<|im_start|>` forced by logit_bias: no text by default, its own text when kept."""
    client, llm = served
    start = llm.tokenizer.token_id("<|im_start|>")
    texts = []
    for skip in (True, False):
        kw = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "logit_bias": {str(start): 100},
            "stream": stream,
            "extra_body": {"skip_special_tokens": skip, "ignore_eos": True},
        }
        out = client.chat.completions.create(**kw)
        if stream:
            texts.append("".join(c.choices[0].delta.content or "" for c in out if c.choices))
        else:
            texts.append(out.choices[0].message.content)
    assert texts == ["", "<|im_start|>" * 2]


def test_output_offset_is_not_an_http_field(served):
    """output_offset is the gateway's to send a worker over gRPC: a client's is ignored (an
    unknown field, as vLLM has none), so the prompt's tokens are not taken for output."""
    client, _ = served
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "seed": 3, "temperature": 1.0}
    plain = client.completions.create(**kw)
    offset = client.completions.create(**kw, extra_body={"output_offset": 5})
    assert offset.choices[0].text == plain.choices[0].text
    assert offset.usage.completion_tokens == plain.usage.completion_tokens
