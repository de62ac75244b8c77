"""How a request wants its tokens chosen and when it stops."""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

from sparrow.core.structured import GrammarSpec

# Below this temperature sampling is greedy: logits / 1e-45 overflow to inf, the softmax
# gives NaN and torch.multinomial raises (the limit vLLM uses).
MIN_TEMPERATURE = 1e-5
SEED_RANGE = 2**64  # seeds are 64-bit: the sampler's counter-based draws key on them
MAX_INT = 2**31 - 1  # bound on max_tokens and top_k
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Validated on construction (and `dataclasses.replace`): ValueError with the field and
    value for anything the engine cannot run. Temperatures below `MIN_TEMPERATURE` become
    0 (greedy); seeds are taken modulo 2**64, so seed + i for the n choices stays valid.
    `min_tokens` counts the `output_offset` earlier tokens: it may exceed max_tokens by
    that many."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = all tokens
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded output
    logprobs: int | None = None  # report each sampled token's logprob and this many top ones
    ignore_eos: bool = False  # do not stop at the model's end tokens (benchmarks)
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    min_tokens: int = 0  # stop token ids (end tokens included) are barred before this many
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence_penalty: float = 0.0  # subtracted once from each generated token's logit
    frequency_penalty: float = 0.0  # subtracted per time a token has been generated
    repetition_penalty: float = 1.0  # prompt and generated tokens' logits: / if > 0, * if < 0
    grammar: GrammarSpec | None = None  # structured output: the grammar the output follows
    # each prompt token's logprob given the tokens before it, and this many top ones there
    # (vLLM's extension); the request then starts from no cached prefix
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # the output text leaves out the tokenizer's special tokens
    # how many tokens at the prompt's end are this request's own earlier output (a stream
    # resumed elsewhere: the gateway's prompt + tokens so far). They count as output for the
    # random draws (token j samples at output position output_offset + j), presence and
    # frequency penalties, min_tokens and the grammar (replayed through them); prompt
    # logprobs, if asked, cover the whole prompt, those tokens included. Internal to the
    # gateway -> worker protocol: the HTTP API does not take it.
    output_offset: int = 0

    def stopping_at(self, end_ids: tuple[int, ...]) -> SamplingParams:
        """These params, stopping at `end_ids` (the model's end tokens) unless they give
        stop token ids of their own or ignore EOS."""
        if self.stop_token_ids or self.ignore_eos:
            return self
        return dataclasses.replace(self, stop_token_ids=tuple(end_ids))

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalised values are set once, here
        put(self, "max_tokens", _int("max_tokens", self.max_tokens, 1, MAX_INT))
        temperature = _float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        put(self, "temperature", 0.0 if temperature < MIN_TEMPERATURE else temperature)
        top_p = _float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        put(self, "top_p", top_p)
        put(self, "top_k", _int("top_k", self.top_k, 0, MAX_INT))
        if self.seed is not None:
            put(self, "seed", _int("seed", self.seed, None, None) % SEED_RANGE)
        if self.logprobs is not None:
            put(self, "logprobs", _int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if self.prompt_logprobs is not None:
            put(
                self,
                "prompt_logprobs",
                _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS),
            )
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}"
            )
        put(
            self,
            "stop_token_ids",
            tuple(_int("stop_token_ids", t, 0, None) for t in self.stop_token_ids),
        )
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a sequence of strings, got {self.stop!r}")
        put(self, "stop", tuple(self.stop))
        min_p = _float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        put(self, "min_p", min_p)
        put(self, "output_offset", _int("output_offset", self.output_offset, 0, None))
        most = self.max_tokens + self.output_offset
        put(self, "min_tokens", _int("min_tokens", self.min_tokens, 0, most))
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            put(self, name, value)
        repetition = _float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition}")
        put(self, "repetition_penalty", repetition)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {self.grammar!r}")
        bias = dict(self.logit_bias)
        put(
            self,
            "logit_bias",
            tuple(
                sorted((_int("logit_bias token", t, 0, None), _bias(b)) for t, b in bias.items())
            ),
        )


def _int(name: str, value: object, lo: int | None, hi: int | None) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def _bias(value: object) -> float:
    value = _float("logit_bias value", value)
    if not -100 <= value <= 100:
        raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
    return value


def _float(name: str, value: object) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the top alternatives (most likely
    first); `rank` (prompt logprobs): 1 + the number of tokens more likely than it."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None
