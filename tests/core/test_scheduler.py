"""The scheduler with hand-made runner outputs, no model.

The fake runner samples token f(request, position): a request's output then does not depend
on how it was batched, chunked or preempted, so every schedule must produce the same tokens
as running the request alone.
"""

import time

import pytest

from sparrow.config import CacheConfig, SchedulerConfig
from sparrow.core.block_pool import KVCacheManager, StateSlotPool
from sparrow.core.request import FinishReason, Request
from sparrow.core.sampling_params import SamplingParams
from sparrow.core.scheduler import Scheduler

VOCAB = 1000
_CACHE_KEYS = (
    "block_size",
    "num_blocks",
    "num_state_slots",
    "enable_prefix_caching",
    "num_state_snapshots",
)


def configs(**kw) -> tuple[SchedulerConfig, CacheConfig]:
    """Resolved settings: a 262,144-token context, 1,024 blocks, 64 state slots and no prefix
    caching unless given (tests/core/test_prefix_cache.py covers it)."""
    cache = {
        "block_size": 128,
        "num_blocks": 1024,
        "num_state_slots": 64,
        "enable_prefix_caching": False,
    } | {k: kw.pop(k) for k in _CACHE_KEYS if k in kw}
    return SchedulerConfig(**({"max_model_len": 262144} | kw)), CacheConfig(**cache)


def token_at(request: Request, position: int | None = None) -> int:
    """What the fake model samples after the request's first `position` tokens (default: all
    its current tokens)."""
    position = request.num_tokens if position is None else position
    return (hash(request.request_id) * 31 + position * 7) % VOCAB


def run_step(scheduler: Scheduler):
    plan = scheduler.schedule()
    for rid, n in plan.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        # the runner gets whole block tables that cover what it computes
        covered = len(plan.block_tables[rid]) * scheduler.cache_config.block_size
        assert request.num_computed_tokens + n <= covered
    sampled = {}
    for rid, n in plan.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        if request.num_computed_tokens + n == request.num_tokens:
            sampled[rid] = [token_at(request)]
    return plan, scheduler.update_from_output(plan, sampled)


def run_all(scheduler: Scheduler, max_steps: int = 10_000):
    plans = []
    while scheduler.has_unfinished():
        plan, _ = run_step(scheduler)
        assert plan.total_tokens <= scheduler.config.max_num_batched_tokens
        plans.append(plan)
        assert len(plans) < max_steps
    return plans


def make(rid: str, prompt_len: int, max_tokens: int = 5, **params) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, list(range(1, prompt_len + 1)), params)


def alone(request: Request) -> list[int]:
    scheduler = Scheduler(*configs(max_num_batched_tokens=1 << 20, num_blocks=4096))
    copy = make(request.request_id, len(request.prompt_token_ids), request.params.max_tokens)
    scheduler.add_request(copy)
    run_all(scheduler)
    return copy.output_token_ids


def test_single_request_prefill_then_decode():
    scheduler = Scheduler(*configs(block_size=16, num_blocks=8))
    request = make("a", 20, max_tokens=3)
    scheduler.add_request(request)
    plans = run_all(scheduler)
    assert [p.num_scheduled_tokens for p in plans] == [{"a": 20}, {"a": 1}, {"a": 1}]
    assert request.finish_reason is FinishReason.LENGTH and len(request.output_token_ids) == 3
    assert scheduler.kv.num_free == 8 and scheduler.slots.num_free == 64


def test_budget_mixes_decodes_and_prefill_chunks():
    config = configs(max_num_batched_tokens=64, block_size=16, num_blocks=64)
    scheduler = Scheduler(*config)
    requests = [make("a", 10, 8), make("b", 100, 4), make("c", 30, 4)]
    for r in requests:
        scheduler.add_request(r)
    plans = run_all(scheduler)
    assert plans[0].num_scheduled_tokens == {"a": 10, "b": 54}  # b's prompt is chunked
    assert plans[1].num_scheduled_tokens == {"a": 1, "b": 46, "c": 17}  # decode + 2 chunks
    for r in requests:
        assert r.output_token_ids == alone(r)


