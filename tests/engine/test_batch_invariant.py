"""Batch-invariant mode on the built-in model (CPU, fp32): a request's logits are the same bits
alone and among other requests of other lengths, with its prompt in one step or in chunks of
7 tokens, decoded or recomputed as a prompt (a resumed stream's re-prefill), and from a
prefix-cache hit (cached K/V and a recurrent-state snapshot) or computed whole."""

import pytest
import torch

from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.worker.model_runner import _output_position

SOURCE = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nclass Point:\n"
    "    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
)
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def engine(**settings) -> LLM:
    settings = {"block_size": 16, "num_blocks": 96, "enable_prefix_caching": False} | settings
    return LLM(device="cpu", dtype="float32", batch_invariant=True, **settings)


class Logits:
    """Every row an engine samples from, by (prompt, output position): the runner's logits
    before penalties (none here) and sampling."""

    def __init__(self, llm: LLM):
        self.rows: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        runner, inner = llm.runner, llm.runner._penalized

        def spy(logits, done, params, requests, plan):
            for row, rid in enumerate(done):
                req = requests[rid]
                key = (tuple(req.prompt_token_ids), _output_position(req))
                self.rows[key] = logits[row].clone()
            return inner(logits, done, params, requests, plan)

        runner._penalized = spy

    def of(self, prompt: list[int]) -> list[torch.Tensor]:
        """The prompt's rows by output position."""
        found = sorted((pos, row) for (p, pos), row in self.rows.items() if p == tuple(prompt))
        return [row for _, row in found]


@pytest.fixture(scope="module")
def ids():
    return LLM(device="cpu", dtype="float32").tokenizer.encode(SOURCE)


def assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) > 0
    for pos, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"output position {pos}: {(a - b).abs().max().item()}"


def test_a_request_alone_and_in_a_batch(ids):
    llm = engine()
    seen = Logits(llm)
    prompt = ids[3:40]
    alone = llm.generate([prompt], GREEDY)[0]
    first = seen.of(prompt)
    seen.rows.clear()
    others = [ids[i : i + n] for i, n in enumerate((1, 5, 9, 16, 17, 30, 52, 61))]
    params = [SamplingParams(max_tokens=6 + i, seed=i, temperature=0.9) for i in range(8)]
    outs = llm.generate(others[:5] + [prompt] + others[5:], params[:5] + [GREEDY] + params[5:])
    assert outs[5].token_ids == alone.token_ids
    assert_same_bits(seen.of(prompt), first)


def test_a_prompt_whole_and_in_chunks_of_7(ids):
    prompt = ids[:45]
    runs = []
    for settings in ({}, {"max_num_batched_tokens": 7}):
        llm = engine(**settings)
        seen = Logits(llm)
        llm.generate([prompt], GREEDY)
        runs.append(seen.of(prompt))
    assert_same_bits(runs[1], runs[0])


def test_decoded_tokens_against_their_recomputation(ids):
    """A resumed stream re-prefills prompt + its tokens so far: the logits after k decoded
    tokens equal those of prompt + those k tokens, prefilled."""
    llm = engine()
    seen = Logits(llm)
    prompt = ids[10:33]
    out = llm.generate([prompt], GREEDY)[0]
    decoded = seen.of(prompt)
    for k in (1, 4, 9):
        resumed = prompt + out.token_ids[:k]
        again = llm.generate([resumed], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        assert again.token_ids == out.token_ids[k : k + 1]
        assert_same_bits(seen.of(resumed)[:1], decoded[k : k + 1])


def test_a_prefix_cache_hit_against_computing_whole(ids):
    """The second prompt shares 32 tokens (two blocks) with the first: it resumes from their
    K/V and the recurrent state filed there, and gives the bits of an engine without a cache."""
    first, second = ids[:40], ids[:32] + ids[50:61]
    cached = engine(enable_prefix_caching=True)
    seen = Logits(cached)
    cached.generate([first], GREEDY)
    cached.generate([second], GREEDY)
    assert cached.scheduler.prefix_hit_rate > 0
    whole = engine()
    reference = Logits(whole)
    whole.generate([second], GREEDY)
    assert_same_bits(seen.of(second), reference.of(second))


def test_seeded_sampling_alone_and_in_a_batch(ids):
    llm = engine()
    prompt = ids[:20]
    params = SamplingParams(max_tokens=12, seed=7, temperature=1.0, top_p=0.9)
    alone = llm.generate([prompt], params)[0].token_ids
    outs = llm.generate([ids[5:50], prompt, ids[2:4]], [GREEDY, params, GREEDY])
    assert outs[1].token_ids == alone
