"""Thin converters between Sparrow's types and `worker.proto`'s messages, used by both ends.

Only sampling params, media, logprobs (of sampled and prompt tokens) and engine facts cross;
text never does. A tensor that
does not fit its declared shape or dtype, or a media item whose grid does not match its
patches, raises ValueError (the worker answers INVALID_ARGUMENT)."""

from __future__ import annotations

import math

import torch

from sparrow.core.request import FinishReason
from sparrow.core.sampling_params import SamplingParams, TokenLogprob
from sparrow.core.structured import GrammarSpec
from sparrow.engine.client import EngineHealth, EngineInfo, EngineStats
from sparrow.engine.output_processor import LogprobEntry, PromptLogprobEntry
from sparrow.multimodal.items import MediaItem
from sparrow.proto import worker_pb2 as pb

PIXEL_DTYPE = "float32"
FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


def params_to_pb(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop_token_ids=params.stop_token_ids,
        stop=params.stop,
        logprobs=params.logprobs,
        ignore_eos=params.ignore_eos,
        prompt_logprobs=params.prompt_logprobs,
        skip_special_tokens=params.skip_special_tokens,
        min_p=params.min_p,
        min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        grammar=(
            pb.Grammar(
                kind=params.grammar.kind, value=params.grammar.value, after=params.grammar.after
            )
            if params.grammar is not None
            else None
        ),
        output_offset=params.output_offset,
    )


def params_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """The params a request names; ValueError as `SamplingParams` raises it."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        ignore_eos=msg.ignore_eos,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        skip_special_tokens=not msg.HasField("skip_special_tokens") or msg.skip_special_tokens,
        min_p=msg.min_p,
        min_tokens=msg.min_tokens,
        logit_bias=tuple(msg.logit_bias.items()),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0),
        grammar=(
            GrammarSpec(
                msg.grammar.kind,
                msg.grammar.value,
                msg.grammar.after if msg.grammar.HasField("after") else None,
            )
            if msg.HasField("grammar")
            else None
        ),
        output_offset=msg.output_offset,
    )


def media_to_pb(item: MediaItem) -> pb.MediaItem:
    pixels = item.pixel_values.detach().to("cpu", torch.float32).contiguous()
    tensor = pb.TensorData(data=pixels.numpy().tobytes(), shape=pixels.shape, dtype=PIXEL_DTYPE)
    return pb.MediaItem(
        runs=item.runs,
        pixel_values=tensor,
        grid_thw=item.grid_thw,
        digest=item.digest,
        video=item.video,
    )


def media_from_pb(msg: pb.MediaItem) -> MediaItem:
    """The item, its patches copied out of the message; ValueError for a malformed one."""
    tensor = msg.pixel_values
    if tensor.dtype != PIXEL_DTYPE:
        raise ValueError(f"pixel_values dtype must be {PIXEL_DTYPE!r}, got {tensor.dtype!r}")
    shape = tuple(tensor.shape)
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"pixel_values must be [patches, patch_dim], got shape {list(shape)}")
    if len(tensor.data) != math.prod(shape) * 4:
        raise ValueError(
            f"pixel_values of shape {list(shape)} need {math.prod(shape) * 4} "
            f"bytes, got {len(tensor.data)}"
        )
    grid = tuple(msg.grid_thw)
    if len(grid) != 3 or 0 in grid or math.prod(grid) != shape[0]:
        raise ValueError(f"grid_thw {list(grid)} does not match {shape[0]} patches")
    if not msg.runs or not msg.digest:
        raise ValueError("a media item needs its placeholder runs and digest")
    pixels = torch.frombuffer(bytearray(tensor.data), dtype=torch.float32).reshape(shape)
    return MediaItem(tuple(msg.runs), pixels, grid, msg.digest, msg.video)


def logprobs_to_pb(entries: list[LogprobEntry] | None) -> list[pb.TokenLogprob]:
    """The sampled tokens' logprobs and top alternatives of a delta, their text left out."""
    return [
        pb.TokenLogprob(
            token_id=e.token.token_id,
            logprob=e.token.logprob,
            top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in e.top],
        )
        for e in entries or ()
    ]


def prompt_logprobs_to_pb(entries: list[PromptLogprobEntry] | None) -> pb.PromptLogprobs | None:
    """A delta's prompt logprobs (None when it has none), their text left out."""
    if entries is None:
        return None
    return pb.PromptLogprobs(
        tokens=[
            pb.TokenLogprob(
                token_id=e.token.token_id,
                logprob=e.token.logprob,
                rank=e.token.rank,
                top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in e.top],
            )
            for e in entries
        ]
    )


def logprobs_from_pb(msgs) -> list[TokenLogprob]:
    """Logprobs as the output processor takes them (it gives them text again)."""
    return [
        TokenLogprob(
            m.token_id,
            m.logprob,
            tuple((t.token_id, t.logprob) for t in m.top),
            m.rank if m.HasField("rank") else None,
        )
        for m in msgs
    ]


def prompt_logprobs_from_pb(chunk: pb.GenerateChunk) -> list[TokenLogprob] | None:
    """A chunk's prompt logprobs, None when it carries none."""
    if not chunk.HasField("prompt_logprobs"):
        return None
    return logprobs_from_pb(chunk.prompt_logprobs.tokens)


def info_to_pb(info: EngineInfo) -> pb.ModelInfoReply:
    return pb.ModelInfoReply(
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        default_stop_token_ids=info.default_stop_token_ids,
        kv_cache_tokens=info.kv_cache_tokens,
        media=info.media,
    )


def info_from_pb(msg: pb.ModelInfoReply) -> EngineInfo:
    kv = msg.kv_cache_tokens if msg.HasField("kv_cache_tokens") else None
    return EngineInfo(
        msg.max_model_len, msg.vocab_size, tuple(msg.default_stop_token_ids), kv, msg.media
    )


def stats_to_pb(stats: EngineStats) -> pb.LoadReply:
    return pb.LoadReply(
        waiting=stats.waiting,
        running=stats.running,
        kv_usage=stats.kv_usage,
        prefix_hit_rate=stats.prefix_hit_rate,
    )


def stats_from_pb(msg: pb.LoadReply) -> EngineStats:
    return EngineStats(msg.waiting, msg.running, msg.kv_usage, msg.prefix_hit_rate)


def health_from_pb(msg: pb.HealthReply) -> EngineHealth:
    return EngineHealth(alive=msg.alive, accepting=msg.accepting)