def test_128k_prompt_runs_in_chunks_within_budget():
    config = configs(max_num_batched_tokens=8192, block_size=128, num_blocks=1100)
    scheduler = Scheduler(*config)
    request = make("long", 131072, max_tokens=2)
    scheduler.add_request(request)
    plans = run_all(scheduler)
    assert [p.num_scheduled_tokens["long"] for p in plans] == [8192] * 16 + [1]
    # blocks grow with the computed prefix, never beyond what the step needs
    assert len(plans[0].block_tables["long"]) == 64 and len(plans[15].block_tables["long"]) == 1024


def test_requests_join_and_leave_mid_batch():
    scheduler = Scheduler(*configs(max_num_batched_tokens=32, block_size=16))
    first = make("first", 8, max_tokens=6)
    scheduler.add_request(first)
    run_step(scheduler)
    run_step(scheduler)
    late = make("late", 12, max_tokens=2)
    scheduler.add_request(late)
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == {"first": 1, "late": 12}
    assert plan.new_request_ids == ["late"]
    run_all(scheduler)
    assert first.output_token_ids == alone(first) and late.output_token_ids == alone(late)


def test_stop_token_and_abort_with_stop():
    """Stop tokens end a request here; stop strings are the output processor's, which ends
    one through `abort(id, STOP)`."""
    stop_token = token_at(make("s", 5))  # the first token the fake model will sample
    scheduler = Scheduler(*configs(block_size=16, num_blocks=8))
    by_token = make("s", 5, max_tokens=10, stop_token_ids=(stop_token,))
    scheduler.add_request(by_token)
    run_all(scheduler)
    assert by_token.finish_reason is FinishReason.STOP and len(by_token.output_token_ids) == 1

    by_string = make("t", 4, max_tokens=10, stop=("never seen by the scheduler",))
    scheduler.add_request(by_string)
    run_step(scheduler)
    run_step(scheduler)
    assert scheduler.abort("t", FinishReason.STOP) and not scheduler.has_unfinished()
    assert by_string.finish_reason is FinishReason.STOP and len(by_string.output_token_ids) == 2
    assert scheduler.kv.num_free == 8


def test_finished_ids_are_forgotten_once_nothing_is_in_flight():
    scheduler = Scheduler(*configs(block_size=16, num_blocks=8))
    scheduler.add_request(make("a", 4, max_tokens=10))
    first = scheduler.commit(scheduler.schedule())  # the prompt: samples a token
    second = scheduler.commit(scheduler.schedule())  # launched on the pending token
    assert [o.new_token_ids for o in scheduler.resolve(first, {"a": [7]})] == [[7]]
    assert scheduler.abort("a") and "a" not in scheduler.requests
    with pytest.raises(ValueError, match="duplicate"):  # a token of it is still in flight
        scheduler.add_request(make("a", 4))
    assert scheduler.resolve(second, {"a": [8]}) == []
    again = make("a", 4, max_tokens=2)
    scheduler.add_request(again)
    run_all(scheduler)
    assert len(again.output_token_ids) == 2 and scheduler.kv.num_free == 8


def test_dropping_a_failed_steps_tokens_leaves_nothing_in_flight():
    """A step that fails after `commit` never resolves: drop_pending undoes its pending
    tokens, so aborting its requests holds nothing and the ids can come again."""
    scheduler = Scheduler(*configs(block_size=16, num_blocks=8))
    scheduler.add_request(make("a", 4, max_tokens=10))
    scheduler.add_request(make("b", 4, max_tokens=10))
    first = scheduler.commit(scheduler.schedule())
    assert scheduler.abort("b")  # finished with a token in flight: draining
    assert scheduler.num_draining == 1
    scheduler.drop_pending(first)
    assert scheduler.requests["a"].num_pending == 0 and scheduler.num_draining == 0
    assert scheduler.abort("a") and scheduler.num_draining == 0
    assert not scheduler.has_unfinished() and scheduler.kv.num_free == 8
    assert not scheduler.kv.tables and not scheduler.slots.slots
    scheduler.add_request(make("a", 4, max_tokens=2))
    scheduler.add_request(make("b", 4, max_tokens=2))
    run_all(scheduler)
    assert scheduler.kv.num_free == 8 and not scheduler.requests


