"""MiniMax M3's MLPs: the SwiGLU-OAI activation, the dense MLP, and the sigmoid-routed MoE
(correction bias for the choice only, renormalised weights, routed sum scaled, one shared
expert), with the exact dtype handling of transformers 5.17's `MiniMaxM3VL*` modules on the
reference path. With the Triton backend the 4-bit routed experts run the fused expert
kernels (`kernels.moe.experts.moe_experts_routed`): the router's torch ops feed them its
routing, SwiGLU-OAI runs in the gate_up kernels' epilogue, and the combine kernel applies
the routed scale and adds the shared expert's output; no host sync."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.kernels.activations import Glu
from sparrow.layers.moe import Experts


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[.., 2I] (gate first, not interleaved) -> [.., I]:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


class DenseMLP(nn.Module):
    """down(swiglu_oai(gate_up(x))): the dense layers' MLP and the shared expert. gate_up
    rows: gate, then up (a checkpoint's separate gate/up projections fill the halves)."""

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))


class OAIExperts(Experts):
    """Routed experts with the SwiGLU-OAI activation (fused [E, 2I, H] / [E, H, I])."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        alpha: float,
        limit: float,
        expert_range: tuple[int, int] | None = None,
    ):
        super().__init__(num_experts, hidden, intermediate, expert_range)
        self.alpha, self.limit = alpha, limit

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu_oai(gate_up, self.alpha, self.limit)

    def glu(self) -> Glu:
        """The activation as the fused kernels take it."""
        return Glu.swiglu_oai(self.alpha, self.limit)

    def scaled_sum(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        scale: float,
        shared: torch.Tensor,
    ) -> torch.Tensor:
        """The MoE layer's output [T, H]: scale * the routed sum (rounded to x's dtype) +
        shared, the shared expert's output [T, H] (HF's `MiniMaxM3VLSparseMoeBlock`)."""
        return self(x, weights, ids).to(x.dtype) * scale + shared


class SigmoidRouter(nn.Module):
    """weight [E, H] and e_score_correction_bias [E]; float by Sparrow's policy (routing
    decides; `QuantizedSigmoidRouter` runs a checkpoint's quantised one)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] fp32 summing to 1, expert ids [T, k]): top-k of
        sigmoid(logits) + bias; the weights are the unbiased sigmoids, renormalised."""
        scores = torch.sigmoid(self.logits(x).float())
        _, ids = torch.topk(scores + self.e_score_correction_bias, top_k, dim=-1, sorted=False)
        weights = scores.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> router logits [T, E], in the weight's dtype."""
        return F.linear(x.to(self.weight.dtype), self.weight)


class SigmoidMoE(nn.Module):
    """experts(x) * routed_scale + shared_experts(x)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int,
        routed_scale: float,
        alpha: float,
        limit: float,
        expert_range: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.top_k, self.routed_scale = top_k, routed_scale
        self.gate = SigmoidRouter(hidden, num_experts)
        self.experts = OAIExperts(num_experts, hidden, intermediate, alpha, limit, expert_range)
        self.shared_experts = DenseMLP(hidden, shared_intermediate, alpha, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]. Each expert's output is weighted in fp32; the routed sum
        accumulates in x's dtype on the reference path (HF's eager experts), in fp32 on the
        GPU's grouped path (HF's `grouped_mm`) and in the fused 4-bit kernels, which also
        add the shared expert's output before rounding (`QuantizedOAIExperts.scaled_sum`)."""
        weights, ids = self.experts.held(*self.gate(x, self.top_k))
        return self.experts.scaled_sum(x, weights, ids, self.routed_scale, self.shared_experts(x))
