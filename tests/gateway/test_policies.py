"""Routing policies: each picks as specified, cache-aware keeps a shared prefix on one worker
while loads are balanced and falls back to least-load when they are not."""

import pytest

from sparrow.gateway.policies import (
    BLOCK,
    CacheAware,
    Candidate,
    LeastLoad,
    PowerOfTwo,
    PrefixBlocks,
    RoundRobin,
    make_policy,
)

WORKERS = [Candidate("a", 3), Candidate("b", 1), Candidate("c", 2)]


def test_round_robin_goes_in_turn():
    policy = RoundRobin()
    assert [policy.choose(WORKERS, []).name for _ in range(7)] == list("abcabca")


def test_least_load_takes_the_lowest_first_listed_on_ties():
    assert LeastLoad().choose(WORKERS, []).name == "b"
    assert LeastLoad().choose([Candidate("x", 2), Candidate("y", 2)], []).name == "x"


def test_power_of_two_takes_the_lower_of_two_draws():
    policy = PowerOfTwo(seed=0)
    picks = [policy.choose(WORKERS, []).name for _ in range(300)]
    assert "a" not in picks  # the busiest loses every pair it is drawn in
    assert {"b", "c"} == set(picks)
    assert policy.choose([Candidate("only", 9)], []).name == "only"


def test_prefix_blocks_match_whole_leading_blocks_only():
    tree = PrefixBlocks(max_blocks=100)
    prompt = list(range(50))  # 3 whole blocks of 16
    tree.insert(PrefixBlocks.keys(prompt))
    assert tree.matched(PrefixBlocks.keys(prompt)) == 3
    assert tree.matched(PrefixBlocks.keys(prompt[:40] + [999] * 10)) == 2
    assert tree.matched(PrefixBlocks.keys([999] + prompt)) == 0  # keyed by what precedes
    assert len(PrefixBlocks.keys(prompt[: BLOCK - 1])) == 0


def test_prefix_blocks_evict_the_least_recently_used():
    tree = PrefixBlocks(max_blocks=4)
    old, new = list(range(32)), list(range(100, 164))
    tree.insert(PrefixBlocks.keys(old))
    tree.insert(PrefixBlocks.keys(new))
    assert len(tree) == 4
    assert tree.matched(PrefixBlocks.keys(old)) == 0
    assert tree.matched(PrefixBlocks.keys(new)) == 4


def test_cache_aware_sends_a_repeated_prefix_to_the_same_worker():
    policy = CacheAware()
    workers = [Candidate("a", 0), Candidate("b", 0)]
    shared = list(range(200))
    first = policy.choose(workers, shared + [1, 2, 3])
    policy.routed(first.name, shared + [1, 2, 3])
    for tail in ([7], [8, 9], list(range(500, 520))):
        assert policy.choose(workers, shared + tail).name == first.name
    # an unrelated prompt goes to the worker with the emptier tree
    other = policy.choose(workers, list(range(1000, 1100)))
    assert other.name != first.name


def test_cache_aware_falls_back_to_least_load_when_unbalanced():
    policy = CacheAware(balance_abs=32, balance_rel=1.1)
    prompt = list(range(100))
    policy.routed("a", prompt)
    assert policy.choose([Candidate("a", 10), Candidate("b", 0)], prompt).name == "a"
    assert policy.choose([Candidate("a", 40), Candidate("b", 0)], prompt).name == "b"


def test_cache_aware_forgets_a_restarted_worker():
    policy = CacheAware()
    prompt = list(range(100))
    policy.routed("a", prompt)
    policy.forget("a")
    assert policy.choose([Candidate("b", 0), Candidate("a", 0)], prompt).name == "b"


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random_walk")
