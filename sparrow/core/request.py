"""A request as the scheduler tracks it, and what a step gives it (token ids only: text is
the output processor's, in sparrow/engine)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sparrow.core.sampling_params import SamplingParams, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued: not admitted yet, or preempted
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled (client gone, server stopping)


@dataclass(frozen=True)
class MediaSpan:
    """A media item's placeholder tokens in the prompt, [start, start + length), and a
    digest of its content (`sparrow.multimodal.media_digest`)."""

    start: int
    length: int
    digest: str


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    media: tuple[MediaSpan, ...] = ()  # images and videos, in prompt order
    arrival: int = 0  # order of arrival; earlier requests keep priority
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV / state the model already holds
    # sampled on the device, not yet read back: they follow output_token_ids (the runner
    # feeds them from the device) and count in num_tokens
    num_pending: int = 0
    finish_reason: FinishReason | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens known on the host (num_pending more follow on the device)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] at the cost of the slice, not of the whole context."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    def cache_key_ids(self, start: int, stop: int) -> list:
        """`token_ids(start, stop)` as the prefix cache keys them: a media placeholder's
        tokens (the same pad id for every image) become (digest, offset) pairs, so a block
        matches only where the same media fill it."""
        ids: list = self.token_ids(start, stop)
        for span in self.media:
            for p in range(max(start, span.start), min(stop, span.start + span.length)):
                ids[p - start] = (span.digest, p - span.start)
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What a request gained from a step: new token ids, and the finish reason once the
    engine ends it (stop token, length, abort)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    # with the first token, when asked for: one per prompt token after the first (its rank set)
    prompt_logprobs: list[TokenLogprob] | None = None
