"""The offline engine: `LLM(model=...).generate(prompts, params)`.

Requests go through the scheduler (continuous batching by token budget, chunked prefill,
preemption) and the model runner, step by step, until all finish. `add_request` / `step` /
`abort` expose the same loop to a server.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparrow.config import EngineConfig
from sparrow.core.cache_spec import slot_bytes
from sparrow.core.request import FinishReason, MediaSpan, Request
from sparrow.core.sampling_params import SamplingParams
from sparrow.core.scheduler import RequestOutput, Scheduler
from sparrow.distributed import group
from sparrow.distributed.shard import Shard
from sparrow.engine.client import EngineInfo, EngineStats, check_token_ids
from sparrow.engine.executor import RankedRunner, Ranks, rank_device
from sparrow.engine.output_processor import OutputProcessor, PromptLogprobEntry
from sparrow.engine.resolve import resolve, resolve_device
from sparrow.loader.model import checkpoint_dir, load_model, resolve_checkpoint
from sparrow.models import get_architecture
from sparrow.multimodal.items import MediaItem
from sparrow.tokenizer import load_tokenizer
from sparrow.worker.grammar import GrammarCompiler
from sparrow.worker.model_runner import LaunchedStep, ModelRunner

_InFlight = tuple[list[str], LaunchedStep]  # the requests sampling in a step, its tokens


class StepFailed(RuntimeError):
    """A step raised; `request_ids` are the requests it ran (its plan and the step in
    flight), already finished and freed; `cause` is what was raised."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"a step of {len(request_ids)} requests failed: {cause!r}")
        self.request_ids, self.cause = request_ids, cause


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_logprobs: list[PromptLogprobEntry] | None = None  # when asked for


