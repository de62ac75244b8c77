"""Offline generation on the reference model: prefill, then token-by-token cached decode."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from sparrow.core.sampling_params import SamplingParams
from sparrow.worker.sampler import random_seed, sample
from sparrow.worker.sequences import SequenceBatch


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)

    def summary(self) -> str:
        pre = self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0
        dec = (
            (self.decode_tokens - 1) / self.decode_s
            if self.decode_s and self.decode_tokens > 1
            else 0.0
        )
        return (
            f"prompt: {self.prompt_tokens} tokens, {pre:.1f} tok/s | "
            f"decode: {self.decode_tokens} tokens, {dec:.1f} tok/s"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    params: SamplingParams,
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Yield generated token ids one by one (the stop token, if hit, is yielded last).
    Decode tok/s counts the steps after the first token (the first comes from prefill)."""
    cfg, device = model.config, model.device
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) + params.max_tokens > cfg.max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"model's context of {cfg.max_context} tokens"
        )
    if max(prompt_ids) >= cfg.vocab_size or min(prompt_ids) < 0:
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    seed = params.seed if params.seed is not None else random_seed()
    stop = set(params.stop_token_ids)
    batch = SequenceBatch(model, 1, len(prompt_ids) + params.max_tokens)
    t0 = time.perf_counter()
    hidden = batch.forward([prompt_ids])
    token = sample(model.logits(hidden[-1:]), params, seed, params.output_offset)
    _sync(device)
    stats.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(params.max_tokens):
        tok = int(token)
        stats.decode_tokens, stats.decode_s = i + 1, time.perf_counter() - t0
        stats.token_ids.append(tok)
        yield tok
        if tok in stop or i + 1 == params.max_tokens:
            return
        hidden = batch.forward([token])
        token = sample(model.logits(hidden), params, seed, params.output_offset + i + 1)
