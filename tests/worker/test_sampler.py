"""Sampling: greedy is argmax; temperature / top-k / top-p draw from the distribution they
define; the draws are SplitMix64 outputs of (seed, output position) and reproduce;
`sample_rows` mixes greedy and sampled rows."""

import random

import pytest
import torch

from sparrow.core.sampling_params import SamplingParams
from sparrow.worker.sampler import _int64, sample, sample_rows, token_logprob, uniforms

V = 1001  # not a power of two


def _logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Empirical distribution of `draws` samples from the one row `logits` [V] (output
    positions 0 .. draws - 1 of one seed)."""
    picked = sample(logits.expand(draws, -1), params, 0)
    return torch.bincount(picked, minlength=logits.shape[-1]).double() / draws


def test_greedy_is_argmax():
    logits = _logits(5)
    picked = sample(logits, SamplingParams(), None)
    assert picked.dtype == torch.long
    assert torch.equal(picked, logits.argmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=1.3, top_p=1e-6),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.5),
        SamplingParams(temperature=1e-4),  # all the mass on the argmax
        SamplingParams(temperature=1.0, top_p=5e-324),  # 0 in fp32
        SamplingParams(temperature=1.0, top_p=1e-40),  # an fp32 subnormal
    ],
    ids=[
        "top_k=1",
        "top_p tiny",
        "top_k=1 + top_p",
        "temperature tiny",
        "top_p 5e-324",
        "top_p subnormal",
    ],
)
def test_filters_that_keep_one_token_are_greedy(params):
    logits = _logits(7, seed=1)
    for seed in range(3):
        assert torch.equal(sample(logits, params, seed), logits.argmax(-1))


def test_seeded_draws_reproduce():
    logits = _logits(6, seed=2)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    a = [sample(logits, params, 3, 6 * i) for i in range(4)]  # one seed, 24 positions
    b = [sample(logits, params, 3, 6 * i) for i in range(4)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    other = [sample(logits, params, 4, 6 * i) for i in range(4)]
    assert not all(torch.equal(x, y) for x, y in zip(a, other, strict=True))
    later = [sample(logits, params, 3, 6 * i + 100) for i in range(4)]
    assert not all(torch.equal(x, y) for x, y in zip(a, later, strict=True))


MASK = 2**64 - 1


def _splitmix64(seed: int, j: int) -> int:
    """Output j of SplitMix64 seeded with `seed`, in Python's unbounded integers."""
    z = (seed + (j + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_uniforms_are_splitmix64_outputs(device):
    """Bit for bit the reference's top 24 (fp32) or 53 (fp64) bits, across int64 overflow,
    seeds past 2**63 and large positions."""
    assert _splitmix64(0, 0) == 0xE220A8397B1DCDAF  # Vigna's splitmix64.c, seed 0
    rng = random.Random(5)
    seeds = [rng.getrandbits(64) for _ in range(3001)] + [0, 1, 2**63 - 1, 2**63, MASK]
    positions = [rng.randrange(2**31) for _ in range(3001)] + [0, 0, 7, 2**31 - 1, 1]
    keys = torch.tensor([_int64(s) for s in seeds], device=device)
    at = torch.tensor(positions, device=device)
    for dtype, bits in ((torch.float32, 24), (torch.float64, 53)):
        got = uniforms(keys, at, dtype).cpu()
        pairs = zip(seeds, positions, strict=True)
        ref = [(_splitmix64(s, j) >> (64 - bits)) / 2**bits for s, j in pairs]
        assert torch.equal(got, torch.tensor(ref, dtype=dtype)), dtype
        assert 0 <= got.min() and got.max() < 1


def test_uniforms_along_one_stream_are_uniform():
    """200,000 positions of one seed: 64 bins within ~4.5 standard deviations, no bin empty
    of its low bits (all 24 are drawn)."""
    n = 200_000
    u = uniforms(torch.full((n,), 12345), torch.arange(n), torch.float32).double()
    counts = torch.histc(u, bins=64, min=0, max=1)
    expected = n / 64
    assert (counts - expected).abs().max() < 4.5 * expected**0.5
    low = (u * 2**24).long() & 0xFF
    assert torch.bincount(low, minlength=256).min() > 0


def test_temperature_samples_softmax_of_scaled_logits():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -2.0, 0.9])
    for t in (0.5, 1.0, 2.0):
        freq = _frequencies(logits, SamplingParams(temperature=t), 40_000)
        expected = torch.softmax(logits.double() / t, -1)
        assert (freq - expected).abs().max() < 0.012, t  # ~5 standard deviations


def test_top_k_samples_the_k_best_renormalised():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -2.0, 0.9])
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_k=3), 40_000)
    best = logits.topk(3).indices
    expected = torch.zeros(7, dtype=torch.float64)
    expected[best] = torch.softmax(logits[best].double(), -1)
    assert (freq - expected).abs().max() < 0.012
    assert freq[expected == 0].sum() == 0