def test_preemption_when_blocks_run_out_gives_the_same_tokens():
    # 6 blocks of 4 tokens: two requests of 10 + 12 tokens cannot both keep growing.
    config = configs(max_num_batched_tokens=64, block_size=4, num_blocks=6)
    scheduler = Scheduler(*config)
    old, new = make("old", 9, max_tokens=12), make("new", 5, max_tokens=12)
    scheduler.add_request(old)
    scheduler.add_request(new)
    plans = run_all(scheduler)
    preempted = [rid for p in plans for rid in p.preempted_ids]
    assert preempted and set(preempted) == {"new"}  # the newest request gives way
    assert old.output_token_ids == alone(old) and new.output_token_ids == alone(new)
    assert scheduler.kv.num_free == 6


def test_admission_queues_instead_of_overcommitting():
    config = configs(max_num_seqs=2, num_state_slots=2, block_size=16, num_blocks=64)
    scheduler = Scheduler(*config)
    requests = [make(f"r{i}", 10, max_tokens=3) for i in range(5)]
    for r in requests:
        scheduler.add_request(r)
    plan, _ = run_step(scheduler)
    assert sorted(plan.num_scheduled_tokens) == ["r0", "r1"] and scheduler.num_waiting == 3
    run_all(scheduler)
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert not scheduler.requests  # finished requests are forgotten


