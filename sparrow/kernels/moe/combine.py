"""The MoE layer's output from the experts' weighted rows: out[t] = scale * sum_j
partial[t * k + j] (+ sigmoid(gate[t]) * shared[t], or + shared[t] for an ungated shared
expert: its output run apart from the experts' kernels), one program per token and 1024
columns (`naive.combine`). The scale (MiniMax M3's routed_scaling_factor) is a constexpr:
1 compiles no multiply.

The sum done by the next residual add + norm instead (the layer returning its rows unsummed,
one kernel fewer per layer) is no faster: end to end on the H200, alternating in one run,
decode at 4K 524.2 against 526.4 tok/s, 8 concurrent 1,594 against 1,602, prefill 4K the
same; at batch 1 the add + norm is one program, which then reads all nine fp32 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.launch import fast
from sparrow.kernels.pdl import launch_args, wait_for_previous


@triton.jit
def _combine_kernel(
    p_ptr,
    s_ptr,
    g_ptr,
    o_ptr,
    D,
    stride_g,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    SHARED_GATE: tl.constexpr = True,
    SCALE: tl.constexpr = 1.0,
):
    """out[t] = SCALE * sum_j partial[t, j] (+ sigmoid(gate[t]) * shared[t], or + shared[t]
    without SHARED_GATE) (see naive.combine); gate rows stride_g apart (a column of the fused
    router output)."""
    wait_for_previous(USE_PDL)
    i_t, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BLOCK + tl.arange(0, BLOCK)
    m_d = o_d < D
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        b_acc += tl.load(p_ptr + (i_t * TOP_K + j) * D + o_d, mask=m_d, other=0.0)
    if SCALE != 1.0:
        b_acc *= SCALE
    if HAS_SHARED:
        if SHARED_GATE:
            b_g = tl.sigmoid(tl.load(g_ptr + i_t * stride_g).to(tl.float32))
            b_acc += b_g * tl.load(s_ptr + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        else:
            b_acc += tl.load(s_ptr + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(o_ptr + i_t * D + o_d, b_acc.to(o_ptr.dtype.element_ty), mask=m_d)


def combine(
    partial: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype,
    shared_output: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """partial [T * top_k, D] (the weighted expert rows, token-major) -> out [T, D] in
    out_dtype: each token's rows summed and times scale, plus a shared expert's output [T, D]
    if given: sigmoid(shared_gate) * shared_output with its gate logit [T, 1] (any row
    stride), shared_output alone without one."""
    t, d = partial.shape[0] // top_k, partial.shape[1]
    out = torch.empty(t, d, device=partial.device, dtype=out_dtype)
    shared = shared_output is not None
    s = shared_output.contiguous() if shared else partial
    g = shared_gate if shared_gate is not None else partial
    grid = (t, triton.cdiv(d, 1024))
    fast(_combine_kernel)[grid](
        partial,
        s,
        g,
        out,
        d,
        g.stride(0),
        TOP_K=top_k,
        HAS_SHARED=shared,
        BLOCK=1024,
        SHARED_GATE=shared_gate is not None,
        SCALE=float(scale),
        **launch_args(out, grid),
    )
    return out
