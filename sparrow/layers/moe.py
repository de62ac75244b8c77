"""Sparse MoE of Qwen3.5/3.6: softmax router, top-k renormalised, SwiGLU experts, and one
shared expert scaled by a sigmoid gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.config import ModelConfig


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E]. Returns (weights [T, k] in the logits' dtype, expert ids [T, k]):
    softmax in fp32 over all experts, top-k, renormalised to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class SwiGLU(nn.Module):
    """The shared expert: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts stored fused, as HF keeps them in memory:
    gate_up_proj [E, 2I, hidden] (gate rows first), down_proj [E, hidden, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Float (gate_up [2I, hidden], down [hidden, I]) of expert e."""
        return self.gate_up_proj[e], self.down_proj[e]

    def route_and_run(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int):
        """Route (softmax top-k) and run the experts: [T, hidden] -> [T, hidden]."""
        weights, ids = route(router_logits, top_k)
        return self(x, weights, ids)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights, ids: [T, k]. Loops over the experts that received rows."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            gate_up, down = self.expert_weights(e)
            gate, up = F.linear(x[token], gate_up.to(x.dtype)).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down.to(x.dtype)) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        routed = self.experts.route_and_run(x, self.gate(x), self.top_k)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