def test_requests_that_can_never_run_are_refused():
    scheduler = Scheduler(*configs(max_model_len=100, block_size=16, num_blocks=4))
    with pytest.raises(ValueError, match="exceeds the context limit of 100"):
        scheduler.add_request(make("x", 98, max_tokens=5))
    with pytest.raises(ValueError, match="the cache holds 64"):
        scheduler.add_request(make("y", 60, max_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(Request("z", []))
    scheduler.add_request(make("ok", 10))
    with pytest.raises(ValueError, match="duplicate"):
        scheduler.add_request(make("ok", 10))


def test_abort_frees_at_once():
    scheduler = Scheduler(*configs(block_size=16, num_blocks=10))
    running, queued = make("run", 40, max_tokens=50), make("queued", 10)
    scheduler.add_request(running)
    run_step(scheduler)
    scheduler.add_request(queued)
    assert scheduler.kv.num_free == 7
    assert scheduler.abort("run") and scheduler.abort("queued") and not scheduler.abort("run")
    assert running.finish_reason is FinishReason.ABORT
    assert scheduler.kv.num_free == 10 and not scheduler.has_unfinished()


def test_pools():
    kv = KVCacheManager(num_blocks=4, block_size=8)
    assert kv.allocate("a", 17) and kv.tables["a"] == [0, 1, 2]
    assert not kv.allocate("b", 9) and "b" not in kv.tables  # all or nothing
    assert kv.usage == 0.75
    kv.free("a")
    assert kv.num_free == 4
    with pytest.raises(ValueError, match="power of two"):
        KVCacheManager(4, 12)
    slots = StateSlotPool(1)
    assert slots.allocate("a") == 0 and slots.allocate("b") is None


def run_all_overlapped(scheduler: Scheduler, max_steps: int = 10_000):
    """Like the engine with one step in flight: plan and launch step k (pending tokens come
    from the device: the fake runner needs only positions), commit it, then resolve step
    k - 1."""
    in_flight, steps = None, 0
    while scheduler.has_unfinished() or in_flight:
        plan = scheduler.schedule()
        sampled = {}
        for rid, n in plan.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            end = request.num_computed_tokens + n
            assert end <= request.num_tokens <= len(request.all_token_ids) + 1
            if end == request.num_tokens:
                sampled[rid] = [token_at(request, end)]
        sampling = scheduler.commit(plan)
        if in_flight:
            scheduler.resolve(*in_flight)
        in_flight = (sampling, sampled) if sampling else None
        steps += 1
        assert steps < max_steps


def _workload(kind: str) -> tuple[Scheduler, list[Request]]:
    if kind == "preemption":
        config = configs(max_num_batched_tokens=64, block_size=4, num_blocks=6)
        requests = [make("old", 9, max_tokens=12), make("new", 5, max_tokens=12)]
    elif kind == "stops":
        config = configs(max_num_batched_tokens=32, block_size=16)
        tokens = alone(make("t", 4, max_tokens=10))
        requests = [
            make("s", 5, max_tokens=10, stop_token_ids=(token_at(make("s", 5)),)),
            make("t", 4, max_tokens=10, stop_token_ids=(tokens[2],)),
            make("u", 40, max_tokens=7),
            make("v", 3, max_tokens=1),
        ]
    else:
        config = configs(max_num_batched_tokens=64, block_size=16, num_blocks=64)
        requests = [make("a", 10, 8), make("b", 100, 4), make("c", 30, 4)]
    scheduler = Scheduler(*config)
    for r in requests:
        scheduler.add_request(r)
    return scheduler, requests


@pytest.mark.parametrize("kind", ["mix", "preemption", "stops"])
def test_one_step_in_flight_gives_the_same_outputs(kind):
    sync, expected = _workload(kind)
    run_all(sync)
    overlapped, requests = _workload(kind)
    run_all_overlapped(overlapped)
    for want, got in zip(expected, requests, strict=True):
        assert got.output_token_ids == want.output_token_ids
        assert got.finish_reason is want.finish_reason and got.num_pending == 0
    cache = overlapped.cache_config
    assert overlapped.kv.num_free == cache.num_blocks
    assert overlapped.slots.num_free == cache.num_state_slots


def test_token_ids_slices_prompt_and_outputs():
    request = make("r", 5)
    request.output_token_ids = [60, 70, 80]
    for start, stop in [(0, 3), (2, 5), (4, 7), (5, 8), (6, 9), (0, 8), (7, 10)]:
        assert request.token_ids(start, stop) == request.all_token_ids[start:stop]


@pytest.mark.parametrize("block_size", [16, 128])
def test_1m_token_prompt_runs_in_chunks_to_decode(block_size):
    """A 1,010,000-token prompt (Qwen3.6's 1M context with YaRN) is admitted, prefilled in
    chunks of the step budget and decoded; every step's block table holds exactly the blocks
    of what is computed so far, and the whole run takes seconds (nothing per step grows with
    the context but the table itself)."""
    n, out, budget = 1_010_000, 16, 8192
    config = configs(
        max_model_len=1_048_576,
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_blocks=1_048_576 // block_size,
    )
    scheduler = Scheduler(*config)
    request = make("1m", n, max_tokens=out)
    start = time.perf_counter()
    scheduler.add_request(request)
    plans, computed = [], 0
    while scheduler.has_unfinished():
        plan, _ = run_step(scheduler)
        computed += plan.num_scheduled_tokens["1m"]
        assert len(plan.block_tables["1m"]) == -(-computed // block_size)
        plans.append(plan)
    elapsed = time.perf_counter() - start
    chunks = [p.num_scheduled_tokens["1m"] for p in plans]
    assert chunks == [budget] * (n // budget) + [n % budget] + [1] * (out - 1)
    assert request.finish_reason is FinishReason.LENGTH and len(request.output_token_ids) == out
    assert len(plans[-1].block_tables["1m"]) == -(-(n + out - 1) // block_size)
    assert scheduler.kv.num_free == config[1].num_blocks
    assert elapsed < 10, f"{elapsed:.1f} s"
