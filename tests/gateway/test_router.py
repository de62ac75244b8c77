"""The router over stand-in engines: eligibility (connected, alive, breaker), hand-off to
another worker on unreachable or full workers and never on a refused request, the breaker's
states, mid-stream failures, aborts, the request timeout and the summed stats."""

import asyncio

import pytest

from sparrow.core.request import FinishReason
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.client import (
    EngineClient,
    EngineError,
    EngineFull,
    EngineHealth,
    EngineInfo,
    EngineStats,
    EngineUnreachable,
    InvalidRequest,
)
from sparrow.engine.output_processor import OutputDelta
from sparrow.gateway.policies import LeastLoad, RoundRobin
from sparrow.gateway.router import CircuitBreaker, Router, RouterSettings

INFO = EngineInfo(max_model_len=64, vocab_size=100, default_stop_token_ids=(0,))
PARAMS = SamplingParams(max_tokens=3)


class Fake(EngineClient):
    """Answers every request with three one-token deltas, or raises `refuse` from add, or
    `broken` after the first delta; `delay` seconds between deltas."""

    def __init__(self, name: str):
        self.name, self.alive = name, True
        self.refuse: Exception | None = None
        self.broken: Exception | None = None
        self.delay = 0.0
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.load = EngineStats(0, 0, 0.0)

    @property
    def info(self):
        return INFO

    async def add(self, request_id, prompt_token_ids, params, media=()):
        if self.refuse is not None:
            raise self.refuse
        self.added.append(request_id)
        return self._stream(request_id)

    async def _stream(self, rid):
        for i in range(3):
            if i == 1 and self.broken is not None:
                raise self.broken
            await asyncio.sleep(self.delay)
            if rid in self.aborted:
                yield OutputDelta(rid, [], "", FinishReason.ABORT)
                return
            yield OutputDelta(rid, [i], self.name, FinishReason.LENGTH if i == 2 else None)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return self.load

    def health(self):
        return EngineHealth(self.alive, self.alive)

    async def shutdown(self):
        pass


def _router(names=("a", "b"), policy=None, **settings) -> tuple[Router, dict[str, Fake]]:
    fakes = {n: Fake(n) for n in names}
    router = Router(
        list(names),
        lambda address: fakes[address],
        policy or RoundRobin(),
        RouterSettings(**settings),
        wait_s=5,
    )
    for _ in range(200):  # workers connect on background threads
        if all(w.engine is not None for w in router.workers):
            break
        asyncio.run(asyncio.sleep(0.01))
    return router, fakes


async def _run(router: Router, rid: str) -> list[OutputDelta]:
    return [d async for d in await router.add(rid, [1, 2, 3], PARAMS)]


def test_requests_spread_and_finish():
    router, fakes = _router()
    outs = asyncio.run(_gather(router, ["r0", "r1", "r2", "r3"]))
    assert [o[-1].finish_reason for o in outs] == [FinishReason.LENGTH] * 4
    assert fakes["a"].added == ["r0", "r2"] and fakes["b"].added == ["r1", "r3"]
    assert all(w.in_flight == 0 for w in router.workers)
    assert router.info == INFO


async def _gather(router, rids):
    return [await _run(router, rid) for rid in rids]


def test_dead_workers_are_skipped_and_readmitted():
    router, fakes = _router()
    fakes["a"].alive = False
    asyncio.run(_gather(router, ["r0", "r1", "r2"]))
    assert fakes["a"].added == [] and len(fakes["b"].added) == 3
    fakes["a"].alive = True
    asyncio.run(_gather(router, ["r3", "r4"]))
    assert len(fakes["a"].added) == 1


def test_unreachable_worker_hands_the_request_on():
    router, fakes = _router()
    fakes["a"].refuse = EngineUnreachable("connection refused")
    out = asyncio.run(_run(router, "r0"))
    assert out[-1].text == "b" and fakes["b"].added == ["r0"]
    assert router.workers[0].retries == 1


def test_full_workers_hand_on_then_503():
    router, fakes = _router()
    fakes["a"].refuse = EngineFull("queue full")
    assert asyncio.run(_run(router, "r0"))[-1].text == "b"
    fakes["b"].refuse = EngineFull("queue full")
    with pytest.raises(EngineFull, match="no worker can take"):
        asyncio.run(_run(router, "r1"))


