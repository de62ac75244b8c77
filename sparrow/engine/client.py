"""`EngineClient`: the one interface the HTTP server (and the gateway) talks to an engine
through.

It speaks token ids, `SamplingParams` and `OutputDelta`s (text already decoded, stop strings
applied: the output processor runs behind it) and hands out plain data about the engine;
no scheduler, model or `LLM` object crosses it. The in-process `AsyncEngine` implements it;
so does the gateway's gRPC client. Tokenising and chat templates stay with the caller.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.output_processor import OutputDelta
from sparrow.multimodal.items import MediaItem


class InvalidRequest(ValueError):
    """The request can never run (context limit, cache size, token ids out of range, ...):
    the message says why. An HTTP server answers 400."""


class EngineFull(RuntimeError):
    """The queue is at its limit or the engine is stopping: retry later (503)."""


class EngineError(RuntimeError):
    """A step the request was in failed (the engine goes on without it), or the engine loop
    stopped on an error (every open stream ends with this; health is no longer alive)."""


class EngineUnreachable(EngineError):
    """The engine behind a connection could not be reached: the request never ran there, so
    a router may send it to another engine."""


def check_token_ids(
    prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int
) -> None:
    """InvalidRequest unless the prompt's, the stop and the logit_bias token ids are all in
    [0, vocab_size): the engine's check, and a remote client's before the ids go on the wire
    (whose fields are 32-bit)."""
    for name, ids in (
        ("prompt token ids", prompt_token_ids),
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias token ids", [t for t, _ in params.logit_bias]),
    ):
        if any(not 0 <= i < vocab_size for i in ids):
            raise InvalidRequest(f"{name} must be in [0, {vocab_size})")


@dataclass(frozen=True)
class EngineInfo:
    """What a caller needs to know to build requests."""

    max_model_len: int  # prompt + output tokens per request
    vocab_size: int  # prompt token ids are in [0, vocab_size)
    default_stop_token_ids: tuple[int, ...]  # used when a request gives none (no ignore_eos)
    kv_cache_tokens: int | None = None  # tokens the whole KV cache holds (None: no bound)
    media: bool = False  # the model takes images and videos (it has a vision tower)
    # what the weights are (`loader.formats.describe`); None where the engine does not say
    quantization: dict | None = field(default=None, compare=False, hash=False)

    def model_card(self, model_id: str) -> dict:
        """The model's entry in /v1/models: OpenAI's fields and, as vLLM adds its own beside
        them, `quantization`: what the weights are (format, bits, group or block, what stayed
        float; null where the engine does not say)."""
        card = {"id": model_id, "object": "model", "created": 0, "owned_by": "sparrow"}
        return card | {"quantization": self.quantization}

    @property
    def request_limit(self) -> int:
        """Prompt + output tokens one request can have: the context limit, or the whole KV
        cache where that is smaller (a CPU-sized cache)."""
        return min(self.max_model_len, self.kv_cache_tokens or self.max_model_len)


@dataclass(frozen=True)
class EngineStats:
    waiting: int  # queued, not admitted yet
    running: int
    kv_usage: float  # fraction of KV blocks in use
    prefix_hit_rate: float = 0.0  # prompt tokens found in the prefix cache / admitted
    # recurrent-state snapshots filed for prefix hits (at most `CacheConfig.num_state_snapshots`)
    state_snapshots: int = 0


@dataclass(frozen=True)
class EngineHealth:
    alive: bool  # the engine loop runs
    accepting: bool  # and takes new requests (not stopping)


class EngineClient(abc.ABC):
    """Add requests and stream their outputs; abort, stats, health, shutdown."""

    @property
    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        media: Sequence[MediaItem] = (),
    ) -> AsyncIterator[OutputDelta]:
        """Queue a request (with its preprocessed images and videos, whose placeholder runs
        the prompt holds); returns the stream of its outputs, the last one with a finish
        reason. Raises before anything is queued: InvalidRequest (with the reason),
        EngineFull, EngineError. Stop token ids default to `info.default_stop_token_ids`
        unless `params` gives some or ignores EOS. Leaving the stream early aborts the
        request. The stream raises EngineError if the request fails in the engine."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds; its stream ends with reason ABORT. A no-op
        for unknown or finished requests."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop taking requests; those in flight run to their end."""
