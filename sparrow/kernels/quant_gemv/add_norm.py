"""A sub-layer's output projection, the residual add and the next RMSNorm in one kernel, for
one token (batch-1 decode): res = residual + x W^T, y = rms_norm(res) * (1 + w). The same
as `quant_gemv` then `add_rms_norm`, one launch instead of two.

Programs own BLOCK_N outputs as in the row GEMV (`gemv_rows`); each adds its part of the
residual and stores it, and the last program to finish (`counters`) normalises the whole
row from the stored sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.counters import counters, last_to_arrive
from sparrow.kernels.pdl import launch_args, let_next_launch
from sparrow.kernels.quant_gemv.gemv import default_config, gemv_rows, row_tiles
from sparrow.kernels.rms_norm.norm import _inv_rms, _scaled
from sparrow.quant.affine import QuantSpec


@triton.jit
def _gemv_add_norm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, r_ptr, res_ptr, nw_ptr, y_ptr, count_ptr, eps, K,
    stride_wn, stride_sn,
    N: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    let_next_launch(USE_PDL)  # `gemv_rows` waits after its first weight loads
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_y = gemv_rows(x_ptr, w_ptr, s_ptr, b_ptr, o_n, m_n, K, stride_wn, stride_sn, BITS, GROUP,
                    BLOCK_N, BLOCK_K, PACKED, True, USE_PDL)  # fmt: skip
    # the projection rounded to the activation dtype, then added as `add_rms_norm` adds
    b_res = b_y.to(res_ptr.dtype.element_ty) + tl.load(r_ptr + o_n, mask=m_n, other=0.0)
    tl.store(res_ptr + o_n, b_res, mask=m_n)
    if last_to_arrive(count_ptr, tl.num_programs(0)):  # the row's last program
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < N
        b_x = tl.load(res_ptr + o_d, mask=m_d, other=0.0, cache_modifier=".cg").to(tl.float32)
        b_out = _scaled(b_x, _inv_rms(b_x, eps, N), nw_ptr, o_d, m_d)
        tl.store(y_ptr + o_d, b_out.to(y_ptr.dtype.element_ty), mask=m_d)


def gemv_add_rms_norm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    spec: QuantSpec,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [1, K]; packed / scales / biases: W [N, K] quantised (MLX layout); residual: [1, N]
    in x's dtype; weight: the norm's [N] (zero-centred: the scale is 1 + w). Returns
    (residual + x W^T, its RMSNorm), both [1, N] in x's dtype."""
    n, k = packed.shape[0], x.shape[-1]
    if x.shape[0] != 1 or residual.shape != (1, n) or weight.shape != (n,):
        raise ValueError(f"x {list(x.shape)}, residual {list(residual.shape)}, norm weight "
                         f"{list(weight.shape)}: expected one row and {n} outputs")  # fmt: skip
    if scales.shape != (n, k // spec.group_size) or residual.dtype != x.dtype:
        raise ValueError(f"scales {list(scales.shape)} / residual {residual.dtype} do not fit "
                         f"x {list(x.shape)} {x.dtype}")  # fmt: skip
    x, residual = x.contiguous(), residual.contiguous()
    res = torch.empty_like(residual)
    y = torch.empty_like(residual)
    block_n, block_k, num_warps = default_config(n, k)
    _gemv_add_norm_kernel[(triton.cdiv(n, block_n),)](
        x, packed.view(torch.int32), scales, biases, residual, res, weight, y,
        counters(x.device, 1), eps, k, packed.stride(0), scales.stride(0),
        N=n, BLOCK_D=triton.next_power_of_2(n), **row_tiles(x, k, spec, block_n, block_k),
        num_warps=num_warps, **launch_args(y),
    )  # fmt: skip
    return res, y