@pytest.mark.parametrize("top_p, kept", [(0.7, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    """probs 0.5, 0.3, 0.15, 0.05 (shuffled order in the vocabulary)."""
    order = torch.tensor([2, 0, 3, 1])  # vocabulary id of the i-th most likely token
    probs = torch.zeros(4, dtype=torch.float64)
    probs[order] = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    freq = _frequencies(probs.log().float(), SamplingParams(temperature=1.0, top_p=top_p), 40_000)
    expected = torch.zeros(4, dtype=torch.float64)
    expected[order[kept]] = probs[order[kept]] / probs[order[kept]].sum()
    assert (freq - expected).abs().max() < 0.012
    assert freq[expected == 0].sum() == 0


def test_sample_rows_mixes_greedy_and_sampled_rows():
    logits = _logits(5, seed=5)
    sampled = SamplingParams(temperature=1.5, top_p=0.95, seed=9)
    params = [
        SamplingParams(),
        sampled,
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=1),
        sampled,
    ]
    seeds, positions = [None, 9, None, None, 10], [0, 4, 0, 0, 7]
    picked = sample_rows(logits, params, seeds, positions)
    assert picked.dtype == torch.long and picked.shape == (5,)
    greedy = logits.argmax(-1)
    assert picked[[0, 2, 3]].tolist() == greedy[[0, 2, 3]].tolist()
    assert picked[1] == sample(logits[1:2], sampled, 9, 4)[0]
    assert picked[4] == sample(logits[4:5], sampled, 10, 7)[0]


def test_sample_rows_all_greedy_is_argmax():
    logits = _logits(4, seed=6)
    picked = sample_rows(logits, [SamplingParams()] * 4, [None] * 4)
    assert torch.equal(picked, logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprob_is_log_softmax(dtype):
    logits = _logits(1, seed=7)[0].to(dtype)
    logp = torch.log_softmax(logits.float(), -1)
    token = int(logits.float().argsort()[V // 2])  # a mid-ranked token, not the top one
    out = token_logprob(logits, token, 5)
    assert out.token_id == token
    assert out.logprob == pytest.approx(float(logp[token]), abs=1e-5)
    best = logp.topk(5)
    assert [t for t, _ in out.top] == best.indices.tolist()
    assert [lp for _, lp in out.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert token_logprob(logits, token, 0).top == ()


def test_a_seeded_row_does_not_depend_on_the_other_rows():
    """Rows with different filters are sampled together; each seeded row draws what it draws
    alone at its (seed, position)."""
    logits = _logits(6, seed=8)
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=1),
        SamplingParams(temperature=1.2, top_p=0.8, seed=2),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.1, top_p=0.6, seed=4),
    ]
    for draw in range(3):
        seeds, positions = [100 * draw + b for b in range(6)], [draw * b for b in range(6)]
        picked = sample_rows(logits, params, seeds, positions)
        for b in (0, 1, 3, 5):
            alone = sample(logits[b : b + 1], params[b], seeds[b], positions[b])[0]
            assert picked[b] == alone, (draw, b)
        assert picked[2] == logits[2].argmax()


@pytest.mark.parametrize("shape", ["flat", "peaked"])
@pytest.mark.parametrize("top_p", [0.0, 1e-6, 0.3, 0.9, 0.999])
def test_bucketed_top_p_keeps_what_sorting_keeps(shape, top_p):
    """The CPU's bucketed cut (large vocabularies) against the sort, on tie-free rows: the
    same tokens, but for one at the boundary where the two sums (by bucket, and in sorted
    order) round to opposite sides of p."""
    from sparrow.worker.sampler import _bucketed_cut, _sorted_cut

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 70_000, generator=gen) * (1.0 if shape == "flat" else 6.0)
    probs = torch.softmax(logits, -1)
    column = torch.full((3, 1), top_p)
    bucketed, ordered = _bucketed_cut(probs, column), _sorted_cut(probs, column)
    assert ((bucketed > 0) != (ordered > 0)).sum(-1).max() <= 1
    assert torch.equal(bucketed[bucketed > 0], probs[bucketed > 0])


@pytest.mark.parametrize("top_p", [0.9999999, 0.99999994])
def test_bucketed_top_p_within_rounding_of_one_keeps_the_whole_nucleus(top_p):
    """The buckets' fp32 mass may never reach such a p: then every token stays (the sort,
    summing in another order, may drop a tail of tiny ones)."""
    from sparrow.worker.sampler import _bucketed_cut, _sorted_cut

    probs = torch.softmax(
        torch.randn(3, 70_000, generator=torch.Generator().manual_seed(13)) * 6.0, -1
    )
    column = torch.full((3, 1), top_p)
    bucketed = _bucketed_cut(probs, column)
    assert ((_sorted_cut(probs, column) > 0) <= (bucketed > 0)).all()


def test_bucketed_top_p_keeps_every_token_tied_with_the_cut():
    from sparrow.worker.sampler import _bucketed_cut

    probs = torch.full((1, 70_000), 1 / 70_000)
    kept = _bucketed_cut(probs, torch.tensor([[0.5]]))
    assert torch.equal(kept, probs)  # all equal: the cut value is everyone's


def test_large_vocabulary_rows_sample_inside_their_nucleus():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(64, 70_000, generator=gen) * 4
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 64
    picked = sample_rows(logits, params, [None] * 64)
    probs = torch.softmax(logits, -1)
    ordered, order = probs.sort(-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(70_000).expand(64, -1))
    last = ((ordered.cumsum(-1) - ordered) < 0.5).sum(-1)  # the nucleus' size per row
    assert (rank.gather(1, picked[:, None])[:, 0] < last).all()


def test_min_p_keeps_tokens_within_its_share_of_the_best():
    """probs 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps those >= 0.25, renormalised."""
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
    freq = _frequencies(probs.log().float(), SamplingParams(temperature=1.0, min_p=0.5), 40_000)
    expected = torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8], dtype=torch.float64)
    assert (freq - expected).abs().max() < 0.012 and freq[expected == 0].sum() == 0


