"""Runs the model for one scheduler step.

The runner owns the cache tensors (paged K/V, recurrent-state pools) sized by the scheduler's
config; the scheduler owns which blocks and slots each request holds. For each planned
request it feeds the next `num_tokens` of its uncomputed tokens, batched back to back, and
samples a token for every request whose input is now complete.
"""

from __future__ import annotations

import itertools

import torch

from sparrow.core.request import Request
from sparrow.core.sampling_params import TokenLogprob
from sparrow.core.scheduler import SchedulerConfig, SchedulerOutput
from sparrow.worker.cache import ModelCache, build_metadata
from sparrow.worker.sampler import sample, token_logprob


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: SchedulerConfig):
        self.model = model
        self.cache = ModelCache(model.cache_spec(), config.num_blocks, config.block_size,
                                config.num_state_slots, model.device, model.dtype)  # fmt: skip
        self.generators: dict[str, torch.Generator] = {}

    def free(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(
        self, plan: SchedulerOutput, requests: dict[str, Request]
    ) -> tuple[dict[str, list[int]], dict[str, TokenLogprob]]:
        """Returns ({request_id: [sampled token]}, {request_id: its logprobs}) for requests
        that completed their input (logprobs only where the request asked)."""
        if not plan.num_scheduled_tokens:
            return {}, {}
        device = self.model.device
        if plan.new_request_ids:  # (re)started requests begin from zero recurrent state
            fresh = [plan.state_slots[rid] for rid in plan.new_request_ids]
            self.cache.reset_slots(torch.tensor(fresh, device=device))
        rids = list(plan.num_scheduled_tokens)
        computed = [requests[rid].num_computed_tokens for rid in rids]
        tokens = [requests[rid].all_token_ids[c : c + plan.num_scheduled_tokens[rid]]
                  for rid, c in zip(rids, computed, strict=True)]  # fmt: skip
        meta = build_metadata(tokens, computed, [plan.block_tables[r] for r in rids],
                              [plan.state_slots[r] for r in rids], self.cache.block_size,
                              device)  # fmt: skip
        hidden = self.model(meta, self.cache)
        ends = list(itertools.accumulate(meta.seq_lens))  # host side: no device sync
        done = [(i, rid) for i, rid in enumerate(rids)
                if computed[i] + len(tokens[i]) == requests[rid].num_tokens]  # fmt: skip
        if not done:
            return {}, {}
        logits = self.model.logits(hidden[[ends[i] - 1 for i, _ in done]])
        sampled, logprobs = {}, {}
        for row, (_, rid) in enumerate(done):
            params = requests[rid].params
            token = int(sample(logits[row : row + 1], params, self._generator(rid, params.seed)))
            sampled[rid] = [token]
            if params.logprobs is not None:
                logprobs[rid] = token_logprob(logits[row], token, params.logprobs)
        return sampled, logprobs

    def _generator(self, rid: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if rid not in self.generators:
            self.generators[rid] = torch.Generator(device=self.model.device).manual_seed(seed)
        return self.generators[rid]