class LLM:
    def __init__(
        self,
        model: str | Path | torch.nn.Module | None = None,
        config: EngineConfig | None = None,
        *,
        progress: bool = False,
        **settings: Any,
    ):
        """model: a checkpoint directory, a Hugging Face Hub id (`owner/name`, with
        `revision=` and `download_dir=`; the snapshot is resolved once, its directory is
        `config.model` after), None for the built-in default, or a model already in memory
        (prompts then go in as token ids). `config` or keyword shortcuts of
        `EngineConfig.from_kwargs` (`max_model_len=`, `max_num_seqs=`, `enforce_eager=`,
        `gpu_memory_utilization=`, `dtype=`, `device=`, `quantize="4bit"`, `load_format=
        "dummy"`, `block_size=`, `num_blocks=`, ...), not both."""
        if config is not None and settings:
            raise ValueError("give an EngineConfig or keyword settings, not both")
        if isinstance(settings.get("dtype"), torch.dtype):
            settings["dtype"] = str(settings["dtype"]).removeprefix("torch.")
        in_memory = isinstance(model, torch.nn.Module)
        if config is None:
            config = EngineConfig.from_kwargs(model=None if in_memory else model, **settings)
        if not in_memory:
            config = resolve_checkpoint(config)
        self.config = config
        size = config.parallel.tensor_parallel_size
        self._ranks = None
        if in_memory:
            if size > 1:
                raise ValueError("tensor parallelism loads a checkpoint: give its directory")
            self.model, self.tokenizer = model, None
        else:
            shard = None
            device, dtype = resolve_device(config.device)
            if size > 1:  # ranks 1..size-1 in processes of their own, this one rank 0
                self._ranks = Ranks.start(config, device)
                weakref.finalize(self, self._ranks.stop)
                shard = Shard(0, size, config.parallel.enable_expert_parallel)
                device = rank_device(device, 0)
            self.model = load_model(config, device, dtype, progress, shard)
            self.tokenizer = load_tokenizer(checkpoint_dir(config))
        args = self.model.config
        self.scheduler_config, self.cache_config = resolve(config, self.model)
        if self._ranks is not None:  # every rank builds the same cache and runner
            group.broadcast_object((self.scheduler_config, self.cache_config))
        recurrent = slot_bytes(self.model.cache_specs(), 1) > 0
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, recurrent)
        self.runner = ModelRunner(
            self.model,
            self.scheduler_config,
            self.cache_config,
            cuda_graphs=not config.device.enforce_eager,
            batch_invariant=config.device.batch_invariant,
        )
        if self._ranks is not None:
            self.runner = RankedRunner(self.runner, self._ranks)
        self._in_flight: _InFlight | None = None  # launched, not read
        self._ids = itertools.count()
        turn_ends = get_architecture(args.architecture).SPEAKS.stop_tokens
        special = {self.tokenizer.token_id(t) for t in turn_ends} if self.tokenizer else set()
        self.default_stop_ids = tuple(sorted((special - {None}) | set(args.eos_token_ids)))
        self._grammars = None  # GrammarCompiler, built with the first structured request
        self._grammars_lock = threading.Lock()

    def warmup(self, lengths: tuple[int, ...] = (256, 1024, 4096), batch: int = 5) -> None:
        """Compile the kernels for prefill shapes before serving: one prompt of each length
        (the expert GEMM's row tiles depend on tokens per expert) and `batch` short prompts
        together (the paged attention path), one output token each. Decode shapes are
        compiled when the CUDA graphs are captured."""
        limit = self.scheduler.config.max_model_len - 1
        groups = [[[0] * min(n, limit)] for n in lengths] + [[[0] * min(64, limit)] * batch]
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for prompts in groups:
            self.generate(prompts, params)

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        media: Sequence[MediaItem] = (),
    ) -> Request:
        """A validated request (not queued yet): ValueError if it can never run. Stop token
        ids default to the model's end tokens unless `params` gives some or ignores EOS; a
        resumed request's `output_offset` is at most the prompt's length.
        `media`: its images and videos, whose placeholder runs the prompt holds (a model
        without a vision tower refuses them). Reads only settings: safe to call from another
        thread than the one stepping."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop):
            raise ValueError(
                "this engine has no tokenizer: give prompts as token ids and no stop strings"
            )
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.output_offset > len(ids):
            raise ValueError(
                f"output_offset ({params.output_offset}) counts more tokens than the prompt "
                f"has ({len(ids)}): it must be in [0, {len(ids)}]"
            )
        check_token_ids(ids, params, self.model.config.vocab_size)
        params = params.stopping_at(self.default_stop_ids)
        if params.grammar is not None:
            self.grammar_compiler().compile(params.grammar)  # ValueError if it does not
        request = Request(request_id or f"req-{next(self._ids)}", ids, params)
        if media:
            if self.model.visual is None:
                raise ValueError("this model has no vision tower: it takes text only")
            merge = self.runner.media.merge
            digests = [item.digest for item in media]
            if self.model.joint_media and len(media) > 1:
                # each item's embeddings depend on every item: so do the cached blocks
                digests = ["+".join(digests)] * len(media)
            request.media = tuple(
                MediaSpan(*item.span(merge), d) for item, d in zip(media, digests, strict=True)
            )
            if any(s.start < 0 or s.start + s.length > len(ids) for s in request.media):
                raise ValueError("a media item's placeholder runs pass the prompt's end")
        self.scheduler.validate(request)
        return request

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        media: Sequence[MediaItem] = (),
    ) -> Request:
        """Make (`make_request`) and queue a request."""
        request = self.make_request(prompt, params, request_id, media)
        self.admit(request, media)
        return request

    def admit(self, request: Request, media: Sequence[MediaItem] = ()) -> None:
        """Queue a request from `make_request` with the media it was made with."""
        if media:
            self.runner.media.add(request.request_id, list(media), len(request.prompt_token_ids))
        spec = request.params.grammar
        if spec is not None:
            # a request that ignores EOS still ends its grammar with an end token
            stops = request.params.stop_token_ids or self.default_stop_ids
            prompt, offset = request.prompt_token_ids, request.params.output_offset
            self.runner.add_grammar(
                request.request_id,
                self.grammar_compiler().compile(spec),
                stops,
                spec.after,
                prompt[len(prompt) - offset :],
            )
        try:
            self.scheduler.add_request(request)
        except ValueError:
            self.runner.free(request.request_id)
            raise

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do in one process)."""
        if self._ranks is not None:
            self._ranks.stop()

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of structured-output grammars over this engine's tokenizer, built on
        first use (~1.5 s for the 248K vocabulary); ValueError without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: structured output needs one")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.model.config.vocab_size, self.default_stop_ids
                )
            return self._grammars

    def step(self) -> list[RequestOutput]:
        """Plan and launch a step, then take the tokens of the step before it (one step in
        flight: the host plans the next step while the device runs this one). Returns what
        requests gained from that earlier step. Raises `StepFailed` if launching this step
        or reading the earlier one's tokens raises: the requests of both are finished
        (ABORT) and freed by then, and the engine can go on with the others."""
        plan = self.scheduler.schedule()
        in_flight, self._in_flight = self._in_flight, None
        try:
            launched = self.runner.execute(plan, self.scheduler.requests)
        except Exception as e:
            raise self._fail(list(plan.num_scheduled_tokens), [], in_flight, e) from e
        sampling = self.scheduler.commit(plan)
        outputs = []
        if in_flight is not None:
            try:
                tokens = in_flight[1].tokens()
            except Exception as e:
                raise self._fail(list(plan.num_scheduled_tokens), sampling, in_flight, e) from e
            outputs = self._resolve(in_flight[0], in_flight[1], tokens)
        self._in_flight = (sampling, launched) if sampling else None
        return outputs

    def has_unfinished(self) -> bool:
        """Requests to run, or a step in flight still to read (finished requests' tokens)."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def _resolve(
        self, sampling: list[str], launched: LaunchedStep, tokens: dict[str, list[int]]
    ) -> list[RequestOutput]:
        outputs = self.scheduler.resolve(sampling, tokens)
        for out in outputs:
            if out.request_id in launched.logprobs and out.new_token_ids:
                out.logprobs = [launched.logprobs[out.request_id]]
            if out.request_id in launched.prompt_logprobs:
                out.prompt_logprobs = launched.prompt_logprobs[out.request_id]
            if out.finish_reason is not None:
                self.runner.free(out.request_id)
        return outputs

    def _fail(
        self, planned: list[str], sampling: list[str], in_flight: _InFlight | None, cause: Exception
    ) -> StepFailed:
        """Drop the tokens of the failed step (`planned`, of which `sampling` committed) and
        of the one in flight, and abort every request they hold."""
        earlier = in_flight[0] if in_flight is not None else []
        self.scheduler.drop_pending(sampling)
        self.scheduler.drop_pending(earlier)
        failed = list(dict.fromkeys(planned + earlier))
        self.scheduler.uncache(failed)  # what their steps wrote is not to be reused
        for rid in failed:
            self.abort(rid)
        return StepFailed(failed, cause)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Finish a request now (STOP: a stop string ended it) and free what it holds."""
        if self.scheduler.abort(request_id, reason):
            self.runner.free(request_id)

    def abort_all(self) -> None:
        """Finish every request (ABORT) and drop the step in flight unread: after a failure
        nothing stays held."""
        if self._in_flight is not None:
            self.scheduler.drop_pending(self._in_flight[0])
            self._in_flight = None
        for rid in list(self.scheduler.requests):
            self.abort(rid)

    def output_processor(self) -> OutputProcessor:
        """An output processor that decodes with this engine's tokenizer (no text without
        one) and finishes here, with reason STOP, a request a stop string ended."""
        decode = self.tokenizer.decode if self.tokenizer is not None else _no_text
        special = self.tokenizer.skipped_ids if self.tokenizer is not None else frozenset()
        return OutputProcessor(
            decode, on_stop=lambda rid: self.abort(rid, FinishReason.STOP), special_ids=special
        )

    def info(self) -> EngineInfo:
        cache = self.cache_config
        return EngineInfo(
            self.scheduler.config.max_model_len,
            self.model.config.vocab_size,
            self.default_stop_ids,
            cache.num_blocks * cache.block_size,
            media=self.model.visual is not None,
            quantization=getattr(self.model, "weight_format", None),
        )

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            scheduler.num_waiting,
            len(scheduler.running),
            scheduler.kv.usage,
            scheduler.prefix_hit_rate,
            scheduler.snapshots.num_filed,
        )

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run all prompts to completion, batched; results in prompt order. The text stops
        before the first stop string, which ends its request (reason STOP)."""
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        processor = self.output_processor()
        done = {}
        for r in requests:
            processor.add(r.request_id, r.params)
            done[r.request_id] = Completion(r.request_id, r.prompt_token_ids, [], "", None)
        try:
            while self.has_unfinished():
                for delta in processor.process(self.step()):
                    completion = done[delta.request_id]
                    completion.token_ids += delta.token_ids
                    completion.text += delta.text
                    completion.finish_reason = delta.finish_reason
                    if delta.prompt_logprobs is not None:
                        completion.prompt_logprobs = delta.prompt_logprobs
        except BaseException:
            for rid in done:  # the engine stays usable for the next call
                self.abort(rid)
            raise
        return list(done.values())


def _no_text(ids: list[int]) -> str:
    return ""
