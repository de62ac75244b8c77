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


def test_recurrent_hits_resume_from_snapshots_cut_where_the_prefix_forks():
    scheduler = _scheduler(recurrent=True)
    _run(scheduler, _request("a", list(range(11))))
    fork = _run(scheduler, _request("b", list(range(10)) + [50]))
    assert fork[0].num_scheduled_tokens == {"b": 8}  # no snapshot yet: cut at the fork
    assert list(fork[0].save) == ["b"]
    again = _run(scheduler, _request("c", list(range(10)) + [60, 61]))
    assert again[0].num_scheduled_tokens == {"c": 4} and list(again[0].restore) == ["c"]


def test_a_fork_past_the_first_chunk_ends_its_chunk_and_saves_a_snapshot():
    scheduler = _scheduler(recurrent=True, budget=7)
    _run(scheduler, _request("a", list(range(23))))
    fork = _run(scheduler, _request("b", list(range(21)) + [50, 51]))
    assert [p.num_scheduled_tokens["b"] for p in fork[:4]] == [7, 7, 6, 3]  # fork at 20
    assert [list(p.save) for p in fork[:3]] == [[], [], ["b"]]
    again = _run(scheduler, _request("c", list(range(21)) + [60]))
    assert again[0].num_scheduled_tokens == {"c": 2} and list(again[0].restore) == ["c"]


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
