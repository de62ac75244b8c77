"""Grouped GEMM over routed experts with the group-affine dequantisation fused into the K loop.

Rows come from `routing.align`: blocks of BLOCK_M assignments that all belong to one expert
(and, for the last rows of an expert, a second launch over smaller blocks). A program takes
one such block and BLOCK_N output columns; its weight tile is read as packed codes, expanded
to the activation dtype in registers, and fed to `tl.dot` (tensor cores, fp32 accumulation).
The bf16 weight is never written to memory. Two uses:

    gate_up:  h[a]   = glu(x[t] @ Wg[e]^T, x[t] @ Wu[e]^T)      (GATED, rows by token)
    down:     out[a] = w[a] * (h[a] @ Wd[e]^T)                   (APPLY_WEIGHT)

with a = t * top_k + slot the flat assignment index and glu the gated activation
(`activations.glu`: silu(gate) * up, or SwiGLU-OAI); out [T * k, D] is then summed over
slots (`combine`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sparrow.kernels.activations import SILU, Glu, glu
from sparrow.kernels.dequant.unpack import group_scales, packed_unpack, unpack_codes
from sparrow.kernels.launch import fast
from sparrow.kernels.moe.naive import Routing
from sparrow.kernels.moe.routing import align
from sparrow.kernels.moe.shared import shared_expert_args
from sparrow.quant.affine import QuantSpec


@triton.jit
def _dequant_tile(
    w_ptr,
    b_s,
    b_b,
    o_n,
    m_n,
    k0,
    stride_wn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PACKED: tl.constexpr,
):
    """Weight rows o_n, columns k0..k0+GROUP (one quantisation group, scales b_s and biases
    b_b [N]), as [GROUP, N] in the scales' dtype: K-major for `tl.dot`. Loads GROUP*BITS/32
    words per row (`unpack_codes`: two 4-bit codes per instruction on the GPU)."""
    WPG: tl.constexpr = GROUP * BITS // 32
    o_w = k0 // GROUP * WPG + tl.arange(0, WPG)
    b_w = tl.load(w_ptr + o_n[:, None] * stride_wn + o_w[None, :], mask=m_n[:, None], other=0)
    b_v = unpack_codes(b_w, b_s[:, None], b_b[:, None], BITS, PACKED)  # [N, WPG, per word]
    return tl.trans(tl.reshape(b_v, [o_n.shape[0], GROUP]))


@triton.jit
def _gate(
    b_acc,
    HALVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    """[BLOCK_M, HALVES * BLOCK_N] -> [BLOCK_M, BLOCK_N]: glu(gate, up) of the two halves
    (HALVES = 2; `activations.glu`), or the tile as it is."""
    if HALVES == 2:
        b_3 = tl.permute(tl.reshape(b_acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1])
        b_g, b_u = tl.split(b_3)
        return glu(b_g, b_u, ACT, ALPHA, LIMIT)
    else:
        return b_acc


@triton.jit(do_not_specialize=["num_valid"])  # see kernels/launch.py
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    c_ptr,
    rw_ptr,
    sw_ptr,
    ss_ptr,
    sb_ptr,
    sorted_ptr,
    block_start_ptr,
    block_expert_ptr,
    N,
    K,
    num_valid,
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_cm,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    APPLY_WEIGHT: tl.constexpr,
    SHARED: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACKED: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    """K advances one quantisation group (BLOCK_K = GROUP) per step; K % GROUP == 0. GATED:
    the gated activation ACT (ALPHA, LIMIT) of the two halves, `activations.glu`.
    SHARED: blocks of expert id num_experts read the shared expert's weights (sw, ss, sb: one
    expert's shape) instead."""
    # the N blocks of one row block are neighbours in launch order: they run together and
    # share that block's activation rows in L2
    num_n = tl.cdiv(N, BLOCK_N)
    i_m, i_n = tl.program_id(0) // num_n, tl.program_id(0) % num_n
    start = tl.load(block_start_ptr + i_m)
    if start < 0:
        return  # past the blocks in use: the grid is sized without reading the routing
    i_e = tl.load(block_expert_ptr + i_m).to(tl.int64)
    rows = tl.load(sorted_ptr + start + tl.arange(0, BLOCK_M))
    m_rows = rows < num_valid
    if GATED:
        a_rows = rows // TOP_K  # gate_up reads x by token
    else:
        a_rows = rows
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    w_e, s_e, b_e = w_ptr + i_e * stride_we, s_ptr + i_e * stride_se, b_ptr + i_e * stride_se
    if SHARED:
        if i_e == num_experts:
            w_e, s_e, b_e = sw_ptr, ss_ptr, sb_ptr
    # GATED: the gate rows o_n and the up rows o_n + N (N rows below) as one tile of 2 BLOCK_N
    # weight rows, so each K step is one MMA twice as wide instead of two (each waited on):
    # both GEMMs 549 -> 523 us at 2,048 tokens, 1,738 -> 1,648 at 8,192 on the H200
    HALVES: tl.constexpr = 1 + GATED
    o_h = tl.arange(0, HALVES * BLOCK_N)
    o_w = i_n * BLOCK_N + o_h % BLOCK_N + (o_h // BLOCK_N) * N
    m_w = i_n * BLOCK_N + o_h % BLOCK_N < N
    o_k = tl.arange(0, GROUP)
    b_acc = tl.zeros([BLOCK_M, HALVES * BLOCK_N], dtype=tl.float32)
    # scales and biases one group ahead: the compiler's pipelining moves the codes and the
    # activations through shared memory but loads these [N] vectors where they are used, so
    # without the prefetch each K step waited for them
    b_s, b_b = group_scales(s_e, b_e, o_w, m_w, 0, stride_sn)
    for k0 in range(0, K, GROUP):
        p_a = a_ptr + a_rows[:, None] * stride_am + (k0 + o_k)[None, :]
        b_a = tl.load(p_a, mask=m_rows[:, None], other=0.0)
        next_group = tl.minimum(k0 + GROUP, K - GROUP) // GROUP  # the last step reloads its own
        b_s_next, b_b_next = group_scales(s_e, b_e, o_w, m_w, next_group, stride_sn)
        b_w = _dequant_tile(w_e, b_s, b_b, o_w, m_w, k0, stride_wn, BITS, GROUP, PACKED)
        b_acc += tl.dot(b_a, b_w.to(b_a.dtype), input_precision=PRECISION)
        b_s, b_b = b_s_next, b_b_next
    b_acc = _gate(b_acc, HALVES, BLOCK_M, BLOCK_N, ACT, ALPHA, LIMIT)
    if APPLY_WEIGHT:
        b_acc *= tl.load(rw_ptr + rows, mask=m_rows, other=0.0)[:, None]
    p_c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + o_n[None, :]
    tl.store(p_c, b_acc.to(c_ptr.dtype.element_ty), mask=m_rows[:, None] & m_n[None, :])


@dataclass(frozen=True)
class GemmTiles:
    """Tiles of the two grouped GEMMs. K advances one quantisation group per step: two groups
    per step (one MMA of K 128, scales [N, 2]) are slower at every size (best configs in a
    graph on the H200: 512 tokens 428 against 380 us, 2,048 618 against 554, 4,096 1,047
    against 896, 8,192 1,801 against 1,624); four groups spill registers. The transposed tile
    (expanded weight as the MMA's register operand, rows on its narrow side) measures the
    same (637 against 631 us at 2048 tokens, 1,884 against 1,916 at 8192: the expanded tile
    still passes through shared memory to reach the MMA layout). Slower too (PERF.md): the
    raw codes as the register operand (each byte's two codes two K=32 products, activations
    stored even k first, scale and bias applied to each group's product), which Triton loads
    straight into the operand layout: gate_up 591 against 325 us at 2,048 tokens (waited
    MMAs, 190-252 registers); the codes prefetched in registers a step ahead instead of
    through shared memory: 593 against 552 us for the layer at 2,048 tokens (167
    registers)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int | None = None  # the down GEMM's columns per program (None: block_n)
    # an expert's last rows, when at most small.block_m of them remain after its full blocks
    # of block_m, run as one block with these tiles (None: in one more block of block_m)
    small: GemmTiles | None = None

    def down(self) -> GemmTiles:
        """The down GEMM's tiles: the same rows (they share the routing), its own columns."""
        small = self.small and self.small.down()
        return replace(self, block_n=self.down_block_n or self.block_n, small=small)

    @classmethod
    def for_shape(cls, num_assignments: int, num_experts: int) -> GemmTiles:
        """Tiles from the expected rows per expert. Measured on the H200 (`bench.moe
        --sweep`, the routed experts in a CUDA graph, best of 48 configs): up to 8 rows per
        expert 16-row tiles (64 tokens 329 us, 64-row 353; 256 tokens 382 against 391); 16
        to 64 rows 64 x 64 (512 tokens 380 us, 16-row 522; 1,024 395 against 654; 2,048 554,
        128-row 602); from 128 rows 128 x 64 (4,096 tokens 896 against 926; 8,192 1,624
        against 1,735). Each GEMM alone (graph timing): the down GEMM (K 512, N 2,048) takes
        128 columns (2,048 tokens 166 against 187 us with 64; 8,192 498 against 533, with 8
        warps 457), gate_up keeps 64 (128 columns: 381 against 330 us at 2,048 tokens) and
        takes 8 warps with 128-row tiles (8,192: 807 against 828 us).

        From 64 rows per expert, an expert's last rows run in one 64-row block when at most
        64 remain after its 128-row blocks (the whole layer in a graph, alternating 4
        rounds): 2,048 tokens 552.5 against 591.3 us
        with one size (64 rows per expert: an expert of 65-128 rows in one 128-row block
        instead of two of 64), 4,096 871.1 against 920.5, 8,192 1,542 against 1,572. Below,
        one size is faster (512 / 1,024 tokens: 376.0 / 406.1 us against 424.4 / 434.3);
        small blocks of 16 or 32 rows are slower at every size (2,048: 629.5-669.8 us)."""
        per_expert = num_assignments / num_experts
        if per_expert <= 8:
            return cls(block_m=16)
        if per_expert < 64:
            return cls(block_m=64, down_block_n=128)
        small = cls(block_m=64, down_block_n=128)
        return cls(block_m=128, num_warps=8, down_block_n=128, small=small)


def grouped_gemm(
    a: torch.Tensor,
    w: tuple,
    c: torch.Tensor,
    rw,
    routing: Routing,
    n: int,
    top_k: int,
    gated: bool,
    spec: QuantSpec,
    tiles: GemmTiles,
    shared_w=None,
    act: Glu = SILU,
) -> None:
    """c [T * top_k, n] from a ([T, K] if gated else [T * top_k, K]) and w = (packed [E, n
    (2n if gated), K * bits / 32], scales, biases), rows grouped by `routing`; gated: c =
    act(gate, up); rw [T * top_k]: routing weights to apply. One launch over the blocks of
    tiles.block_m rows, one over the small blocks if any."""
    packed, scales, biases = w
    k = a.shape[1]
    if k % spec.group_size:
        raise ValueError(f"input dim {k} is not a multiple of group_size {spec.group_size}")
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 means fp32
    launches = [(routing.blocks, tiles)]
    if routing.small is not None:
        launches.append((routing.small, tiles.small))
    for blocks, t in launches:
        grid = (blocks.start.numel() * triton.cdiv(n, t.block_n),)
        fast(_moe_gemm_kernel)[grid](
            a,
            packed.view(torch.int32),
            scales,
            biases,
            c,
            rw,
            *shared_expert_args(shared_w, packed, scales),
            routing.sorted_ids,
            blocks.start,
            blocks.expert,
            n,
            k,
            c.shape[0],
            packed.shape[0],
            a.stride(0),
            packed.stride(0),
            packed.stride(1),
            scales.stride(0),
            scales.stride(1),
            c.stride(0),
            TOP_K=top_k,
            GATED=gated,
            APPLY_WEIGHT=rw is not None,
            SHARED=shared_w is not None,
            BITS=spec.bits,
            GROUP=spec.group_size,
            PRECISION=precision,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            PACKED=packed_unpack(scales.dtype, spec.bits, a.device) and scales.dtype == a.dtype,
            **act.meta(),
            num_warps=t.num_warps,
            num_stages=t.num_stages,
        )


def grouped_gemms(
    x: torch.Tensor,
    gate_up: tuple,
    down: tuple,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_groups: int,
    spec: QuantSpec,
    tiles: GemmTiles,
    shared_w: tuple = (None, None),
    act: Glu = SILU,
) -> torch.Tensor:
    """The experts' weighted rows [T * k, D] in x's dtype for x [T, D] and the assignments'
    weights, ids [T, k] (ids < num_groups; the shared expert's rows, if shared_w = (gate_up,
    down) is given, are the group of id E = gate_up's expert count): align, then gate_up
    (with the gated activation act) and down."""
    t, d = x.shape
    slots = ids.shape[1]
    inter = gate_up[0].shape[1] // 2
    h = torch.empty(t * slots, inter, device=x.device, dtype=x.dtype)
    # the activation dtype (t * k rows of D: at 4K tokens 268 MB each way in fp32)
    partial = torch.empty(t * slots, d, device=x.device, dtype=x.dtype)
    routing = align(ids, num_groups, tiles.block_m, tiles.small and tiles.small.block_m or 0)
    grouped_gemm(x, gate_up, h, None, routing, inter, slots, True, spec, tiles, shared_w[0], act)
    grouped_gemm(
        h,
        down,
        partial,
        weights.reshape(-1),
        routing,
        d,
        slots,
        False,
        spec,
        tiles.down(),
        shared_w[1],
    )
    return partial