def test_refused_requests_are_not_retried_and_do_not_open_the_breaker():
    router, fakes = _router(breaker_failures=2)
    fakes["a"].refuse = InvalidRequest("prompt too long")
    fakes["b"].refuse = InvalidRequest("prompt too long")
    for i in range(10):
        with pytest.raises(InvalidRequest):
            asyncio.run(_run(router, f"r{i}"))
    assert [w.breaker.state for w in router.workers] == ["closed", "closed"]
    assert all(w.retries == 0 for w in router.workers)


def test_breaker_opens_on_worker_failures_and_closes_after_a_trial():
    now = [0.0]
    breaker = CircuitBreaker(failures=3, open_s=10, clock=lambda: now[0])
    for _ in range(2):
        breaker.failure()
    assert breaker.state == "closed" and breaker.allows()
    breaker.failure()
    assert breaker.state == "open" and not breaker.allows()
    now[0] = 10.0
    assert breaker.state == "half_open" and breaker.allows()
    breaker.start()
    assert not breaker.allows()  # one trial at a time
    breaker.failure()  # the trial failed: open again
    assert breaker.state == "open"
    now[0] = 20.0
    breaker.start()
    breaker.success()
    assert breaker.state == "closed" and breaker.allows()


def test_open_breaker_keeps_requests_off_a_failing_worker():
    router, fakes = _router(breaker_failures=2)
    fakes["a"].refuse = EngineUnreachable("gone")
    asyncio.run(_gather(router, ["r0", "r1", "r2", "r3"]))
    assert router.workers[0].breaker.state == "open"
    assert len(fakes["b"].added) == 4
    assert router.workers[0].retries == 2  # tried twice, then left alone


def test_failure_mid_stream_ends_the_stream_with_an_error():
    router, fakes = _router(names=("a",))
    fakes["a"].broken = EngineUnreachable("the worker died")

    async def run():
        got = []
        with pytest.raises(EngineError, match="died"):
            async for d in await router.add("r0", [1], PARAMS):
                got.append(d)
        return got

    assert len(asyncio.run(run())) == 1
    assert router.workers[0].in_flight == 0


def test_abort_reaches_the_worker_running_the_request():
    router, fakes = _router()
    fakes["a"].delay = fakes["b"].delay = 0.05

    async def run():
        stream = await router.add("r0", [1], PARAMS)
        first = await anext(stream)
        router.abort("r0")
        await stream.aclose()
        return first

    assert asyncio.run(run()).text == "a"
    assert fakes["a"].aborted == ["r0"]
    router.abort("unknown")  # a no-op


def test_in_flight_ends_with_the_last_delta():
    """A reader that stops at the finish reason (never asking past it) leaves nothing in
    flight."""
    router, fakes = _router(names=("a",))

    async def run():
        async for d in await router.add("r0", [1], PARAMS):
            if d.finish_reason is not None:
                return router.workers[0].in_flight

    assert asyncio.run(run()) == 0
    assert router.workers[0].breaker.state == "closed"


def test_request_timeout():
    router, fakes = _router(names=("a",), request_timeout_s=0.05)
    fakes["a"].delay = 0.2
    with pytest.raises(EngineError, match="limit"):
        asyncio.run(_run(router, "r0"))
    assert fakes["a"].aborted == ["r0"]  # the worker was told to stop it
    assert router.workers[0].in_flight == 0 and router.workers[0].breaker.state == "closed"


def test_least_load_uses_the_reported_queue():
    router, fakes = _router(policy=LeastLoad())
    fakes["a"].load = EngineStats(waiting=5, running=3, kv_usage=0.5)
    asyncio.run(_run(router, "r0"))
    assert fakes["b"].added == ["r0"]
    stats = router.stats()
    assert (stats.waiting, stats.running, stats.kv_usage) == (5, 3, 0.25)


def test_no_worker_answering_fails_at_start():
    def never(address):
        raise EngineUnreachable("down")

    with pytest.raises(EngineError, match="no worker answered"):
        Router(["x:1"], never, RoundRobin(), wait_s=0.2)
