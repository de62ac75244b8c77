"""The router over stand-in workers: eligibility (connected, alive, breaker), hand-off to
another worker on unreachable or full workers and never on a refused request, the breaker's
states, streams that go on at another worker when theirs fails or is ejected mid-stream,
aborts, the request timeout from admission and the summed stats."""

import asyncio

import pytest

from sparrow.core.request import FinishReason, RequestOutput
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.client import (
    EngineError,
    EngineFull,
    EngineHealth,
    EngineInfo,
    EngineStats,
    EngineUnreachable,
    InvalidRequest,
)
from sparrow.engine.output_processor import OutputDelta
from sparrow.gateway.metrics import RouterCollector
from sparrow.gateway.policies import LeastLoad, RoundRobin
from sparrow.gateway.router import CircuitBreaker, Router, RouterSettings

INFO = EngineInfo(max_model_len=64, vocab_size=100, default_stop_token_ids=(0,))
PARAMS = SamplingParams(max_tokens=3)


NAMES = {"a": 1, "b": 2, "c": 3}


def decode(ids: list[int]) -> str:
    """Worker `name`'s tokens are 10 * NAMES[name] + their output position."""
    by_number = {n: name for name, n in NAMES.items()}
    return "".join(by_number[t // 10] for t in ids)


class Fake:
    """A worker: answers request r with one token per output position, from
    `params.output_offset` to `max_tokens` more (finish LENGTH at the last), or raises
    `refuse` from generate, or `broken` at its second token; `delay` seconds between tokens.
    `requests` records (request id, prompt, params)."""

    def __init__(self, name: str):
        self.name, self.alive = name, True
        self.refuse: Exception | None = None
        self.broken: Exception | None = None
        self.delay = 0.0
        self.added: list[str] = []
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.load = EngineStats(0, 0, 0.0)

    @property
    def info(self):
        return INFO

    async def generate(self, request_id, prompt_token_ids, params, media=()):
        if self.refuse is not None:
            raise self.refuse
        self.added.append(request_id)
        self.requests.append((request_id, list(prompt_token_ids), params))
        return self._stream(request_id, params)

    async def _stream(self, rid, params):
        for i in range(params.max_tokens):
            if i == 1 and self.broken is not None:
                raise self.broken
            await asyncio.sleep(self.delay)
            if rid in self.aborted:
                yield RequestOutput(rid, [], FinishReason.ABORT)
                return
            last = i == params.max_tokens - 1
            token = 10 * NAMES[self.name] + params.output_offset + i
            yield RequestOutput(rid, [token], FinishReason.LENGTH if last else None)

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
        decode=decode,
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


def test_failure_mid_stream_without_another_worker_ends_the_stream_with_an_error():
    router, fakes = _router(names=("a",), worker_wait_s=0.0)
    fakes["a"].broken = EngineError("the worker died")

    async def run():
        got = []
        with pytest.raises(EngineError, match="could not be resumed.*died"):
            async for d in await router.add("r0", [1], PARAMS):
                got.append(d)
        return got

    assert len(asyncio.run(run())) == 1
    assert router.workers[0].in_flight == 0


def _tokens(deltas: list[OutputDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_a_stream_goes_on_at_another_worker_when_its_worker_fails():
    """Prompt + the tokens so far, the budget left and the same seed at the next worker;
    the client's stream carries every position once and finishes as an undisturbed one."""
    router, fakes = _router(names=("a", "b"))
    fakes["a"].broken = EngineError("the worker died")
    deltas = asyncio.run(_run(router, "r0"))
    assert _tokens(deltas) == [10, 21, 22] and "".join(d.text for d in deltas) == "abb"
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    (_, first_prompt, first), (_, prompt, params) = fakes["a"].requests + fakes["b"].requests
    assert prompt == [1, 2, 3, 10] and (params.output_offset, params.max_tokens) == (1, 2)
    assert params.seed == first.seed is not None  # the router's own seed, kept
    assert router.workers[0].resumed == 1 and all(w.in_flight == 0 for w in router.workers)
    text = {m.name: m for m in RouterCollector(router).collect()}
    assert text["sparrow_gateway_worker_resumed"].samples[0].value == 1


def test_a_stream_leaves_a_worker_ejected_while_it_waits():
    router, fakes = _router(names=("a", "b"))
    fakes["a"].delay = 0.3

    async def run():
        stream = await router.add("r0", [1, 2, 3], PARAMS)
        got = [await anext(stream)]
        fakes["a"].alive = False  # its health polls fail: ejected
        got += [d async for d in stream]
        return got

    assert _tokens(asyncio.run(run())) == [10, 21, 22]
    assert fakes["a"].aborted == [] or fakes["a"].aborted == ["r0"]
    assert router.workers[0].load == 0  # not healthy: no reported load


def test_a_worker_back_after_an_ejection_starts_with_a_closed_breaker():
    """One loss fails every stream the worker held; once it answers again it is routed to."""
    router, fakes = _router(names=("a",), breaker_failures=2)
    worker = router.workers[0]
    worker.breaker.failure()
    worker.breaker.failure()
    assert worker.breaker.state == "open" and not router.eligible()
    fakes["a"].alive = False
    assert not worker.alive  # ejected
    fakes["a"].alive = True
    assert router.eligible() == [worker] and worker.breaker.state == "closed"


def test_a_stream_waits_for_a_worker_to_take_its_rest():
    """With no other worker up when its worker dies, the stream goes on at the first that
    comes back (within `worker_wait_s`)."""
    router, fakes = _router(names=("a", "b"))
    fakes["a"].broken = EngineError("the worker died")
    fakes["b"].alive = False

    async def run():
        stream = await router.add("r0", [1, 2, 3], PARAMS)
        got = [await anext(stream)]
        fakes["a"].alive = False  # gone for good

        async def restart_b():
            await asyncio.sleep(0.5)
            fakes["b"].alive = True

        restart = asyncio.ensure_future(restart_b())
        got += [d async for d in stream]
        await restart
        return got

    assert _tokens(asyncio.run(run())) == [10, 21, 22]


def test_a_new_request_waits_while_every_worker_is_down():
    router, fakes = _router(names=("a",))
    fakes["a"].alive = False

    async def run():
        async def restart():
            await asyncio.sleep(0.5)
            fakes["a"].alive = True

        back = asyncio.ensure_future(restart())
        got = await _run(router, "r0")
        await back
        return got

    assert _tokens(asyncio.run(run())) == [10, 11, 12]
    router, fakes = _router(names=("a",), worker_wait_s=0.0)
    fakes["a"].alive = False
    with pytest.raises(EngineUnreachable, match="no worker is up"):
        asyncio.run(_run(router, "r1"))


def test_the_first_worker_that_never_takes_the_request_hands_it_on():
    router, fakes = _router(names=("a", "b"))
    fakes["a"].refuse = EngineUnreachable("did not take the request within 5 s")
    assert _tokens(asyncio.run(_run(router, "r0"))) == [20, 21, 22]


def test_abort_reaches_the_worker_running_the_request():
    router, fakes = _router()
    fakes["a"].delay = fakes["b"].delay = 0.05

    async def run():
        stream = await router.add("r0", [1], PARAMS)
        first = await anext(stream)
        router.abort("r0")
        await stream.aclose()
        return first

    assert asyncio.run(run()).text == "a"  # from worker a
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
    router, fakes = _router(names=("a",), request_timeout_s=0.3)
    fakes["a"].delay = 0.5
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
        Router(["x:1"], never, RoundRobin(), wait_s=0.2, decode=decode)
