"""The EngineClient contract on the in-process AsyncEngine: add / stream / abort / stats /
health / shutdown, on the tiny random model (CPU) with a fake tokenizer whose text is
predictable (" t<id>" per token)."""

import asyncio
import contextlib
import threading

import pytest
import torch

from sparrow.core.request import FinishReason
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.async_engine import AsyncEngine
from sparrow.engine.client import EngineClient, EngineError, EngineFull, InvalidRequest
from sparrow.engine.llm import LLM, StepFailed
from sparrow.loader.random_checkpoint import PRESETS, write_random_checkpoint

CFG = PRESETS["qwen3.6-tiny"].replace(vocab_size=512, initializer_range=0.1)
PROMPT = list(range(3, 20))
MAX_LEN = 256


class PieceTokenizer:
    skipped_ids = frozenset()  # no special tokens

    def decode(self, ids: list[int]) -> str:
        return "".join(f" t{i}" for i in ids)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_random_checkpoint(
        tmp_path_factory.mktemp("engine"),
        CFG,
        seed=2,
        dtype=torch.float32,
        tokenizer=False,
        progress=False,
    )
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
    assert (
        "".join(d.text for d in deltas)
        == expected.text
        == PieceTokenizer().decode(expected.token_ids)
    )
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
    # The loop releases what it held once it has told the streams: wait for that, or it
    # could abort the next test's requests.
    assert engine.dead.wait(30)
    assert not any(held(llm, engine).values()), held(llm, engine)


# -- failures and what stays held -------------------------------------------------------


def held(llm, engine=None) -> dict[str, int]:
    """The size of everything kept per request: all 0 once no request is open."""
    scheduler = llm.scheduler
    sizes = {
        "requests": len(scheduler.requests),
        "draining": scheduler.num_draining,
        "waiting": len(scheduler.waiting),
        "running": len(scheduler.running),
        "kv tables": len(scheduler.kv.tables),
        "state slots": len(scheduler.slots.slots),
        "seeds": len(llm.runner.seeds),
        "in flight": int(llm.has_unfinished()),
    }
    if engine is not None:
        sizes |= {"streams": len(engine._outputs), "texts": len(engine._processor)}
    return sizes


def idle(llm, engine) -> dict[str, int]:
    """`held` once the engine thread has read its last step (at most a few seconds)."""
    for _ in range(500):
        if not llm.has_unfinished() and not engine._outputs:
            break
        threading.Event().wait(0.01)
    return held(llm, engine)


def fail_steps_with(llm, monkeypatch, rid: str | None, error: Exception, times: int = 1) -> list:
    """Make `times` steps whose plan holds `rid` (any plan: None) raise `error` in the
    runner."""
    execute, failed = llm.runner.execute, []

    def broken(plan, requests):
        if (rid is None or rid in plan.num_scheduled_tokens) and len(failed) < times:
            failed.append(plan)
            raise error
        return execute(plan, requests)

    monkeypatch.setattr(llm.runner, "execute", broken)
    return failed


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(llm, engine, monkeypatch):
    expected = llm.generate([PROMPT], params(8))[0]
    failed = fail_steps_with(llm, monkeypatch, "bad", RuntimeError("bad kernel input"))

    async def go():
        stream = await engine.add("bad", PROMPT, params(8, seed=2**64 + 3, temperature=0.5))
        with pytest.raises(EngineError, match="bad kernel input"):
            await asyncio.wait_for(collect(stream), 30)
        assert engine.health().alive and engine.health().accepting
        after = await engine.add("after", PROMPT, params(8))
        return await asyncio.wait_for(collect(after), 60)

    deltas = asyncio.run(go())
    assert len(failed) == 1
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert engine.health().alive and not engine.dead.is_set()
    assert not any(idle(llm, engine).values()), held(llm, engine)


