"""The model runner on the CPU with the built-in tiny model, driven by hand-made plans:
prompts (whole or in chunks), decode steps, tokens still pending on the device, slot resets,
logprobs, seeded sampling; against the plain SequenceBatch greedy loop."""

import pytest
import torch

from sparrow.core.request import Request
from sparrow.core.sampling_params import SamplingParams
from sparrow.core.scheduler import SchedulerOutput
from sparrow.engine.llm import LLM
from sparrow.worker.sequences import SequenceBatch

GREEDY = SamplingParams(max_tokens=64, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint), device="cpu", dtype=torch.float32)


def reference(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens [steps] from the plain loop, and the log-probs [steps, V] they came from."""
    batch = SequenceBatch(model, 1, len(prompt) + steps)
    tokens, rows = [], []
    with torch.inference_mode():
        logits = model.logits(batch.forward([prompt])[-1:])
        for _ in range(steps):
            rows.append(torch.log_softmax(logits[0], -1))
            tokens.append(int(logits[0].argmax()))
            logits = model.logits(batch.forward([[tokens[-1]]]))
    return tokens, torch.stack(rows)


class Driver:
    """Plays the scheduler's part for hand-made plans: each request has a fixed block table
    and state slot; `launch` runs a plan and counts its tokens (a request whose input is
    complete gets a pending token), `resolve` hands a launched step's tokens to the host."""

    def __init__(self, runner, tables: dict[str, list[int]], slots: dict[str, int]):
        self.runner, self.tables, self.slots = runner, tables, slots
        self.requests: dict[str, Request] = {}
        self.logprobs: dict[str, list] = {}

    def add(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        self.requests[rid] = Request(rid, list(prompt), params)
        self.logprobs[rid] = []

    def launch(self, plan: dict[str, int], new: tuple[str, ...] = ()):
        out = SchedulerOutput(
            dict(plan),
            new_request_ids=list(new),
            block_tables={r: self.tables[r] for r in plan},
            state_slots={r: self.slots[r] for r in plan},
        )
        launched = self.runner.execute(out, self.requests)
        for rid, n in plan.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            if request.num_computed_tokens == request.num_tokens:
                request.num_pending += 1
        return launched

    def resolve(self, launched) -> dict[str, list[int]]:
        tokens = launched.tokens()
        for rid, new in tokens.items():
            request = self.requests[rid]
            request.num_pending -= 1
            request.output_token_ids += new
            if rid in launched.logprobs:
                self.logprobs[rid].append(launched.logprobs[rid])
        return tokens

    def step(self, plan: dict[str, int], new: tuple[str, ...] = ()) -> dict[str, list[int]]:
        launched = self.launch(plan, new)
        return {} if launched is None else self.resolve(launched)

    def outputs(self, rid: str) -> list[int]:
        return self.requests[rid].output_token_ids


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_logprobs(got, expected: torch.Tensor, tokens: list[int]) -> None:
    assert [lp.token_id for lp in got] == tokens
    for lp, row in zip(got, expected, strict=True):
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        best = row.topk(3)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_prompt_then_decode_matches_reference(engine):
    """One prompt across a block boundary, in non-contiguous blocks listed out of order, then
    decode steps resolved one at a time."""
    runner, vocab = engine.runner, engine.model.config.vocab_size
    bs = runner.cache.block_size
    prompt = _prompt(bs + 22, 0, vocab)
    expected, logprobs = reference(engine.model, prompt, 6)
    drive = Driver(runner, {"a": [5, 2]}, {"a": 3})
    drive.add("a", prompt)
    assert drive.step({"a": len(prompt)}, new=("a",)) == {"a": [expected[0]]}
    for _ in range(5):
        drive.step({"a": 1})
    assert drive.outputs("a") == expected
    _check_logprobs(drive.logprobs["a"], logprobs, expected)
    assert int(runner.next_tokens[3]) == expected[-1]  # the last token, kept on the device


def test_pending_tokens_are_fed_from_the_device(engine):
    """Each step is launched before the host has the tokens of the one before: the runner
    reads them from `next_tokens[slot]`. Two requests of different lengths, batched."""
    runner, vocab = engine.runner, engine.model.config.vocab_size
    prompts = {"p": _prompt(37, 1, vocab), "q": _prompt(5, 2, vocab)}
    expected = {rid: reference(engine.model, p, 6)[0] for rid, p in prompts.items()}
    drive = Driver(runner, {"p": [8], "q": [9]}, {"p": 1, "q": 4})
    for rid, p in prompts.items():
        drive.add(rid, p)
    in_flight = drive.launch({rid: len(p) for rid, p in prompts.items()}, new=("p", "q"))
    for _ in range(5):
        assert all(r.num_pending == 1 for r in drive.requests.values())
        launched = drive.launch({"p": 1, "q": 1})  # input: the pending token
        drive.resolve(in_flight)
        in_flight = launched
    drive.resolve(in_flight)
    assert {rid: drive.outputs(rid) for rid in prompts} == expected


def test_chunked_prompt_mixed_with_a_decode(engine):
    """A prompt in chunks of 50, 1 and the rest, each step shared with another request's
    decode token (pending on the device): chunks that do not complete the prompt sample
    nothing."""
    runner, vocab = engine.runner, engine.model.config.vocab_size
    long, short = _prompt(90, 3, vocab), _prompt(12, 4, vocab)
    expected = {
        "long": reference(engine.model, long, 3)[0],
        "short": reference(engine.model, short, 5)[0],
    }
    drive = Driver(runner, {"long": [10], "short": [11]}, {"long": 5, "short": 0})
    drive.add("long", long)
    drive.add("short", short)
    assert drive.launch({"long": 50}, new=("long",)) is None  # nothing to sample
    in_flight = drive.launch({"short": 12}, new=("short",))
    for chunk in (1, 39):
        launched = drive.launch({"long": chunk, "short": 1})
        drive.resolve(in_flight)
        in_flight = launched
    assert drive.resolve(in_flight).keys() == {"long", "short"}
    drive.step({"long": 1, "short": 1})
    drive.step({"long": 1, "short": 1})
    assert {rid: drive.outputs(rid) for rid in expected} == expected


def test_a_new_request_starts_from_a_zeroed_slot(engine):
    """A request that takes over a slot (listed in new_request_ids) does not see the
    recurrent state the slot's last owner left."""
    runner, vocab = engine.runner, engine.model.config.vocab_size
    first, second = _prompt(40, 5, vocab), _prompt(17, 6, vocab)
    drive = Driver(runner, {"first": [12], "second": [13]}, {"first": 2, "second": 2})
    drive.add("first", first)
    drive.step({"first": len(first)}, new=("first",))
    drive.step({"first": 1})
    drive.add("second", second)
    drive.step({"second": len(second)}, new=("second",))
    for _ in range(3):
        drive.step({"second": 1})
    assert drive.outputs("second") == reference(engine.model, second, 4)[0]


def test_seeded_sampling_reproduces_per_request(engine):
    """Two requests with one seed sample the same tokens, batched with a greedy one; another
    seed samples others; an unseeded one keeps a seed of its own until it is freed."""
    runner, vocab = engine.runner, engine.model.config.vocab_size
    prompt = _prompt(20, 7, vocab)
    seeded = SamplingParams(max_tokens=64, temperature=1.5, seed=123)
    params = {
        "s1": seeded,
        "s2": seeded,
        "g": SamplingParams(max_tokens=64),
        "other": SamplingParams(max_tokens=64, temperature=1.5, seed=321),
        "unseeded": SamplingParams(max_tokens=64, temperature=1.5),
    }
    rids = list(params)
    drive = Driver(
        runner, {r: [20 + i] for i, r in enumerate(rids)}, {r: 6 + i for i, r in enumerate(rids)}
    )
    for rid, p in params.items():
        drive.add(rid, prompt, p)
    drive.step(dict.fromkeys(rids, len(prompt)), new=tuple(rids))
    for _ in range(7):
        drive.step(dict.fromkeys(rids, 1))
    assert drive.outputs("s1") == drive.outputs("s2")
    assert drive.outputs("other") != drive.outputs("s1")
    assert drive.outputs("g") == reference(engine.model, prompt, 8)[0]
    assert list(runner.seeds) == ["unseeded"]
    for rid in rids:
        runner.free(rid)
    assert not runner.seeds