def test_logit_bias_moves_greedy_and_sampled_choices():
    logits = _logits(2)
    best = logits.argmax(-1)
    ban = SamplingParams(logit_bias=((int(best[0]), -100.0),))
    force = SamplingParams(temperature=1.0, logit_bias=((7, 100.0),))
    picked = sample_rows(logits, [ban, force], [None, 1])
    assert int(picked[0]) == int(logits[0].topk(2).indices[1]) and int(picked[1]) == 7
    assert torch.equal(logits, _logits(2))  # the caller's logits are not changed


def test_min_tokens_bars_stop_ids_until_reached():
    logits = _logits(3)
    stops = tuple(int(t) for t in logits[0].topk(3).indices)  # the three best of row 0
    p = SamplingParams(min_tokens=2, stop_token_ids=stops)
    picked = sample_rows(logits[[0, 0, 0]], [p] * 3, [None] * 3, positions=[0, 1, 2])
    assert int(picked[0]) == int(picked[1]) == int(logits[0].topk(4).indices[3])
    assert int(picked[2]) == stops[0]  # two generated: stop ids are allowed again


def test_sampling_controls_are_validated():
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    # a resumed request's earlier output counts toward min_tokens
    assert SamplingParams(max_tokens=4, min_tokens=5, output_offset=1).min_tokens == 5
    with pytest.raises(ValueError, match="output_offset"):
        SamplingParams(output_offset=-1)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),))
    assert SamplingParams(logit_bias=((3, 1.0), (1, -2.0))).logit_bias == ((1, -2.0), (3, 1.0))


def _penalized_reference(
    row: torch.Tensor, p: SamplingParams, output: list[int], prompt: list[int]
) -> torch.Tensor:
    out = row.clone()
    for t in set(output) | set(prompt):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_penalties_equal_their_definitions():
    from sparrow.worker.sampler import penalize

    logits = _logits(3)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0),
    ]
    outputs, prompts = [[5, 5, 9, 1000], [3], [7, 7, 7]], [[1, 2, 5], [4], [9]]
    pending = {2: torch.tensor(11)}
    out = penalize(logits, params, outputs, prompts, pending)
    full = [outputs[0], outputs[1], outputs[2] + [11]]
    for b in range(3):
        expected = _penalized_reference(logits[b], params[b], full[b], prompts[b])
        assert torch.allclose(out[b], expected, atol=1e-6), b
    assert penalize(logits, [SamplingParams()] * 3, outputs, prompts) is logits


def test_penalties_through_the_engine_equal_a_plain_loop():
    """Greedy decode with penalties via LLM (one step in flight: the last token is still on
    the device when the next is sampled) equals a loop that applies them by definition."""
    from sparrow.engine.llm import LLM
    from sparrow.loader.random_checkpoint import PRESETS, random_model
    from sparrow.worker.sequences import SequenceBatch

    cfg = PRESETS["qwen3.6-tiny"].replace(vocab_size=300)
    model = random_model(cfg, 0, "cpu", torch.float32)
    p = SamplingParams(
        max_tokens=8,
        ignore_eos=True,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.5,
    )
    prompt = [5, 17, 17, 42, 99, 5]
    llm = LLM(model, max_model_len=64, block_size=16, num_blocks=8)
    ours = llm.generate([prompt], p)[0].token_ids
    batch, output = SequenceBatch(model, 1, 64), []
    with torch.no_grad():
        logits = model.logits(batch.forward([torch.tensor(prompt)]))[-1]
        for _ in range(8):
            output.append(int(_penalized_reference(logits, p, output, prompt).argmax()))
            logits = model.logits(batch.forward([torch.tensor([output[-1]])]))[0]
    assert ours == output
    plain = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert plain != ours  # the penalties change this decode