def test_a_step_failing_mid_decode_fails_every_request_in_it(llm, engine, monkeypatch):
    """The failure comes once "bad" decodes beside "other": both were in the step."""
    execute = llm.runner.execute

    def broken(plan, requests):
        if "bad" in plan.num_scheduled_tokens and requests["bad"].output_token_ids:
            raise RuntimeError("mid-decode")
        return execute(plan, requests)

    monkeypatch.setattr(llm.runner, "execute", broken)

    async def go():
        bad = await engine.add("bad", PROMPT, params(50))
        other = await engine.add("other", PROMPT[:5], params(50))
        results = await asyncio.wait_for(
            asyncio.gather(collect(bad), collect(other), return_exceptions=True), 60
        )
        monkeypatch.setattr(llm.runner, "execute", execute)
        return results, await asyncio.wait_for(collect(await engine.add("c", PROMPT, params())), 60)

    (bad, other), after = asyncio.run(go())
    assert isinstance(bad, EngineError) and "mid-decode" in str(bad)
    assert isinstance(other, EngineError)
    assert after[-1].finish_reason is FinishReason.LENGTH and engine.health().alive
    assert not any(idle(llm, engine).values()), held(llm, engine)


@pytest.mark.parametrize(
    "error, times",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), 1),
        (RuntimeError("keeps failing"), 3),  # MAX_FAILED_STEPS in a row
    ],
)
def test_a_fatal_failure_stops_the_engine_and_says_so(llm, monkeypatch, error, times):
    fail_steps_with(llm, monkeypatch, "x", error, times=times)
    fatal = []
    engine = AsyncEngine(llm, on_fatal=fatal.append)

    async def go():
        for i in range(times):
            stream = await engine.add("x", PROMPT, params())
            with pytest.raises(EngineError, match=str(error)[:12]):
                await asyncio.wait_for(collect(stream), 30)
            if i < times - 1:
                assert engine.health().alive
        assert await asyncio.to_thread(engine.dead.wait, 30)
        with pytest.raises(EngineError, match="the engine stopped"):
            await asyncio.wait_for(engine.add("y", PROMPT, params()), 5)

    asyncio.run(go())
    assert not engine.health().alive and not engine.health().accepting
    assert len(fatal) == 1 and fatal[0] is error
    assert not any(held(llm, engine).values()), held(llm, engine)
    asyncio.run(asyncio.wait_for(engine.shutdown(timeout=5), 10))


def test_twenty_requests_leave_nothing_held(llm):
    """Greedy, seeded (seeds past 64 bits), tiny temperatures, logprobs, stop strings,
    stop tokens (a token more in flight), aborts and streams left early."""
    engine = AsyncEngine(llm, max_waiting=32)
    base = llm.generate([PROMPT], params(8))[0]
    stop_id = base.token_ids[2]

    def kind(i: int) -> SamplingParams:
        return [
            params(6),
            params(6, temperature=0.8, seed=2**64 * i + i),
            params(6, temperature=1e-45, seed=-i),
            params(5, logprobs=3),
            params(8, stop=(f" t{base.token_ids[3]}",)),
            SamplingParams(max_tokens=8, stop_token_ids=(stop_id,)),
        ][i % 6]

    async def one(i: int):
        stream = await engine.add(f"r{i}", PROMPT[i % 5 :], kind(i))
        if i % 7 == 3:
            async with contextlib.aclosing(stream):
                return [await anext(stream)]
        if i % 7 == 5:
            engine.abort(f"r{i}")
        return await collect(stream)

    async def go():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(20))), 120)

    results = asyncio.run(go())
    assert all(r for r in results)
    assert not any(idle(llm, engine).values()), held(llm, engine)
    asyncio.run(engine.shutdown(timeout=30))


def test_offline_generation_leaves_nothing_held(llm):
    base = llm.generate([PROMPT], params(8))[0]
    many = [
        params(6),
        params(7, temperature=0.9, seed=2**70),
        params(5, logprobs=2),
        SamplingParams(max_tokens=8, stop_token_ids=(base.token_ids[1],)),
    ] * 5
    outs = llm.generate([PROMPT[i % 4 :] for i in range(20)], many)
    assert len(outs) == 20 and all(o.finish_reason is not None for o in outs)
    assert not any(held(llm).values()), held(llm)


def test_offline_generation_frees_its_requests_when_a_step_fails(llm, monkeypatch):
    fail_steps_with(llm, monkeypatch, None, RuntimeError("boom"))
    with pytest.raises(StepFailed, match="boom"):
        llm.generate([PROMPT, PROMPT[:4]], params(6))
    assert not any(held(llm).values()), held(llm)
    assert llm.generate([PROMPT], params(3))[0].finish_reason is FinishReason.LENGTH
