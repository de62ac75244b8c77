"""Activations shared by the Triton kernels, and `Glu`: which gated activation of a fused
gate_up's two halves a kernel computes (its constexprs)."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@triton.jit
def silu(x):
    """x * sigmoid(x), as x / (1 + e^-x): one division."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def glu(gate, up, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """The gated activation of gate and up (fp32 tiles of one shape), chosen at compile time:
    ACT "silu": silu(gate) * up (Qwen); "swiglu_oai": (clamp(up, -LIMIT, LIMIT) + 1) * g *
    sigmoid(ALPHA * g) with g = min(gate, LIMIT) (MiniMax M3; the products in HF's order)."""
    if ACT == "swiglu_oai":
        b_g = tl.minimum(gate, LIMIT)
        b_u = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        return (b_u + 1.0) * (b_g * tl.sigmoid(b_g * ALPHA))
    else:
        return silu(gate) * up


@dataclass(frozen=True)
class Glu:
    """The gated activation between an expert's gate_up and down projections, as the kernels'
    constexprs (`glu`): "silu" (the default) or "swiglu_oai" with its alpha and limit."""

    act: str = "silu"
    alpha: float = 0.0
    limit: float = 0.0

    def __post_init__(self) -> None:
        if self.act not in ("silu", "swiglu_oai"):
            raise ValueError(f"unknown gated activation {self.act!r}")

    @classmethod
    def swiglu_oai(cls, alpha: float, limit: float) -> Glu:
        return cls("swiglu_oai", float(alpha), float(limit))

    def meta(self) -> dict:
        """The kernel constexprs ACT, ALPHA, LIMIT."""
        return dict(ACT=self.act, ALPHA=self.alpha, LIMIT=self.limit)


SILU = Glu()
