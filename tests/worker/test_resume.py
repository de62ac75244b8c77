"""Resumable sampling on the built-in default model: a request re-submitted as its prompt +
its first k tokens, with `output_offset=k`, the budget left and the same seed, continues
token for token (logprob for logprob) as the undisturbed run, at every split point; a
seeded request draws the same in any batch; an unseeded one still samples its
distribution."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparrow.core.request import FinishReason
from sparrow.core.sampling_params import SamplingParams, TokenLogprob
from sparrow.core.structured import GrammarSpec
from sparrow.engine.llm import LLM
from sparrow.worker.sequences import SequenceBatch

N = 16  # tokens of the undisturbed run
TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time"
STOP = 319  # a token the model samples now and then; biased up to end some runs early


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    return llm.tokenizer.encode(TEXT)


def run(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> list[tuple[list[int], list[TokenLogprob], FinishReason]]:
    """(tokens, their logprobs, finish reason) of each prompt, all in one batch."""
    rids = [llm.add_request(p, sp).request_id for p, sp in zip(prompts, params, strict=True)]
    tokens = {rid: [] for rid in rids}
    logprobs = {rid: [] for rid in rids}
    finish = {}
    while llm.has_unfinished():
        for out in llm.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    return [(tokens[r], logprobs[r], finish[r]) for r in rids]


def assert_resumes(llm: LLM, prompt: list[int], params: SamplingParams, full) -> None:
    """Each split k of the run `full` (tokens, logprobs, finish), resumed in one batch,
    gives the rest of it."""
    out, logprobs, finish = full
    splits = range(1, len(out))
    resumed = run(
        llm,
        [prompt + out[:k] for k in splits],
        [replace(params, max_tokens=params.max_tokens - k, output_offset=k) for k in splits],
    )
    for k, (tokens, lps, reason) in zip(splits, resumed, strict=True):
        assert tokens == out[k:], k
        assert reason == finish, k
        for got, want in zip(lps, logprobs[k:], strict=True):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4), k
            assert [t for t, _ in got.top] == [t for t, _ in want.top], k
            assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-4)


def test_every_split_of_a_sampled_stream_continues_it(llm, prompt):
    """Temperature, top-p, top-k, min-p, the three penalties, logit biases, min_tokens, a
    stop token and logprobs together. The seed is the first of 64 whose run samples the
    stop token as its 16th token: min_tokens (6) bars it in the first six, so a resumed
    run must count its earlier tokens toward min_tokens as toward the penalties."""
    params = SamplingParams(
        max_tokens=N,
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        min_p=0.02,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        logit_bias=((STOP, 2.5), (315, -100.0)),
        min_tokens=6,
        stop_token_ids=(STOP,),
        logprobs=3,
    )
    seeded = [replace(params, seed=s) for s in range(64)]
    runs = run(llm, [prompt] * len(seeded), seeded)
    ends = [i for i, (out, _, _) in enumerate(runs) if len(out) == N and out[-1] == STOP]
    assert ends, "no seed samples the stop token as its last token: pick another bias"
    full = runs[ends[0]]
    assert full[2] is FinishReason.STOP and min(len(o) for o, _, _ in runs) > 6
    assert_resumes(llm, prompt, seeded[ends[0]], full)


def test_every_split_of_a_grammar_stream_continues_it(llm, prompt):
    """A JSON schema whose string outlasts 16 tokens: the resumed grammar is replayed
    through the earlier tokens (without replay it would ask for the opening brace again)."""
    schema = {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 400}},
        "required": ["story"],
    }
    params = SamplingParams(
        max_tokens=N,
        temperature=0.8,
        top_p=0.95,
        seed=7,
        logprobs=2,
        grammar=GrammarSpec.json_schema(schema),
    )
    (full,) = run(llm, [prompt], [params])
    assert len(full[0]) == N and full[2] is FinishReason.LENGTH
    assert llm.tokenizer.decode(full[0]).startswith('{"story":')
    assert_resumes(llm, prompt, params, full)


def test_a_seeded_request_draws_the_same_alone_and_in_a_batch(llm, prompt):
    params = SamplingParams(max_tokens=N, temperature=1.0, top_p=0.95, seed=2**64 - 5)
    (alone,) = run(llm, [prompt], [params])
    others = [
        SamplingParams(max_tokens=N),
        SamplingParams(max_tokens=9, temperature=0.7, seed=2**64 - 5 + 1),
        SamplingParams(max_tokens=N, temperature=1.2, top_k=5),
        SamplingParams(max_tokens=5, temperature=0.9, presence_penalty=1.0),
    ]
    prompts = [prompt[3:], prompt + prompt[:7], prompt[:11], prompt[1:]]
    batch = run(llm, [prompts[0], prompt, *prompts[1:]], [others[0], params, *others[1:]])
    assert batch[1][0] == alone[0]


def test_unseeded_requests_sample_their_distribution(llm, prompt):
    """400 unseeded one-token requests with top-k 4 land on the 4 best tokens in
    proportion to their probabilities (within 5 standard deviations); two unseeded runs
    differ."""
    n = 400
    one = SamplingParams(max_tokens=1, temperature=1.0, top_k=4, ignore_eos=True)
    picked = [tokens[0] for tokens, _, _ in run(llm, [prompt] * n, [one] * n)]
    with torch.inference_mode():
        hidden = SequenceBatch(llm.model, 1, len(prompt)).forward([prompt])
        logits = llm.model.logits(hidden[-1:])[0].double()
    best = logits.topk(4)
    expected = torch.softmax(best.values, -1)
    counts = torch.tensor([picked.count(int(t)) for t in best.indices], dtype=torch.float64)
    assert counts.sum() == n
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((counts / n - expected).abs() < 5 * sigma).all(), (counts, expected)
    free = SamplingParams(max_tokens=N, temperature=1.0, ignore_eos=True)
    a, b = run(llm, [prompt, prompt], [free, free])
    assert a[0] != b[0]


def test_output_offset_is_validated(llm, prompt):
    with pytest.raises(ValueError, match="output_offset"):
        llm.make_request(prompt, SamplingParams(output_offset=len(prompt) + 1))
    with pytest.raises(ValueError, match="output_offset"):
        SamplingParams(output_offset=-1)
    request = llm.make_request(prompt, SamplingParams(output_offset=len(prompt)))
    assert request.params.output_offset == len(prompt)
