"""Prompt logprobs and skip_special_tokens in the offline engine, on the built-in default
model: the prompt's logprobs, ranks and top tokens equal log_softmax over one plain forward of
the whole prompt, however the prompt is chunked, batched or preempted, and with its prefix
already cached; a request that keeps special tokens gets their text."""

import dataclasses

import pytest
import torch

from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.worker.cache import build_metadata
from sparrow.worker.sequences import SequenceBatch

SOURCE = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nclass Point:\n"
    "    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
)
TOP = 3


@pytest.fixture(scope="module")
def llm():
    return LLM(block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def prompts(llm):
    ids = llm.tokenizer.encode(SOURCE)
    return [ids[:61], ids[:37] + ids[-9:], ids[5:6], ids[:45]]


def reference(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the logits of every prompt position, from one forward [P, V] fp64."""
    hidden = SequenceBatch(llm.model, 1, len(prompt)).forward([prompt])
    return torch.log_softmax(llm.model.logits(hidden).double(), dim=-1)


def check(entries, llm: LLM, prompt: list[int], tol: float = 1e-4) -> None:
    assert len(entries) == len(prompt) - 1
    ref = reference(llm, prompt)
    for p, e in enumerate(entries):
        row, target = ref[p], prompt[p + 1]
        assert e.token.token_id == target
        assert e.token.logprob == pytest.approx(row[target].item(), abs=tol)
        above = (row - row[target]).tolist()  # ties within rounding may go either way
        assert sum(d > tol for d in above) < e.token.rank <= 1 + sum(d > -tol for d in above)
        best = torch.topk(row, TOP)
        assert [t.token_id for t in e.top] == best.indices.tolist()
        assert [t.rank for t in e.top] == list(range(1, TOP + 1))
        assert [t.logprob for t in e.top] == pytest.approx(best.values.tolist(), abs=tol)
        assert e.token.text == llm.tokenizer.decode([target])


@pytest.mark.parametrize(
    "settings",
    [
        {},  # each prompt whole in one step
        {"max_num_batched_tokens": 16},  # prompts chunked, chunks of several prompts in a step
        {"num_blocks": 6, "max_num_batched_tokens": 32},  # preempted inside their prompts
    ],
)
def test_prompt_logprobs_equal_a_whole_prompt_forward(prompts, settings):
    llm = LLM(block_size=16, **({"num_blocks": 64} | settings))
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    params = [greedy, dataclasses.replace(greedy, prompt_logprobs=TOP)] * 2
    outs = llm.generate(prompts, params)
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check(out.prompt_logprobs, llm, prompt)
    plain = LLM(block_size=16).generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert not llm.runner.prompt_logprobs  # nothing kept once they are given out


@pytest.mark.gpu
def test_prompt_logprobs_on_cuda(prompts):
    """The kernel path (fp32 activations: the comparison stays exact to rounding), prompts
    chunked and batched as above."""
    llm = LLM(
        block_size=16, num_blocks=64, max_num_batched_tokens=16, device="cuda", dtype="float32"
    )
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    for out, prompt in zip(llm.generate(prompts, params), prompts, strict=True):
        check(out.prompt_logprobs, llm, prompt, tol=2e-3)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(llm, prompts):
    """The next turn of a conversation (its prompt: the last prompt and output, whose state
    snapshot the cache holds) computes its whole prompt when it asks for prompt logprobs."""
    first = llm.generate([prompts[3]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    prompt = prompts[3] + first.token_ids + prompts[1][:5]
    kv = llm.scheduler.kv
    hits = kv.hits
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    )[0]
    assert kv.hits == hits  # no cached block taken
    check(out.prompt_logprobs, llm, prompt)
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    assert kv.hits - hits == 64  # without prompt logprobs the same prompt starts 4 blocks in


class EagerPrefillGraphs:
    """The runner's prefill graphs' stand-in on the CPU: the same call (one prompt from its
    start, the last row's logits back), run eagerly; records the prompt lengths it ran."""

    def __init__(self, llm: LLM):
        self.model, self.cache, self.ran = llm.model, llm.runner.cache, []

    def size_for(self, num_tokens: int) -> int:
        return num_tokens

    def run(self, tokens: list[int], block_table: list[int], state_slot: int, saves=None):
        assert saves is None  # prefix caching is off: no states saved inside the prompt
        self.ran.append(len(tokens))
        meta = build_metadata(
            [tokens], [0], [block_table], [state_slot], self.cache.block_size, self.model.device
        )
        return self.model.logits(self.model(meta, self.cache)[-1:])


def test_prompt_logprobs_take_the_eager_path_past_prefill_graphs(prompts):
    llm = LLM(block_size=16, enable_prefix_caching=False)
    llm.runner.prefill_graphs = graphs = EagerPrefillGraphs(llm)
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    plain = llm.generate([prompts[0]], greedy)[0]
    assert graphs.ran == [len(prompts[0])]
    asked = llm.generate([prompts[0]], dataclasses.replace(greedy, prompt_logprobs=TOP))[0]
    assert graphs.ran == [len(prompts[0])]  # not through the graph
    assert asked.token_ids == plain.token_ids
    check(asked.prompt_logprobs, llm, prompts[0])


def test_prompt_logprobs_zero_gives_the_prompt_token_alone(llm, prompts):
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert all(e.top == () and e.token.rank >= 1 for e in out.prompt_logprobs)
    one = llm.generate([prompts[2]], SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
    assert one.prompt_logprobs == []  # a one-token prompt: nothing predicts its token


def test_special_tokens_stay_in_the_text_when_kept(llm):
    """Tokens forced by logit_bias: special ones (`<|im_start|>`; `<think>`, which this
    tokenizer marks special) vanish from the text by default and stay when kept; the stop
    token's text is never output."""
    tok = llm.tokenizer
    start, think, end = (tok.token_id(t) for t in ("<|im_start|>", "<think>", "<|im_end|>"))
    prompt = tok.encode("x = 1\n")
    forced = SamplingParams(max_tokens=3, logit_bias=((start, 100.0),), ignore_eos=True)
    kept = SamplingParams(
        max_tokens=3, logit_bias=((start, 100.0),), ignore_eos=True, skip_special_tokens=False
    )
    skipped, shown = llm.generate([prompt, prompt], [forced, kept])
    assert skipped.token_ids == shown.token_ids == [start] * 3
    assert skipped.text == "" and shown.text == "<|im_start|>" * 3
    think_kept = SamplingParams(
        max_tokens=2, logit_bias=((think, 100.0),), ignore_eos=True, skip_special_tokens=False
    )
    assert llm.generate([prompt], think_kept)[0].text == "<think>" * 2
    stop = SamplingParams(max_tokens=3, logit_bias=((end, 100.0),), skip_special_tokens=False)
    out = llm.generate([prompt], stop)[0]
    assert out.token_ids == [end] and out.text == ""
