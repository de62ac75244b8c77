"""Automatic prefix caching through the engine (CPU, fp32): greedy outputs equal those of
an engine without the cache, for an attention-only model (MiniMax M3: any cached block is a
hit) and a hybrid one (Qwen3.6: a hit resumes the Gated DeltaNet state from a snapshot),
with hits in the middle of a block, partial last blocks, eviction under pressure, a hit
whose source request still runs, and aborted requests releasing their references."""

import pytest
import torch

from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.loader.random_checkpoint import PRESETS, random_model

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
