"""Automatic prefix caching through the engine (CPU, fp32): greedy outputs equal those of
an engine without the cache, for an attention-only model (MiniMax M3: any cached block is a
hit) and a hybrid one (Qwen3.6: a hit resumes the Gated DeltaNet state from a snapshot),
with hits in the middle of a block, partial last blocks, eviction under pressure, a hit
whose source request still runs, and aborted requests releasing their references. A hybrid
prompt leaves a snapshot at its last full block, taken inside the scan (reference path and
Triton kernels): its first repeat hits, on the built-in checkpoint too."""

import pytest
import torch

from sparrow import assets
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.kernels import get_backend, set_backend
from sparrow.loader.random_checkpoint import PRESETS, random_model
from tests.conftest import rel_err

MODELS = {
    "qwen3_5_moe": PRESETS["qwen3.6-tiny"].replace(vocab_size=320, initializer_range=0.1),
    "minimax_m3": PRESETS["minimax-m3-tiny"].replace(
        vocab_size=320, initializer_range=0.1, index_block_size=16
    ),
}
BLOCK = 16
SHARED = [(7 * i + 3) % 320 for i in range(3 * BLOCK + 5)]  # 3 blocks and part of a 4th
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return random_model(MODELS[request.param], seed=5, device="cpu", dtype=torch.float32)


def _engine(model, caching: bool, **settings) -> LLM:
    return LLM(
        model,
        **(
            {
                "block_size": BLOCK,
                "num_blocks": 64,
                "max_num_batched_tokens": 256,
                "enable_prefix_caching": caching,
            }
            | settings
        ),
    )


def _turns() -> list[list[int]]:
    """Prompts that share prefixes: a fork mid-block, a repeat, a longer prompt."""
    return [
        SHARED + [1, 2, 3],
        SHARED + [9, 8],
        SHARED + [1, 2, 3],
        SHARED[:20],
        SHARED + [1, 2, 3] + list(range(40, 80)),
    ]


