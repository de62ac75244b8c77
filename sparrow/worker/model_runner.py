"""Runs the model for one scheduler step (the reference path: per-request state objects).

For each planned request it feeds the next `num_tokens` of its uncomputed tokens, batched
back to back, and samples a token for every request whose input is now complete. The
engine issue replaces the per-request states with pooled caches and CUDA-graph decode.
"""

from __future__ import annotations

import torch

from sparrow.core.request import Request
from sparrow.core.scheduler import SchedulerOutput
from sparrow.worker.sampler import sample


class ModelRunner:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.states: dict[str, object] = {}  # request id -> the model's SequenceState
        self.generators: dict[str, torch.Generator] = {}

    def free(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, requests: dict[str, Request]) -> dict[str, list[int]]:
        """Returns {request_id: [sampled token]} for requests that completed their input."""
        for rid in plan.preempted_ids:
            self.states.pop(rid, None)  # recomputed from scratch when readmitted
        if not plan.num_scheduled_tokens:
            return {}
        ids, lens, states, last = [], [], [], {}
        for rid, n in plan.num_scheduled_tokens.items():
            request = requests[rid]
            if rid in plan.new_request_ids or rid not in self.states:
                self.states[rid] = self.model.new_state()
            start = request.num_computed_tokens
            ids.extend(request.all_token_ids[start : start + n])
            lens.append(n)
            states.append(self.states[rid])
            if start + n == request.num_tokens:  # input complete: sample from its last row
                last[rid] = sum(lens) - 1
        device = self.model.device
        hidden = self.model(torch.tensor(ids, device=device), lens, states)
        if not last:
            return {}
        logits = self.model.logits(hidden[list(last.values())])
        sampled = {}
        for row, rid in enumerate(last):
            params = requests[rid].params
            token = sample(logits[row : row + 1], params, self._generator(rid, params.seed))
            sampled[rid] = [int(token)]
        return sampled

    def _generator(self, rid: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if rid not in self.generators:
            self.generators[rid] = torch.Generator(device=self.model.device).manual_seed(seed)
        return self.generators[rid]
