"""The worker's gRPC service and `RemoteEngine` on loopback, over the tiny model: model facts
and load cross, greedy tokens equal the in-process engine's, media patches arrive intact,
malformed tensors are INVALID_ARGUMENT, and a stream left early or aborted is aborted on the
worker."""

import asyncio
import contextlib
import dataclasses

import grpc
import pytest
import torch

from sparrow.core.request import FinishReason
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.client import InvalidRequest
from sparrow.multimodal import QWEN3_5_MOE
from sparrow.multimodal.items import MediaItem
from sparrow.proto import CHANNEL_OPTIONS
from sparrow.proto import worker_pb2 as pb
from sparrow.proto import worker_pb2_grpc as pb_grpc
from sparrow.rpc import convert
from sparrow.rpc.client import RemoteEngine
from tests.rpc.conftest import settled

PROMPT = [9707, 11, 1879, 0, 358, 1079, 264]
GREEDY = SamplingParams(max_tokens=9, ignore_eos=True)


def remote(worker) -> RemoteEngine:
    thread, llm = worker
    return RemoteEngine(thread.target, llm.tokenizer.decode, poll_s=0.05)


async def collect(stream):
    return [d async for d in stream]


def test_model_info_load_and_health(worker):
    thread, _ = worker
    engine = remote(worker)
    assert engine.info == thread.engine.info and engine.info.media
    assert engine.health().alive and engine.health().accepting
    assert engine.stats().running == 0
    asyncio.run(engine.shutdown())


def remote_deltas(worker, request_id: str, params: SamplingParams) -> list:
    """The deltas of one request run through a RemoteEngine on the worker."""

    async def run():
        engine = remote(worker)
        deltas = await collect(await engine.add(request_id, PROMPT, params))
        await engine.shutdown()
        return deltas

    return asyncio.run(run())


def test_greedy_tokens_equal_the_in_process_engine(worker):
    thread, llm = worker
    local = thread.call(thread.engine.add("local-greedy", PROMPT, GREEDY))
    local = thread.call(collect(local))

    deltas = remote_deltas(worker, "remote-greedy", GREEDY)
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == [t for d in local for t in d.token_ids] and len(tokens) == 9
    assert "".join(d.text for d in deltas) == "".join(d.text for d in local)
    assert deltas[-1].finish_reason is FinishReason.LENGTH


def test_logprobs_cross(worker):
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2)

    entries = [
        e for d in remote_deltas(worker, "remote-logprobs", params) for e in d.logprobs or []
    ]
    assert len(entries) == 3 and all(len(e.top) == 2 and e.token.logprob <= 0 for e in entries)


def test_prompt_logprobs_and_skip_special_tokens_cross(worker):
    """The gateway side gets the prompt logprobs (ids, logprobs, ranks, top ones) and text the
    in-process engine gives; skip_special_tokens unset in a message means true."""
    thread, _ = worker
    params = SamplingParams(
        max_tokens=3, ignore_eos=True, prompt_logprobs=2, skip_special_tokens=False
    )
    crossed = convert.params_from_pb(convert.params_to_pb(params))
    assert (crossed.prompt_logprobs, crossed.skip_special_tokens) == (2, False)
    unset = convert.params_from_pb(pb.SamplingParams(max_tokens=1, top_p=1.0))
    assert (unset.prompt_logprobs, unset.skip_special_tokens) == (None, True)
    local = thread.call(collect(thread.call(thread.engine.add("local-prompt", PROMPT, params))))

    deltas = remote_deltas(worker, "remote-prompt", params)
    assert deltas[0].prompt_logprobs == local[0].prompt_logprobs
    assert len(deltas[0].prompt_logprobs) == len(PROMPT) - 1
    assert all(e.token.rank >= 1 and len(e.top) == 2 for e in deltas[0].prompt_logprobs)
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert "".join(d.text for d in deltas) == "".join(d.text for d in local)