def _one_by_one(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_hits_give_the_tokens_of_a_run_without_the_cache(model):
    expected = _one_by_one(_engine(model, False), _turns())
    llm = _engine(model, True)
    assert _one_by_one(llm, _turns()) == expected
    assert llm.scheduler.prefix_hit_rate > 0.3


def test_the_next_turn_of_a_conversation_resumes_from_the_last_one(model):
    """Turn 2 = turn 1's prompt + its output + new tokens: with recurrent layers it resumes
    from the state snapshot saved while turn 1 decoded."""
    plain, cached = _engine(model, False), _engine(model, True)
    params = SamplingParams(max_tokens=2 * BLOCK, ignore_eos=True)
    first = SHARED
    out = cached.generate([first], params)[0].token_ids
    assert out == plain.generate([first], params)[0].token_ids
    second = first + out + [5, 6, 7]
    hits = cached.scheduler.kv.hits
    assert (
        cached.generate([second], GREEDY)[0].token_ids
        == plain.generate([second], GREEDY)[0].token_ids
    )
    assert cached.scheduler.kv.hits - hits >= (len(first) + BLOCK) // BLOCK * BLOCK


def test_a_shared_prefix_longer_than_a_chunk_is_resumed_where_prompts_fork(model):
    """Prompts that leave a cached prefix past their first chunk (conversations on one long
    system prompt): the chunk that reaches the fork saves the state there, and the next
    prompt on that prefix resumes from it."""
    prefix = [(5 * i + 1) % 320 for i in range(5 * BLOCK + 7)]
    prompts = [prefix + [1, 2, 3], prefix + [4, 5], prefix + [6]]
    expected = _one_by_one(_engine(model, False, max_num_batched_tokens=2 * BLOCK), prompts)
    llm = _engine(model, True, max_num_batched_tokens=2 * BLOCK)
    outputs, hits = [], []
    for prompt in prompts:
        before = llm.scheduler.kv.hits
        outputs += _one_by_one(llm, [prompt])
        hits.append(llm.scheduler.kv.hits - before)
    assert outputs == expected
    assert hits[2] == 5 * BLOCK


def test_a_hit_on_a_request_that_still_runs(model):
    plain, cached = _engine(model, False), _engine(model, True)
    long = SamplingParams(max_tokens=12, ignore_eos=True)
    first = cached.add_request(SHARED + [1, 2], long)
    for _ in range(3):
        cached.step()  # first's prompt is in the cache; it decodes on
    second = cached.add_request(SHARED + [4], GREEDY)
    outputs: dict[str, list[int]] = {first.request_id: [], second.request_id: []}
    while cached.has_unfinished():
        for out in cached.step():
            outputs[out.request_id] += out.new_token_ids
    assert first.output_token_ids == plain.generate([SHARED + [1, 2]], long)[0].token_ids
    assert second.output_token_ids == plain.generate([SHARED + [4]], GREEDY)[0].token_ids


def test_eviction_under_pressure_keeps_outputs_exact(model):
    """Few blocks: cached blocks are evicted to admit new prompts."""
    prompts = _turns() + [list(range(100, 160)), SHARED + [1, 2, 3]]
    expected = _one_by_one(_engine(model, False, num_blocks=12), prompts)
    llm = _engine(model, True, num_blocks=12)
    assert _one_by_one(llm, prompts) == expected
    assert llm.scheduler.kv.num_free == 12


def test_aborted_requests_release_their_blocks(model):
    llm = _engine(model, True)
    llm.generate([SHARED], GREEDY)
    request = llm.add_request(SHARED + [3, 4], SamplingParams(max_tokens=30, ignore_eos=True))
    llm.step()
    llm.step()
    llm.abort(request.request_id)
    while llm.has_unfinished():
        llm.step()
    assert llm.scheduler.kv.num_free == 64 and llm.scheduler.kv.usage == 0.0
    assert (
        llm.generate([SHARED + [3, 4]], GREEDY)[0].token_ids
        == _engine(model, False).generate([SHARED + [3, 4]], GREEDY)[0].token_ids
    )


@pytest.fixture(scope="module")
def hybrid():
    return random_model(MODELS["qwen3_5_moe"], seed=5, device="cpu", dtype=torch.float32)


@pytest.fixture
def kernels():
    previous = get_backend()
    yield set_backend
    set_backend(previous)


def _hits(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens the prefix cache gave)."""
    before = llm.scheduler.kv.hits
    return llm.generate([prompt], params)[0].token_ids, llm.scheduler.kv.hits - before


@pytest.mark.parametrize(
    "path, budget",
    [("reference", 256), ("reference", 40), ("triton", 256)],
)
def test_a_snapshot_taken_inside_the_scan_equals_a_prefill_to_its_boundary(
    hybrid, kernels, path, budget
):
    """101 tokens: the last full block ends at 96, inside the prompt's one chunk (mid-way
    through a 64-token chunk of the scan), or with chunks of 40 inside the last one (16
    tokens into it). The conv and recurrent states saved there equal those of a prompt of
    its first 96 tokens; the first repeat resumes there."""
    kernels(path)
    prompt = [(11 * i + 5) % 320 for i in range(6 * BLOCK + 5)]
    llm = _engine(hybrid, True, max_num_batched_tokens=budget)
    first, hits = _hits(llm, prompt)
    assert hits == 0
    cut = 6 * BLOCK
    snapshot = llm.scheduler.snapshots.find(llm.scheduler.kv.match(prompt)[cut // BLOCK - 1][1])
    assert snapshot is not None
    plain = _engine(hybrid, False)
    plain.generate([prompt[:cut]], SamplingParams(max_tokens=1))  # into state slot 0
    layers = zip(llm.runner.cache.snapshots, plain.runner.cache.layers, strict=True)
    recurrent = [(saved, pools) for saved, pools in layers if saved is not None]
    assert recurrent
    for snapshots, pools in recurrent:
        for snap, pool in zip(snapshots, pools, strict=True):
            assert rel_err(snap[snapshot], pool[0]) < 1e-5
    assert _hits(llm, prompt) == (first, cut)
    assert (
        first
        == _engine(hybrid, False, max_num_batched_tokens=budget)
        .generate([prompt], GREEDY)[0]
        .token_ids
    )


@pytest.fixture(scope="module")
def builtin_plain():
    return LLM(assets.default_checkpoint(), enable_prefix_caching=False)


LONG = [(37 * i + 11) % 4000 + 3 for i in range(2415)]  # 18 blocks of 128 and 111 tokens


@pytest.mark.parametrize("budget", [None, 1000])
def test_the_first_repeat_of_a_long_prompt_hits_every_full_block(builtin_plain, budget):
    """The built-in checkpoint (blocks of 128): the second of two identical 2,415-token
    prompts resumes at 2,304, prefilled whole or in chunks of 1,000 (the snapshot then
    inside the last chunk); greedy tokens equal an engine's without the cache."""
    settings = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(assets.default_checkpoint(), enable_prefix_caching=True, **settings)
    expected = builtin_plain.generate([LONG], GREEDY)[0].token_ids
    assert _hits(llm, LONG) == (expected, 0)
    assert _hits(llm, LONG) == (expected, 18 * 128)
    stats = llm.stats()
    assert stats.prefix_hit_rate == pytest.approx(18 * 128 / (2 * len(LONG)))
    assert 0 < stats.state_snapshots <= llm.cache_config.num_state_snapshots


def test_conversations_on_a_shared_system_prompt(builtin_plain):
    """Three prompts share a 600-token system prompt (4 whole blocks) and differ after it.
    The first saves its last full block only: nothing tells it where later prompts will
    part from it. The second shares its first 4 blocks but has no snapshot there, so it hits
    nothing and saves one there (and at its own last block); the third resumes at 512."""
    system = [(13 * i + 7) % 4000 + 3 for i in range(600)]
    prompts = [system + [(17 * i + 29 * k) % 4000 + 3 for i in range(300)] for k in (1, 2, 3)]
    llm = LLM(assets.default_checkpoint(), enable_prefix_caching=True)
    results = [_hits(llm, p) for p in prompts]
    assert [hits for _, hits in results] == [0, 0, 512]
    assert [out for out, _ in results] == [
        builtin_plain.generate([p], GREEDY)[0].token_ids for p in prompts
    ]
