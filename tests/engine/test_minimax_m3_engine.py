"""MiniMax M3 through the engine's front doors: `sparrow checkpoint random --preset
minimax-m3-tiny` (tokenizer with M3's special tokens at their ids, MiniMax chat template),
`sparrow generate` (index keys in the activation dtype and in fp8), `LLM` with the
checkpoint's own chat template, and the HTTP app over the AsyncEngine (what `sparrow serve`
runs), all on the same scheduler."""

import asyncio
import json

import pytest
import torch

from sparrow import cli
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.async_engine import AsyncEngine
from sparrow.engine.llm import LLM
from sparrow.models.minimax_m3 import SPECIAL_TOKENS as M3_SPECIAL_TOKENS
from sparrow.tokenizer import load_tokenizer

USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("m3") / "ckpt"
    assert (
        cli.main(
            [
                "checkpoint",
                "random",
                str(out),
                "--preset",
                "minimax-m3-tiny",
                "--layers",
                "5",
                "--per-expert",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    return out


def test_random_checkpoint_is_m3_with_its_tokens(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "minimax_m3_vl"
    text = config["text_config"]
    # MiniMax's release keys: which layers are sparse attention, which MoE
    assert text["sparse_attention_config"]["sparse_attention_freq"] == [0] * 3 + [1] * 2
    assert text["moe_layer_freq"] == [0] * 3 + [1] * 2
    tokenizer = load_tokenizer(checkpoint)
    assert {t: tokenizer.token_id(t) for t in M3_SPECIAL_TOKENS} == M3_SPECIAL_TOKENS
    ids = tokenizer.encode_chat(USER)
    assert ids[:2] == [200034, 200019] and ids[-3:-1] == [200019, tokenizer.encode("ai")[0]]


@pytest.mark.parametrize("index_dtype", ["auto", "fp8_e4m3"])
def test_generate_command(checkpoint, capsys, index_dtype):
    assert (
        cli.main(
            [
                "generate",
                "--model",
                str(checkpoint),
                "--prompt",
                "hi",
                "--max-tokens",
                "4",
                "--device",
                "cpu",
                "--index-cache-dtype",
                index_dtype,
            ]
        )
        == 0
    )
    assert "decode: 4 tokens" in capsys.readouterr().out


def test_llm_uses_the_checkpoints_chat_template(checkpoint, tmp_path):
    for f in checkpoint.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}]~b]{{ m['role'] }}:{{ m['content'] }}{% endfor %}]~b]ai\n"
    )
    llm = LLM(model=str(tmp_path), device="cpu", dtype=torch.float32)
    assert llm.tokenizer.apply_chat_template(USER).startswith("]~b]user:Hello there")
    assert 200020 in llm.default_stop_ids  # [e~[, the config's eos
    out = llm.generate(
        [llm.tokenizer.encode_chat(USER)] * 2, SamplingParams(max_tokens=5, ignore_eos=True)
    )
    assert [len(c.token_ids) for c in out] == [5, 5] and out[0].token_ids == out[1].token_ids


def test_http_app_over_the_engine(checkpoint):
    pytest.importorskip("httpx")
    testclient = pytest.importorskip("fastapi.testclient")
    from sparrow.server.app import build_app

    llm = LLM(model=str(checkpoint), device="cpu", dtype=torch.float32, max_model_len=512)
    engine = AsyncEngine(llm, max_waiting=8)
    app = build_app(engine, llm.tokenizer, "m3")
    try:
        with testclient.TestClient(app) as client:
            body = {"model": "m3", "messages": USER, "max_tokens": 4, "temperature": 0}
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] <= 4
    finally:
        asyncio.run(engine.shutdown(timeout=30))
