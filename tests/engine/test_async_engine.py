"""The EngineClient contract on the in-process AsyncEngine: add / stream / abort / stats /
health / shutdown, on the tiny random model (CPU) with a fake tokenizer whose text is
predictable (" t<id>" per token)."""

import asyncio
import contextlib

import pytest
import torch

from sparrow.core.request import FinishReason
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.async_engine import AsyncEngine
from sparrow.engine.client import EngineClient, EngineError, EngineFull, InvalidRequest
from sparrow.engine.llm import LLM
from sparrow.loader.random_checkpoint import PRESETS, write_random_checkpoint

CFG = PRESETS["qwen3.6-tiny"].replace(vocab_size=512, initializer_range=0.1)
PROMPT = list(range(3, 20))
MAX_LEN = 256


class PieceTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(f" t{i}" for i in ids)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("engine"), CFG, seed=2,
                                   dtype=torch.float32, tokenizer=False,
                                   progress=False)  # fmt: skip
    llm = LLM(path, device="cpu", block_size=16, num_blocks=64, max_model_len=MAX_LEN)
    llm.tokenizer = PieceTokenizer()
    return llm


@pytest.fixture
def engine(llm):
    engine = AsyncEngine(llm, max_waiting=8)
    yield engine
    asyncio.run(engine.shutdown(timeout=30))
    assert not llm.scheduler.has_unfinished() and llm.scheduler.kv.usage == 0


def params(n: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


async def collect(stream):
    return [delta async for delta in stream]


def test_add_streams_text_deltas_like_offline_generation(llm, engine):
    assert isinstance(engine, EngineClient)
    info = engine.info
    assert info.max_model_len == MAX_LEN and info.vocab_size == CFG.vocab_size
    assert info.default_stop_token_ids == llm.default_stop_ids
    expected = llm.generate([PROMPT], params())[0]

    async def go():
        return await collect(await engine.add("a", PROMPT, params()))

    deltas = asyncio.run(go())
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text == PieceTokenizer().decode(
        expected.token_ids)  # fmt: skip
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_stop_string_across_tokens_ends_and_frees_the_request(llm, engine):
    full = llm.generate([PROMPT], params(8))[0]
    pieces = [f" t{i}" for i in full.token_ids]
    boundary = len("".join(pieces[:3]))
    stop = full.text[boundary - 1 : boundary + 3]  # the end of token 3 and " t." of token 4
    want = full.text[: full.text.find(stop)]

    async def go():
        return await collect(await engine.add("s", PROMPT, params(8, stop=(stop,))))

    deltas = asyncio.run(go())
    assert "".join(d.text for d in deltas) == want and stop not in want
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert len([t for d in deltas for t in d.token_ids]) == 4  # to the one completing it
    assert not llm.scheduler.has_unfinished() and llm.scheduler.kv.usage == 0


def test_invalid_requests_raise_before_anything_is_queued(engine):
    async def go():
        with pytest.raises(InvalidRequest, match="context limit"):
            await engine.add("x", PROMPT, params(MAX_LEN))
        with pytest.raises(InvalidRequest, match="token ids must be in"):
            await engine.add("y", [CFG.vocab_size], params())
        with pytest.raises(InvalidRequest, match="empty"):
            await engine.add("z", [], params())
        assert engine.stats().waiting == 0
        stream = await engine.add("ok", PROMPT, params(2))
        with pytest.raises(InvalidRequest, match="duplicate"):
            await engine.add("ok", PROMPT, params(2))
        return await collect(stream)

    assert asyncio.run(go())[-1].finish_reason is FinishReason.LENGTH


def test_abort_and_leaving_the_stream_free_the_request(llm, engine):
    async def go():
        stream = await engine.add("a", PROMPT, params(200))
        first = await anext(stream)
        assert engine.stats().running == 1 and engine.stats().kv_usage > 0
        engine.abort("a")
        rest = await collect(stream)
        assert rest[-1].finish_reason is FinishReason.ABORT
        left = await engine.add("b", PROMPT, params(200))
        async with contextlib.aclosing(left):
            await anext(left)
        for _ in range(200):  # the abort reaches the engine thread between steps
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        return first

    assert asyncio.run(go()).token_ids
    assert engine.stats().running == 0 and engine.stats().kv_usage == 0
    engine.abort("unknown")  # a no-op


def test_full_queue_and_shutdown_refuse_new_requests(llm):
    engine = AsyncEngine(llm, max_waiting=0)
    assert engine.health().alive and engine.health().accepting
    with pytest.raises(EngineFull, match="0 requests"):
        asyncio.run(engine.add("a", PROMPT, params()))
    asyncio.run(engine.shutdown(timeout=30))
    assert not engine.health().accepting and not engine.health().alive
    with pytest.raises(EngineFull, match="shutting down"):
        asyncio.run(engine.add("b", PROMPT, params()))


def test_a_failing_engine_loop_ends_streams_with_an_error(llm, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm, "step", broken_step)
    engine = AsyncEngine(llm)

    async def go():
        stream = await engine.add("a", PROMPT, params())
        with pytest.raises(EngineError, match="device lost"):
            await collect(stream)
        with pytest.raises(EngineError):
            await engine.add("b", PROMPT, params())

    asyncio.run(go())
    assert not engine.health().alive
    llm.abort("a")  # the scheduler still holds it: the loop died before stepping it
