"""The block manager's prefix cache and the snapshot pool, no model: exact keys, reference
counts, least-recently-used eviction, and the scheduler's hits and snapshot plans."""

from sparrow.config import CacheConfig, SchedulerConfig
from sparrow.core.block_pool import KVCacheManager, SnapshotPool
from sparrow.core.request import Request
from sparrow.core.sampling_params import SamplingParams
from sparrow.core.scheduler import Scheduler

BS = 4


def _filled(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    assert kv.allocate(rid, len(tokens))
    kv.register(rid, len(tokens), lambda a, b: tokens[a:b])
    return kv.tables[rid]


def test_full_blocks_match_by_content_and_everything_before_them():
    kv = KVCacheManager(16, BS, prefix_caching=True)
    table = _filled(kv, "a", list(range(10)))  # blocks 0-3 and 4-7 full, 8-9 partial
    assert [b for b, _ in kv.match(list(range(10)))] == table[:2]
    assert [b for b, _ in kv.match([0, 1, 2, 3, 9, 9, 9, 9])] == table[:1]
    assert kv.match([4, 5, 6, 7]) == []  # the same tokens after another prefix: no match
    assert KVCacheManager(16, BS).match(list(range(10))) == []  # caching off


def test_unreferenced_blocks_stay_cached_until_evicted_oldest_first():
    kv = KVCacheManager(4, BS, prefix_caching=True)
    first = _filled(kv, "a", list(range(8)))
    kv.free("a")
    assert kv.num_free == 4 and kv.usage == 0.0
    second = _filled(kv, "b", list(range(100, 108)))  # takes the two never-used blocks
    assert not set(second) & set(first) and len(kv.match(list(range(8)))) == 2
    kv.free("b")
    assert kv.allocate("c", 4)  # one block: evicts a's last block first (freed in reverse)
    assert len(kv.match(list(range(8)))) == 1
    assert kv.allocate("d", 12) and kv.match(list(range(8))) == []


def test_taken_blocks_are_shared_and_released_by_reference():
    kv = KVCacheManager(8, BS, prefix_caching=True)
    _filled(kv, "a", list(range(8)))
    kv.take("b", kv.match(list(range(8))))
    kv.free("a")
    assert kv.num_free == 6  # b still holds both
    kv.free("b")
    assert kv.num_free == 8 and len(kv.match(list(range(8)))) == 2


def test_uncached_blocks_are_not_matched_again():
    kv = KVCacheManager(8, BS, prefix_caching=True)
    _filled(kv, "c", list(range(8)))
    kv.uncache("c")  # what c's failed step wrote is not to be reused
    kv.free("c")
    assert kv.match(list(range(8))) == [] and kv.num_free == 8


def test_snapshots_are_filed_then_reused_least_recently_used_first():
    pool = SnapshotPool(2)
    a, b = pool.reserve(), pool.reserve()
    assert pool.reserve() is None  # both reserved, none filed
    assert pool.file(a, 10) and pool.file(b, 11)
    assert pool.find(10) == a  # 10 is now the more recently used
    c = pool.reserve()
    assert c == b and pool.find(11) is None and pool.find(10) == a
    assert not pool.file(c, 10) and pool.find(10) == a  # 10 filed already: c released
    pool.release(a)
    assert pool.find(10) is None


def _scheduler(recurrent: bool, budget: int = 64) -> Scheduler:
    cache = CacheConfig(block_size=BS, num_blocks=32, num_state_slots=4, num_state_snapshots=4)
    return Scheduler(
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=budget), cache, recurrent
    )


def _run(scheduler: Scheduler, request: Request) -> list:
    scheduler.add_request(request)
    plans = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        plans.append(plan)
        sampling = scheduler.commit(plan)
        scheduler.resolve(sampling, {rid: [7] for rid in sampling})
    return plans


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))


def test_without_recurrent_state_any_cached_block_is_a_hit():
    scheduler = _scheduler(recurrent=False)
    _run(scheduler, _request("a", list(range(11))))
    plans = _run(scheduler, _request("b", list(range(10)) + [50]))
    assert plans[0].num_scheduled_tokens == {"b": 3}  # 8 of 11 cached: two whole blocks
    assert not plans[0].restore and not plans[0].save


def _inside(plan, rid: str) -> list[int]:
    """Where the plan saves rid's states inside its chunk (tokens into the chunk)."""
    return [n for n, _ in plan.save_inside.get(rid, [])]


def test_a_prompt_saves_its_last_full_block_inside_its_chunk_and_a_repeat_resumes_there():
    scheduler = _scheduler(recurrent=True)
    first = _run(scheduler, _request("a", list(range(11))))
    assert first[0].num_scheduled_tokens == {"a": 11}  # one chunk: no step of its own
    assert _inside(first[0], "a") == [8] and not first[0].save
    again = _run(scheduler, _request("b", list(range(11))))
    assert again[0].num_scheduled_tokens == {"b": 3} and list(again[0].restore) == ["b"]
    assert not again[0].save_inside  # its last full block is where it resumed


