"""The offline engine: `LLM(model=...).generate(prompts, params)`.

Requests go through the scheduler (continuous batching by token budget, chunked prefill,
preemption) and the model runner, step by step, until all finish. `add_request` / `step` /
`abort` expose the same loop to a server.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.config import QuantConfig, load_model_config
from sparrow.core.block_pool import kv_blocks_for_memory
from sparrow.core.request import FinishReason, Request
from sparrow.core.sampling_params import SamplingParams
from sparrow.core.scheduler import RequestOutput, Scheduler, SchedulerConfig
from sparrow.loader.random_checkpoint import default_checkpoint, random_model
from sparrow.loader.weights import load_checkpoint
from sparrow.tokenizer import load_tokenizer
from sparrow.worker.model_runner import LaunchedStep, ModelRunner


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


class LLM:
    def __init__(
        self,
        model: str | Path | torch.nn.Module | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        quantize: str | None = None,
        scheduler: SchedulerConfig | None = None,
        progress: bool = False,
        cuda_graphs: bool = True,
        load_format: str = "auto",
    ):
        """model: a checkpoint directory, None for the built-in default, or a model already
        in memory (prompts then go in as token ids unless it is a directory's). quantize: None
        or "4bit" / "8bit" (group-affine, quantised on load). cuda_graphs: replay decode steps
        from captured graphs on a GPU (False: eager, like vLLM's enforce_eager). load_format
        "dummy": the directory's config.json and tokenizer with random weights (no
        safetensors needed; for benchmarks, as in vLLM)."""
        if isinstance(model, torch.nn.Module):
            self.model, self.tokenizer = model, None
            device = str(model.device)
        else:
            model_dir = Path(model) if model is not None else default_checkpoint()
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
            quant = QuantConfig.from_name(quantize)
            if load_format == "dummy":
                self.model = random_model(load_model_config(model_dir), 0, device, dtype, quant)
            elif load_format == "auto":
                self.model = load_checkpoint(model_dir, device, dtype, quantize=quant,
                                             progress=progress)  # fmt: skip
            else:
                raise ValueError(f"load_format {load_format!r}: expected 'auto' or 'dummy'")
            self.tokenizer = load_tokenizer(model_dir)
        cfg = self.model.config
        scheduler = scheduler or self._default_scheduler_config(device)
        detokenize = self.tokenizer.decode if self.tokenizer else None
        self.scheduler = Scheduler(scheduler, detokenize=detokenize)
        self.runner = ModelRunner(self.model, scheduler, cuda_graphs=cuda_graphs)
        self._in_flight: tuple[list[str], LaunchedStep] | None = None  # launched, not read
        self._ids = itertools.count()
        special = {self.tokenizer.token_id(t) for t in ("<|im_end|>", "<|endoftext|>")
                   } if self.tokenizer else set()  # fmt: skip
        self.default_stop_ids = tuple(sorted((special - {None}) | set(cfg.eos_token_ids)))

    def _default_scheduler_config(self, device: str) -> SchedulerConfig:
        """KV blocks from the memory left after the weights (GPU: 90% of what is free; CPU:
        enough for 8K tokens), printed so the budget is visible."""
        cfg = self.model.config
        base = SchedulerConfig(max_model_len=cfg.max_position_embeddings)
        per_block = self.model.cache_spec().kv_bytes_per_block(base.block_size, self.model.dtype)
        if device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            blocks = kv_blocks_for_memory(free, per_block, reserve_fraction=0.1)
        else:
            blocks = 8192 // base.block_size
        if blocks < 1:
            raise RuntimeError("no memory left for the KV cache after loading the weights")
        print(f"[sparrow] KV cache: {blocks} blocks of {base.block_size} tokens "
              f"({blocks * per_block / 2**30:.2f} GiB)", file=sys.stderr)  # fmt: skip
        return dataclasses.replace(base, num_blocks=blocks)

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

    def make_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        """A validated request (not queued yet): ValueError if it can never run."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: give prompts as token ids")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not params.stop_token_ids and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=self.default_stop_ids)
        request = Request(f"req-{next(self._ids)}", ids, params)
        self.scheduler.validate(request)
        return request

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        request = self.make_request(prompt, params)
        self.scheduler.add_request(request)
        return request

    def step(self) -> list[RequestOutput]:
        """Plan and launch a step, then take the tokens of the step before it (one step in
        flight: the host plans the next step while the device runs this one). Returns what
        requests gained from that earlier step."""
        plan = self.scheduler.schedule()
        launched = self.runner.execute(plan, self.scheduler.requests)
        sampling = self.scheduler.commit(plan)
        outputs = self._resolve(*self._in_flight) if self._in_flight else []
        self._in_flight = (sampling, launched) if sampling else None
        return outputs

    def _resolve(self, sampling: list[str], launched: LaunchedStep) -> list[RequestOutput]:
        outputs = self.scheduler.resolve(sampling, launched.tokens())
        for out in outputs:
            if out.request_id in launched.logprobs and out.new_token_ids:
                out.logprobs = [launched.logprobs[out.request_id]]
            if out.finish_reason is not None:
                self.runner.free(out.request_id)
        return outputs

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id):
            self.runner.free(request_id)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run all prompts to completion, batched; results in prompt order."""
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        while self.scheduler.has_unfinished():
            self.step()
        return [
            Completion(r.request_id, r.prompt_token_ids, r.output_token_ids,
                       self.tokenizer.decode(r.output_token_ids) if self.tokenizer else "",
                       r.finish_reason)
            for r in requests
        ]  # fmt: skip