def image_item(patch_dim: int, runs=(3,), grid=(1, 4, 6)) -> MediaItem:
    g = torch.Generator().manual_seed(7)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], patch_dim, generator=g)
    return MediaItem(runs, pixels, grid, "digest-of-a-test-image")


def test_media_arrive_intact(worker):
    thread, llm = worker
    item = image_item(QWEN3_5_MOE.patch_dim)
    prompt = PROMPT[:3] + [QWEN3_5_MOE.image_token_id] * 6 + PROMPT[3:]

    async def run():
        engine = remote(worker)
        stream = await engine.add("remote-media", prompt, GREEDY, [item])
        await collect(stream)
        await engine.shutdown()

    asyncio.run(run())
    patches, grids = llm.model.visual.seen[-1]
    assert torch.equal(patches, item.pixel_values) and grids == [[1, 4, 6]]


def generate(target: str, media: pb.MediaItem) -> grpc.StatusCode:
    request = pb.GenerateRequest(
        request_id="raw",
        prompt_token_ids=PROMPT + [0] * 6,
        sampling_params=convert.params_to_pb(GREEDY),
        media=[media],
    )
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(pb_grpc.WorkerStub(channel).Generate(request, timeout=30))
    return raised.value.code()


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m.pixel_values, "dtype", "float16"),
        lambda m: setattr(m.pixel_values, "data", m.pixel_values.data[:-4]),
        lambda m: m.pixel_values.shape.append(1),
        lambda m: m.grid_thw.__setitem__(2, 5),
        lambda m: m.ClearField("runs"),
    ],
)
def test_malformed_media_are_invalid_argument(worker, change):
    media = convert.media_to_pb(image_item(60, runs=(2,)))
    change(media)
    assert generate(worker[0].target, media) == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_tensor_is_an_invalid_request(worker):
    item = image_item(QWEN3_5_MOE.patch_dim)
    bad = MediaItem(item.runs, item.pixel_values[:-1], item.grid_thw, item.digest)

    async def run():
        engine = remote(worker)
        try:
            with pytest.raises(InvalidRequest, match="does not match"):
                await engine.add("remote-bad", PROMPT + [0] * 6, GREEDY, [bad])
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_leaving_a_stream_aborts_on_the_worker(worker):
    thread, _ = worker
    params = SamplingParams(max_tokens=2000, ignore_eos=True)

    async def run():
        engine = remote(worker)
        stream = await engine.add("remote-left", PROMPT, params)
        async with contextlib.aclosing(stream):
            async for delta in stream:
                if delta.token_ids:
                    break
        assert await asyncio.to_thread(settled, thread.engine), "the worker still runs it"
        stream = await engine.add("remote-aborted", PROMPT, params)
        first = await anext(stream)
        engine.abort("remote-aborted")
        rest = await collect(stream)
        await engine.shutdown()
        return first, rest

    first, rest = asyncio.run(run())
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 2000
    assert settled(thread.engine)


def test_a_stop_string_only_the_caller_sees_is_aborted_on_the_worker(worker):
    """The caller decodes in upper case: the worker never meets the stop string, the caller's
    output processor does and aborts the request there."""
    thread, llm = worker
    params = SamplingParams(max_tokens=2000, ignore_eos=True)
    text = llm.tokenizer.decode(
        [
            t
            for d in thread.call(collect(thread.call(thread.engine.add("plain", PROMPT, GREEDY))))
            for t in d.token_ids
        ]
    )
    at = next(i for i in range(2, len(text) - 1) if text[i : i + 2].upper() != text[i : i + 2])
    stop = text[at : at + 2].upper()
    assert stop not in text

    async def run():
        engine = RemoteEngine(thread.target, lambda ids: llm.tokenizer.decode(ids).upper())
        stopped = dataclasses.replace(params, stop=(stop,))
        deltas = await collect(await engine.add("caller-stop", PROMPT, stopped))
        assert await asyncio.to_thread(settled, thread.engine), "the worker still runs it"
        await engine.shutdown()
        return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert "".join(d.text for d in deltas) == text[:at].upper()