def test_a_prompt_of_whole_blocks_resumes_a_block_before_its_end():
    """The last token is always computed: a prompt of 12 tokens saves at 8, not at 12."""
    scheduler = _scheduler(recurrent=True)
    assert _inside(_run(scheduler, _request("a", list(range(12))))[0], "a") == [8]
    again = _run(scheduler, _request("b", list(range(12))))
    assert again[0].num_scheduled_tokens == {"b": 4}


def test_a_fork_from_a_cached_prefix_saves_there_and_at_the_last_block_in_one_chunk():
    """b shares a's first two blocks, which have no snapshot (a saved at 20 and past its
    prompt): b computes from 0 and saves both where it leaves a's blocks (8) and at its last
    full block (12), in one step; a third prompt on the shared blocks then resumes at 8, and
    b's repeat at 12."""
    scheduler = _scheduler(recurrent=True)
    _run(scheduler, _request("a", list(range(23))))
    fork = _run(scheduler, _request("b", list(range(10)) + [50, 51, 52, 53, 54]))
    assert fork[0].num_scheduled_tokens == {"b": 15} and not fork[0].restore
    assert _inside(fork[0], "b") == [8, 12]
    other = _run(scheduler, _request("c", list(range(10)) + [60, 61]))
    assert other[0].num_scheduled_tokens == {"c": 4} and list(other[0].restore) == ["c"]
    repeat = _run(scheduler, _request("d", list(range(10)) + [50, 51, 52, 53, 54]))
    assert repeat[0].num_scheduled_tokens == {"d": 3}


def test_a_long_prompt_saves_in_the_chunks_that_reach_its_boundaries():
    """Chunks of 7 tokens: b forks from a's blocks at 12 (inside its second chunk) and its
    last full block is 20 (inside its third); chunk sizes stay the budget's."""
    scheduler = _scheduler(recurrent=True, budget=7)
    _run(scheduler, _request("a", list(range(23))))
    fork = _run(scheduler, _request("b", list(range(13)) + [50] * 10))
    assert [p.num_scheduled_tokens["b"] for p in fork[:4]] == [7, 7, 7, 2]
    assert [_inside(p, "b") for p in fork[:4]] == [[], [5], [6], []]
    other = _run(scheduler, _request("c", list(range(13)) + [60] * 5))
    assert other[0].num_scheduled_tokens == {"c": 6} and list(other[0].restore) == ["c"]
    repeat = _run(scheduler, _request("d", list(range(13)) + [50] * 10))
    assert repeat[0].num_scheduled_tokens == {"d": 3}


def test_a_boundary_where_a_chunk_ends_is_saved_after_the_step():
    scheduler = _scheduler(recurrent=True, budget=8)
    first = _run(scheduler, _request("a", list(range(11))))
    assert first[0].num_scheduled_tokens == {"a": 8}
    assert list(first[0].save) == ["a"] and not first[0].save_inside
    assert _run(scheduler, _request("b", list(range(11))))[0].num_scheduled_tokens == {"b": 3}


def test_the_snapshot_pool_stays_bounded_under_many_distinct_prompts():
    """Every prompt saves; the pool's four snapshots are reused least recently used first,
    and none is left reserved once the requests are done."""
    scheduler = _scheduler(recurrent=True)
    for i in range(20):
        _run(scheduler, _request(f"r{i}", [100 + i] + list(range(10))))
        pool = scheduler.snapshots
        assert pool.num_filed <= 4 and pool.num_filed + pool.num_free == 4
    assert _run(scheduler, _request("again", [119] + list(range(10))))[0].restore
    assert not _run(scheduler, _request("evicted", [100] + list(range(10))))[0].restore


def test_media_placeholders_match_only_the_same_media():
    """Two prompts whose image placeholders are the same pad tokens share cached blocks only
    where the images' digests agree: here the image starts in block 0, so a different image
    matches nothing."""
    from sparrow.core.request import MediaSpan

    prompt = [1, 2, 3] + [9] * 8 + [4, 5, 6, 7, 8, 0]  # an image of 8 tokens at 3..10

    def request(rid: str, digest: str) -> Request:
        return Request(
            rid,
            list(prompt),
            SamplingParams(max_tokens=2, ignore_eos=True),
            media=(MediaSpan(3, 8, digest),),
        )

    assert request("x", "cat").cache_key_ids(2, 5) == [3, ("cat", 0), ("cat", 1)]
    scheduler = _scheduler(recurrent=False)
    _run(scheduler, request("a", "cat"))
    assert _run(scheduler, request("b", "dog"))[0].num_scheduled_tokens == {"b": 17}
    assert _run(scheduler, request("c", "cat"))[0].num_scheduled_tokens == {"c": 1}  # 4 blocks
