"""SamplingParams validate on construction: nothing the engine thread cannot run gets in."""

import dataclasses
import math

import pytest
import torch

from sparrow.core.sampling_params import MIN_TEMPERATURE, SEED_RANGE, SamplingParams


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": math.nan}, "top_p must be a finite number"),
        ({"top_p": -math.inf}, "top_p must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": 2**63}, "max_tokens must be <= "),
        ({"max_tokens": 3.5}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_k": 2**40}, "top_k must be <= "),
        ({"logprobs": 21}, "logprobs must be <= 20"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be <= 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens must be a bool"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids must be >= 0"),
        ({"stop": "end"}, "stop must be a sequence of strings"),
    ],
)
def test_bad_values_raise_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


@pytest.mark.parametrize("t", [1e-45, 5e-324, 2.2e-313, 1e-6, MIN_TEMPERATURE / 2, 0])
def test_tiny_temperatures_are_greedy(t):
    assert SamplingParams(temperature=t).temperature == 0.0


def test_temperatures_from_the_limit_up_are_kept():
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=2).temperature == 2.0


@pytest.mark.parametrize("seed", [0, 7, -1, -(2**63) - 1, 2**63, 2**64 - 1, 2**64, 2**200 + 3])
def test_seeds_are_reduced_to_64_bits_and_seed_generators(seed):
    params = SamplingParams(seed=seed)
    assert params.seed == seed % SEED_RANGE and 0 <= params.seed < SEED_RANGE
    torch.Generator().manual_seed(params.seed)  # in range: does not raise


def test_replace_validates_again():
    """The server derives the n choices' seeds as seed + i with `dataclasses.replace`."""
    last = SamplingParams(seed=2**64 - 1)
    assert dataclasses.replace(last, seed=last.seed + 1).seed == 0
    with pytest.raises(ValueError, match="temperature must be a finite"):
        dataclasses.replace(last, temperature=math.nan)


def test_sequences_become_tuples():
    params = SamplingParams(stop_token_ids=[5, 6], stop=["a", "b"])
    assert params.stop_token_ids == (5, 6) and params.stop == ("a", "b")
    hash(params)
