"""Sparse MoE of Qwen3.5/3.6 and Qwen3-MoE: softmax router, top-k renormalised, SwiGLU
experts, and (Qwen3.5/3.6) one shared expert scaled by a sigmoid gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.distributed import group
from sparrow.kernels import use_triton
from sparrow.kernels.moe import naive
from sparrow.layers.linear import Projections


class SwiGLU(Projections, nn.Module):
    """The shared expert: down(silu(gate(x)) * up(x))."""

    FUSED = {"gate_up": ("gate_proj", "up_proj")}

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mods = self.projections()
        if mods is not None and hasattr(mods[0], "swiglu"):  # quantised: one kernel
            return self.down_proj(mods[0].swiglu(x))
        gate, up = self.project("gate_up", x)
        return self.down_proj(F.silu(gate) * up)

    def projections(self) -> tuple[nn.Module, nn.Module] | None:
        """(gate_up, down) as two modules when gate and up are fused (without padding rows:
        the halves are gate and up), else None."""
        fused = self.fused("gate_up")
        return (fused.whole, self.down_proj) if fused is not None and not fused.pad else None


class Experts(nn.Module):
    """Routed experts stored fused, as HF keeps them in memory:
    gate_up_proj [E, 2I, hidden] (gate rows first), down_proj [E, hidden, I]."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        expert_range: tuple[int, int] | None = None,
    ):
        """expert_range: (first, count) of the router's experts held here (expert
        parallelism: the others' assignments contribute nothing here); None: all."""
        super().__init__()
        self.expert_range = expert_range
        held = expert_range[1] if expert_range else num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(held, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(held, hidden, intermediate))

    def held(self, weights: torch.Tensor, ids: torch.Tensor):
        """A routing (weights, ids [T, k] over all experts) as these experts take it: ids of
        experts held elsewhere get weight 0 and stand on expert 0 (no host sync)."""
        if self.expert_range is None:
            return weights, ids
        local, mine = group.local_ids(ids, self.expert_range)
        return weights * mine, local

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Float (gate_up [2I, hidden], down [hidden, I]) of expert e."""
        return self.gate_up_proj[e], self.down_proj[e]

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The GLU between the two projections: [.., 2I] -> [.., I]."""
        return naive.swiglu(gate_up)

    def route_and_run(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        top_k: int,
        shared: SwiGLU | None = None,
        shared_gate: torch.Tensor | None = None,
    ):
        """Route (softmax top-k) and run the experts: [T, hidden] -> [T, hidden]. With a
        shared expert and its gate logit [T, 1], add sigmoid(gate) * shared(x)."""
        weights, ids = self.held(*naive.route(router_logits, top_k))
        out = self(x, weights, ids)
        return out if shared is None else out + torch.sigmoid(shared_gate) * shared(x)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights, ids: [T, k]. Reference: loops over the experts that
        received rows (reads them on the host). On a GPU with the kernel backend: grouped
        GEMMs (bf16), or for other dtypes a gather of each assignment's weights (small test
        models); both without host sync."""
        if use_triton(x) and x.is_cuda:
            grouped = self._grouped if x.dtype == torch.bfloat16 else self._gathered
            return grouped(x, weights, ids)
        return naive.experts(x, weights, ids, self.expert_weights, self.activation)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """Assignments sorted by expert, then torch's grouped GEMM per projection: no host
        sync (group ends come from a scatter-add, not bincount), so it can be captured."""
        t, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        rows = x[order // k]
        gate_up = torch._grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=ends)
        y = torch._grouped_mm(self.activation(gate_up), self.down_proj.transpose(-2, -1), offs=ends)
        y = y * weights.flatten()[order, None]
        out = torch.empty_like(y).index_copy_(0, order, y)
        return out.view(t, k, -1).sum(1)

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """One weight copy per assignment, then batched matmuls (any dtype, small models)."""
        t, k = ids.shape
        flat = ids.flatten()
        rows = x.repeat_interleave(k, dim=0)[:, :, None]  # assignment a = t * k + slot
        h = self.activation(torch.bmm(self.gate_up_proj[flat].to(x.dtype), rows)[..., 0])
        h = h[:, :, None]
        y = torch.bmm(self.down_proj[flat].to(x.dtype), h)[..., 0] * weights.reshape(-1, 1)
        return y.view(t, k, -1).sum(1)


class SparseMoE(Projections, nn.Module):
    FUSED = {"gates": ("gate", "shared_expert_gate")}  # the router and the shared expert's

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int,
        expert_range: tuple[int, int] | None = None,
    ):
        """shared_intermediate: the shared expert's width; 0: no shared expert."""
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.experts = Experts(num_experts, hidden, intermediate, expert_range)
        if shared_intermediate:
            self.shared_expert = SwiGLU(hidden, shared_intermediate)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        else:  # the router alone: nothing to fuse
            self.shared_expert, self.FUSED = None, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        if self.shared_expert is None:
            return self.experts.route_and_run(x, self.gate(x), self.top_k)
        router_logits, shared_gate = self.project("gates", x)
        return self.experts.route_and_run(
            x, router_logits, self.top_k, self.shared_expert, shared_gate
        )
