"""The shared expert of a MoE layer as the expert kernels take it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Shared:
    """The shared expert of a MoE layer: its gate logit [T, 1] and its output [T, D], or its
    weights `gate_up`, `down` (packed triples shaped like one routed expert's): then it runs
    as one more assignment per token, weight sigmoid(gate), in the experts' kernels."""

    gate: torch.Tensor
    output: torch.Tensor | None = None
    weights: tuple[tuple, tuple] | None = None


def shared_expert_args(shared_w, packed: torch.Tensor, scales: torch.Tensor) -> tuple:
    """The (packed words, scales, biases) kernel arguments of a shared expert run beside the
    routed experts `packed`, `scales` ([E, rows, ...]); (None,) * 3 without one."""
    if shared_w is None:
        return (None,) * 3
    if shared_w[0].stride(0) != packed.stride(-2) or shared_w[1].stride(0) != scales.stride(-2):
        raise ValueError("the shared expert's rows must be laid out like a routed expert's")
    return (shared_w[0].view(torch.int32), *shared_w[1:])
