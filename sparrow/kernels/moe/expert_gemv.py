"""The routed experts at decode sizes (up to `experts.GEMV_TOKENS` tokens): each assignment
a = t * top_k + slot runs as one row of a row GEMV over its expert's weights
(`quant_gemv.rows.gemv_rows`), gate_up with the gated activation in its epilogue
(`activations.glu`: silu(gate) * up, or SwiGLU-OAI), down with the routing weight applied:

    h[a]       = glu(x[t] @ Wg[e]^T, x[t] @ Wu[e]^T)      e = ids[a]
    partial[a] = w[a] * (h[a] @ Wd[e]^T)                   fp32, summed by the combine
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparrow.kernels.activations import SILU, Glu
from sparrow.kernels.launch import fast
from sparrow.kernels.moe.shared import shared_expert_args
from sparrow.kernels.quant_gemv.gemv import GemvTiles, row_meta
from sparrow.kernels.quant_gemv.rows import gated_rows, gemv_rows, start_gemv
from sparrow.quant.affine import QuantSpec


@triton.jit
def _expert_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    rw_ptr,
    ids_ptr,
    sw_ptr,
    ss_ptr,
    sb_ptr,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ym,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    GATED: tl.constexpr,
    APPLY_WEIGHT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    F16_DOT: tl.constexpr,
    LATE_TRIGGER: tl.constexpr,
    X_IN_PLACE: tl.constexpr,
    ONE_STEP: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    """One program: BLOCK_N outputs of assignment row i_m = t * TOP_K + slot, over the
    weights of expert ids[i_m] (W a stack of experts [E, ...]). SHARED: the last slot of
    each token reads the shared expert's weights (sw, ss, sb: one expert's shape) instead.
    GATED: y = glu(x W[:N]^T, x W[N:]^T) (ACT, ALPHA, LIMIT: `activations.glu`) with x read
    by token i_m // TOP_K;
    APPLY_WEIGHT: y scaled by the routing weight rw[i_m]. PREFETCH: see `gemv_rows`; the ids
    are read before the wait too, so they must come from a kernel that finished before the
    previous one let this one launch (the previous one launched with LATE_TRIGGER: the next
    kernel launches only once every program here has waited for the previous one)."""
    start_gemv(PREFETCH, LATE_TRIGGER, USE_PDL)
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    i_e = tl.load(ids_ptr + i_m).to(tl.int64)
    w_ptr = w_ptr + i_e * stride_we
    s_ptr, b_ptr = s_ptr + i_e * stride_se, b_ptr + i_e * stride_se
    if SHARED:
        if i_m % TOP_K == TOP_K - 1:
            w_ptr, s_ptr, b_ptr = sw_ptr, ss_ptr, sb_ptr
    if GATED:
        p_x = x_ptr + (i_m // TOP_K) * stride_xm
        b_y = gated_rows(
            p_x,
            w_ptr,
            s_ptr,
            b_ptr,
            i_n,
            N,
            K,
            stride_wn,
            stride_sn,
            BITS,
            GROUP,
            BLOCK_N,
            BLOCK_K,
            PACKED,
            PREFETCH,
            USE_PDL,
            F16_DOT,
            X_IN_PLACE,
            ONE_STEP,
            ACT,
            ALPHA,
            LIMIT,
        )
    else:
        p_x = x_ptr + i_m * stride_xm
        b_y = gemv_rows(
            p_x,
            w_ptr,
            s_ptr,
            b_ptr,
            o_n,
            m_n,
            K,
            stride_wn,
            stride_sn,
            BITS,
            GROUP,
            BLOCK_N,
            BLOCK_K,
            PACKED,
            PREFETCH,
            USE_PDL,
            F16_DOT,
            X_IN_PLACE=X_IN_PLACE,
            ONE_STEP=ONE_STEP,
        )
    if APPLY_WEIGHT:
        b_y *= tl.load(rw_ptr + i_m)
    tl.store(y_ptr + i_m * stride_ym + o_n, b_y.to(y_ptr.dtype.element_ty), mask=m_n)


@dataclass(frozen=True)
class ExpertGemvTiles:
    """Tiles of the two expert GEMVs, from sweeps of the whole MoE layer on the H200 (graph,
    1 / 8 tokens): gate_up (gate and up rows in one tile) 16 x 1024 with 4 warps (21.0 /
    64.8 us; 16 x 2048: 22.0 / 71.8, 4 x 2048 with 2 warps: 22.1 / 75.9), down (K = 512) 32
    x 512 with 2 warps (22.0 / 69.8; 16 x 512 with 4 warps: 22.6 / 76.1). Both with the
    products in fp16 pairs (`GemvTiles.f16_dot`).

    The layer as fewer kernels is slower (in a graph at 1 / 8 tokens, against 15.7 / 55.0
    us for these two GEMVs and the combine): the routing inside the gate_up kernel (each
    program routes its own token; no top-k kernel) 15.4 / 58.5; with the combine also inside
    the down kernel (a program per row block and token, summing its slots in order) 19.5 /
    70.8: each slot's id, then its weights, is a dependent load the program waits on in turn.
    Against 14.4 us (8 layers in a graph, 1 token): the chained down GEMV summing each
    token's rows itself (the last of its programs, a counter) 15.9; the whole layer in one
    kernel (programs synchronised by counters, routing in every program, down rows summed
    over the slots) 16.7 (PERF.md)."""

    gate_up: GemvTiles = GemvTiles(16, 1024, 4, f16_dot=True)
    down: GemvTiles = GemvTiles(32, 512, 2, f16_dot=True)
    # gate_up lets the down GEMV launch only after its own wait (on the top-k) and prefetches
    # its second weight tile within its loop; the down GEMV then reads the ids and its
    # weights before it waits for gate_up's output. On the H200 (8 distinct layers in turn
    # in a graph, 1 token, alternating 4 rounds) 15.88 us
    # against 16.68 unchained; the late trigger alone 18.13, without gate_up's loop prefetch
    # 16.48. At 8 tokens, where the launches are too large for PDL, the prefetching loops
    # alone are slower (57.15 vs 53.23 us)
    chained: bool = False

    @classmethod
    def for_shape(cls, tokens: int, pdl: bool) -> ExpertGemvTiles:
        """Chained at one token with programmatic dependent launch, where it is measured (up
        to 3 tokens both launches would still take PDL: not measured; from 4 the down GEMV's
        launch is too large for it). Chained, the down GEMV takes 4 warps (two-word fp16 dot):
        14.36 us at 1 token against 15.00 with 2; at 8
        tokens 53.28 against 49.99, so not there. Other blocks chained (1 token,
        against 15.97 us): gate_up 16 x 2048 / 8 x 1024 /
        32 x 1024 16.25 / 16.12 / 17.34 us (8 x 2048 with the two-word fp16 dot: 14.49 /
        52.91 at 1 / 8 tokens); down 16 x 512 with 2 warps 15.64 (0.3 us, and not measured
        at 2-48 tokens, which share these blocks), with 1 warp 15.76, 64 x 512 with 4 warps
        16.13."""
        if tokens == 1 and pdl:
            return cls(down=GemvTiles(32, 512, 4, f16_dot=True), chained=True)
        return cls()


def expert_gemv(
    x: torch.Tensor,
    w: tuple,
    y: torch.Tensor,
    spec: QuantSpec,
    tiles: GemvTiles,
    ids: torch.Tensor,
    top_k: int,
    gated: bool = False,
    rw=None,
    shared_w=None,
    chained: bool = False,
    act: Glu = SILU,
) -> torch.Tensor:
    """Rows of y [R, N] (R = T * top_k assignments) from x ([T, K] if gated else [R, K]) and
    w = (packed [E, N (2N if gated), K * bits / 32], scales, biases [E, N (2N), K / group]),
    row a over expert ids[a] (ids [R], int32 or int64). gated: y = act(gate, up). rw [R]:
    routing weights to apply. shared_w: one expert's weights for the last of each token's
    top_k slots. chained: see `ExpertGemvTiles.chained`."""
    packed, scales, biases = w
    grid = (triton.cdiv(y.shape[1], tiles.block_n), y.shape[0])
    fast(_expert_gemv_kernel)[grid](
        x,
        packed.view(torch.int32),
        scales,
        biases,
        y,
        rw,
        ids,
        *shared_expert_args(shared_w, packed, scales),
        y.shape[1],
        x.shape[1],
        x.stride(0),
        packed.stride(0),
        packed.stride(-2),
        scales.stride(0),
        scales.stride(-2),
        y.stride(0),
        TOP_K=top_k,
        SHARED=shared_w is not None,
        GATED=gated,
        APPLY_WEIGHT=rw is not None,
        LATE_TRIGGER=chained and gated,
        **act.meta(),
        **row_meta(x, y, spec, tiles, grid, chained),
    )
    return y


def expert_gemvs(
    x: torch.Tensor,
    gate_up: tuple,
    down: tuple,
    weights: torch.Tensor,
    ids: torch.Tensor,
    spec: QuantSpec,
    tiles: ExpertGemvTiles,
    shared_w: tuple = (None, None),
    act: Glu = SILU,
) -> torch.Tensor:
    """The experts' weighted rows partial [T * k, D] fp32 for x [T, D] and the assignments'
    weights, ids [T, k] (k slots per token, the last one the shared expert's if shared_w =
    (gate_up, down) is given); act: the gated activation between the two GEMVs."""
    slots = ids.shape[1]
    h = torch.empty(x.shape[0] * slots, gate_up[0].shape[1] // 2, device=x.device, dtype=x.dtype)
    partial = torch.empty(x.shape[0] * slots, x.shape[1], device=x.device, dtype=torch.float32)
    expert_gemv(
        x,
        gate_up,
        h,
        spec,
        tiles.gate_up,
        ids,
        slots,
        gated=True,
        shared_w=shared_w[0],
        chained=tiles.chained,
        act=act,
    )
    expert_gemv(
        h,
        down,
        partial,
        spec,
        tiles.down,
        ids,
        slots,
        rw=weights,
        shared_w=shared_w[1],
        chained=tiles.chained,
    )
    return partial
