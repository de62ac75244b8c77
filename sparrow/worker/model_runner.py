"""Runs the model for one scheduler step.

The runner owns the cache tensors (paged K/V, recurrent-state pools) sized by the scheduler's
config; the scheduler owns which blocks and slots each request holds. For each planned
request it feeds the next `num_tokens` of its uncomputed tokens, batched back to back, and
samples a token for every request whose input is now complete. On a GPU, steps where every
request brings exactly its one next token (decode) replay a captured CUDA graph
(`cuda_graphs.DecodeGraphs`); prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import itertools

import torch

from sparrow.core.request import Request
from sparrow.core.sampling_params import TokenLogprob
from sparrow.core.scheduler import SchedulerConfig, SchedulerOutput
from sparrow.worker.cache import ModelCache, build_metadata
from sparrow.worker.cuda_graphs import DecodeGraphs
from sparrow.worker.sampler import sample_rows, token_logprob


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: SchedulerConfig, cuda_graphs: bool = True):
        """cuda_graphs: capture decode steps (GPU only; False runs every step eagerly)."""
        self.model = model
        self.cache = ModelCache(model.cache_spec(), config.num_blocks, config.block_size,
                                config.num_state_slots, model.device, model.dtype)  # fmt: skip
        self.generators: dict[str, torch.Generator] = {}
        self.graphs = None
        if cuda_graphs and model.device.type == "cuda":
            max_blocks = -(-config.max_model_len // config.block_size)
            self.graphs = DecodeGraphs(model, self.cache, config.max_num_seqs, max_blocks)
            self.graphs.capture()

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
        done = [rid for rid, c, t in zip(rids, computed, tokens, strict=True)
                if c + len(t) == requests[rid].num_tokens]  # fmt: skip
        tables, slots = [plan.block_tables[r] for r in rids], [plan.state_slots[r] for r in rids]
        is_decode = len(done) == len(rids) and all(len(t) == 1 for t in tokens)
        if is_decode and self.graphs is not None and self.graphs.padded_size(len(rids)):
            logits = self.graphs.run([t[0] for t in tokens], computed, tables, slots)
        else:
            meta = build_metadata(tokens, computed, tables, slots, self.cache.block_size, device)
            hidden = self.model(meta, self.cache)
            ends = list(itertools.accumulate(meta.seq_lens))  # host side: no device sync
            finished = set(done)
            last = [ends[i] - 1 for i, rid in enumerate(rids) if rid in finished]
            if not last:
                return {}, {}
            logits = self.model.logits(hidden[last])
        params = [requests[rid].params for rid in done]
        gens = [self._generator(rid, p.seed) for rid, p in zip(done, params, strict=True)]
        chosen = sample_rows(logits, params, gens)
        sampled = {rid: [token] for rid, token in zip(done, chosen, strict=True)}
        logprobs = {rid: token_logprob(logits[row], chosen[row], p.logprobs)
                    for row, (rid, p) in enumerate(zip(done, params, strict=True))
                    if p.logprobs is not None}  # fmt: skip
        return sampled, logprobs

    def _generator(self, rid: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if rid not in self.generators:
            self.generators[rid] = torch.Generator(device=self.model.device).manual_seed(seed)
        return self.generators[rid]
