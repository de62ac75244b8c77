"""Grouped GEMM over routed experts with the group-affine dequantisation fused into the K loop.

Rows come from `moe_routing.align`: blocks of BLOCK_M assignments that all belong to one
expert (and, for the last rows of an expert, a second launch over smaller blocks). A program
takes one such block and BLOCK_N output columns; its weight tile is read as
packed codes, expanded to the activation dtype in registers, and fed to `tl.dot` (tensor
cores, fp32 accumulation). The bf16 weight is never written to memory. Two uses:

    gate_up:  h[a]   = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T)      (GATED, rows by token)
    down:     out[a] = w[a] * (h[a] @ Wd[e]^T)                       (APPLY_WEIGHT)

with a = t * top_k + slot the flat assignment index; out [T * k, D] is then summed over slots.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sparrow.kernels import pdl
from sparrow.kernels.activations import silu
from sparrow.kernels.dequant.unpack import group_scales, packed_unpack, unpack_codes
from sparrow.kernels.launch import fast
from sparrow.kernels.moe_routing.naive import Routing
from sparrow.kernels.moe_routing.routing import align, topk_route
from sparrow.kernels.pdl import launch_args, wait_for_previous
from sparrow.kernels.quant_gemv.gemv import launch_gemv, shared_expert_args
from sparrow.quant.affine import QuantSpec


@triton.jit
def _dequant_tile(w_ptr, b_s, b_b, o_n, m_n, k0, stride_wn,
                  BITS: tl.constexpr, GROUP: tl.constexpr, PACKED: tl.constexpr):  # fmt: skip
    """Weight rows o_n, columns k0..k0+GROUP (one quantisation group, scales b_s and biases
    b_b [N]), as [GROUP, N] in the scales' dtype: K-major for `tl.dot`. Loads GROUP*BITS/32
    words per row (`unpack_codes`: two 4-bit codes per instruction on the GPU)."""
    WPG: tl.constexpr = GROUP * BITS // 32
    o_w = k0 // GROUP * WPG + tl.arange(0, WPG)
    b_w = tl.load(w_ptr + o_n[:, None] * stride_wn + o_w[None, :], mask=m_n[:, None], other=0)
    b_v = unpack_codes(b_w, b_s[:, None], b_b[:, None], BITS, PACKED)  # [N, WPG, per word]
    return tl.trans(tl.reshape(b_v, [o_n.shape[0], GROUP]))


@triton.jit
def _gate(b_acc, HALVES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, HALVES * BLOCK_N] -> [BLOCK_M, BLOCK_N]: silu(gate) * up of the two halves
    (HALVES = 2), or the tile as it is."""
    if HALVES == 2:
        b_3 = tl.permute(tl.reshape(b_acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1])
        b_g, b_u = tl.split(b_3)
        return silu(b_g) * b_u
    else:
        return b_acc


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, b_ptr, c_ptr, rw_ptr, sw_ptr, ss_ptr, sb_ptr,
    sorted_ptr, block_start_ptr, block_expert_ptr,
    N, K, num_valid, num_experts,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    TOP_K: tl.constexpr, GATED: tl.constexpr, APPLY_WEIGHT: tl.constexpr, SHARED: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr,
):  # fmt: skip
    """K advances one quantisation group (BLOCK_K = GROUP) per step; K % GROUP == 0.
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
    b_acc = _gate(b_acc, HALVES, BLOCK_M, BLOCK_N)
    if APPLY_WEIGHT:
        b_acc *= tl.load(rw_ptr + rows, mask=m_rows, other=0.0)[:, None]
    p_c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + o_n[None, :]
    tl.store(p_c, b_acc.to(c_ptr.dtype.element_ty), mask=m_rows[:, None] & m_n[None, :])


# (block_n, block_k, warps) by (gated: gate_up or down, chained: one token, `_chained`)
_GEMV_BLOCKS = {
    (True, False): (16, 1024, 4),
    (False, False): (32, 512, 2),
    (True, True): (16, 1024, 4),
    (False, True): (32, 512, 4),
}


def _launch_gemv(a, w, c, rw, ids, top_k, gated, spec, shared_w=None, chained=False):
    """Blocks from sweeps of the whole MoE layer on the H200 (graph, 1 / 8 tokens): gate_up
    (gate and up rows in one tile) 16 x 1024 with 4 warps (21.0 / 64.8 us; 16 x 2048: 22.0 /
    71.8, 4 x 2048 with 2 warps: 22.1 / 75.9), down (K = 512) 32 x 512 with 2 warps (22.0 /
    69.8; 16 x 512 with 4 warps: 22.6 / 76.1).

    chained (`_chained`): gate_up lets the down GEMV launch only after its own wait (on the
    top-k) and prefetches its second weight tile within its loop; the down GEMV then reads
    the ids and its weights before it waits for gate_up's output. On the H200 (8 distinct
    layers in turn in a graph, 1 token, alternating 4 rounds; docs/bench/moe-chain-ab-*-s14)
    16.68 -> 15.88 us; the late trigger alone 18.13, without gate_up's loop prefetch 16.48.
    At 8 tokens, where the launches are too large for PDL, the prefetching loops alone were
    slower (57.15 vs 53.23 us), hence only at one token (`_chained`). Blocks swept again
    chained (1 token, docs/bench/moe-blocks-sweep-*-s14): gate_up 16 x 2048 / 8 x 1024 /
    32 x 1024 16.25 / 16.12 / 17.34 us against 15.97; down 16 x 512 with 2 warps 15.64
    (not taken: 0.3 us, and 2-48 tokens, which share these blocks, not measured), with 1
    warp 15.76, 64 x 512 with 4 warps 16.13. With the two-word fp16 dot (fifteenth session,
    docs/bench/moe-blocks-sweep-*-s15): down 32 x 512 with 4 warps 14.36 us at 1 token
    against 15.00 (15.42 / 15.95 in the fourteenth session's sweep), so chained it takes 4
    warps; at 8 tokens 53.28 against 49.99, so not there; gate_up 8 x 2048 14.49 / 52.91.

    Measured and not kept (tenth session, the layer in a graph at 1 / 8 tokens, against
    15.7 / 55.0 us for this path): the routing inside the gate_up kernel (each program
    routes its own token; no top-k kernel) 15.4 / 58.5; with the combine also inside the
    down kernel (a program per row block and token, summing its slots in order) 19.5 /
    70.8: each slot's id, then its weights, is a dependent load the program waits on in
    turn. Sixteenth session (8 layers in a graph, 1 token, against 14.4 us): the chained
    down GEMV summing each token's rows itself (the last of its programs, a counter) 15.9;
    the whole layer in one kernel (programs synchronised by counters, routing in every
    program, down rows summed over the slots) 16.7 (PERF.md)."""
    bn, bk, nw = _GEMV_BLOCKS[gated, chained]
    launch_gemv(a, w, c, spec, block_n=bn, block_k=bk, num_warps=nw, gated=gated, ids=ids,
                rw=rw, top_k=top_k, shared_w=shared_w, late_trigger=chained and gated,
                prefetch=chained)  # fmt: skip


def _chained(tokens: int, device: torch.device) -> bool:
    """Whether the expert GEMVs chain (`_launch_gemv`): at one token with programmatic
    dependent launch, where it was measured. (Up to 3 tokens both launches would still use
    PDL; not measured there. From 4 the down GEMV's launch is too large for it.)"""
    return tokens == 1 and pdl.enabled(device)


def _launch(a, w, c, rw, routing: Routing, n, top_k, gated, spec, tiles: GemmTiles,
            shared_w=None):  # fmt: skip
    """One launch over the blocks of tiles.block_m rows, one over the small blocks if any."""
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
            a, packed.view(torch.int32), scales, biases, c, rw,
            *shared_expert_args(shared_w, packed, scales),
            routing.sorted_ids, blocks.start, blocks.expert,
            n, k, c.shape[0], packed.shape[0],
            a.stride(0), packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1),
            c.stride(0),
            TOP_K=top_k, GATED=gated, APPLY_WEIGHT=rw is not None, SHARED=shared_w is not None,
            BITS=spec.bits, GROUP=spec.group_size, PRECISION=precision,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n,
            PACKED=packed_unpack(scales.dtype, spec.bits, a.device) and scales.dtype == a.dtype,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip


@triton.jit
def _combine_kernel(p_ptr, s_ptr, g_ptr, o_ptr, D, stride_g, TOP_K: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):  # fmt: skip
    """out[t] = sum_j partial[t, j] (+ sigmoid(gate[t]) * shared[t]) (see naive.combine);
    gate rows stride_g apart (a column of the fused router output)."""
    wait_for_previous(USE_PDL)
    i_t, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BLOCK + tl.arange(0, BLOCK)
    m_d = o_d < D
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        b_acc += tl.load(p_ptr + (i_t * TOP_K + j) * D + o_d, mask=m_d, other=0.0)
    if HAS_SHARED:
        b_g = tl.sigmoid(tl.load(g_ptr + i_t * stride_g).to(tl.float32))
        b_acc += b_g * tl.load(s_ptr + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(o_ptr + i_t * D + o_d, b_acc.to(o_ptr.dtype.element_ty), mask=m_d)


def _combine(partial, top_k, out_dtype, shared: Shared | None = None):
    """Sum the k weighted expert rows of each token; add the gated shared expert's output if
    given. (Measured and not kept: the sum done by the next residual add + norm instead, the
    layer returning its rows unsummed, one kernel fewer per layer: end to end on the H200,
    alternating in one run, decode at 4K 524.2 vs 526.4 tok/s, 8 concurrent 1,594 vs 1,602,
    prefill 4K the same; at batch 1 the add + norm is one program, which then reads all
    nine fp32 rows.)"""
    t, d = partial.shape[0] // top_k, partial.shape[1]
    out = torch.empty(t, d, device=partial.device, dtype=out_dtype)
    if shared is not None:
        s, g = shared.output.contiguous(), shared.gate  # gate [T, 1]: any row stride
    else:
        s, g = partial, partial
    grid = (t, triton.cdiv(d, 1024))
    fast(_combine_kernel)[grid](partial, s, g, out, d, g.stride(0), TOP_K=top_k,
                                HAS_SHARED=shared is not None, BLOCK=1024,
                                **launch_args(out, grid))  # fmt: skip
    return out


@dataclass
class Shared:
    """The shared expert of a MoE layer: its gate logit [T, 1] and its output [T, D], or (GEMV
    path) its weights `gate_up`, `down` (packed triples shaped like one routed expert's): then
    it runs as one more assignment per token, weight sigmoid(gate), in the experts' kernels."""

    gate: torch.Tensor
    output: torch.Tensor | None = None
    weights: tuple[tuple, tuple] | None = None


# Up to this many tokens each assignment runs as a GEMV (decode batches). The whole layer in a
# CUDA graph on the H200, GEMVs vs grouped GEMM: 8 tokens 64.8 vs 150.1 us, 16: 106.2 vs 195.4,
# 32: 192.0 vs 283.8, 48: 275.4 vs 309.0, 64: 359.7 vs 347.7 (the GEMM's tiles: best of 48).
GEMV_TOKENS = 48


@dataclass(frozen=True)
class GemmTiles:
    """K always advances one quantisation group per step: two groups per step (one MMA of
    K 128, scales [N, 2]) measured slower at every size, best configs in a graph on the H200
    (eighth session): 512 tokens 428 vs 380 us, 2,048 618 vs 554, 4,096 1,047 vs 896, 8,192
    1,801 vs 1,624; four groups spill registers. Computing
    the transposed tile (expanded weight as the MMA's register operand, rows on its narrow
    side) measured the same: 637 vs 631 us at 2048 tokens, 1,884 vs 1,916 at 8192 (the
    expanded tile still passes through shared memory to reach the MMA layout). Seventeenth
    session (PERF.md), not kept: the raw codes as the register operand (each byte's two
    codes two K=32 products, activations stored even k first, scale and bias applied to
    each group's product), which Triton loads straight into the operand layout: gate_up 2x
    slower (591 vs 325 us at 2,048 tokens; waited MMAs, 190-252 registers); the codes
    prefetched in registers a step ahead instead of through shared memory: 552 -> 593 us
    for the layer at 2,048 tokens (167 registers)."""

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


def tiles_for(num_assignments: int, num_experts: int) -> GemmTiles:
    """Tiles from the expected rows per expert. Measured on the H200 (`bench.moe --sweep`,
    the routed experts in a CUDA graph, best of 48 configs): up to 8 rows per expert 16-row
    tiles (64 tokens 329 us, 64-row 353; 256 tokens 382 vs 391); 16 to 64 rows 64 x 64 (512
    tokens 380 us, 16-row 522; 1,024 395 vs 654; 2,048 554, 128-row 602); from 128 rows
    128 x 64 (4,096 tokens 896 vs 926; 8,192 1,624 vs 1,735). Each GEMM alone (ninth
    session, `scratch`-style graph timing): the down GEMM (K 512, N 2,048) takes 128 columns
    (2,048 tokens 187 -> 166 us; 8,192 533 -> 498, with 8 warps 457), gate_up keeps 64
    (128 columns: 381 vs 330 us at 2,048 tokens) and takes 8 warps with 128-row tiles (8,192:
    807 vs 828 us).

    From 64 rows per expert, an expert's last rows run in one 64-row block when at most 64
    remain after its 128-row blocks (seventeenth session, the whole layer in a graph,
    alternating 4 rounds; docs/bench/moe-two-sizes-ab-*-s17.json): 2,048 tokens 591.3 ->
    552.5 us (64 rows per expert: an expert of 65-128 rows in one 128-row block instead of
    two of 64), 4,096 920.5 -> 871.1, 8,192 1,572 -> 1,542. Below (512 / 1,024 tokens:
    376.0 / 406.1 us as before against 424.4 / 434.3) one size stays faster; small blocks of
    16 or 32 rows lost at every size (2,048: 629.5-669.8 us)."""
    per_expert = num_assignments / num_experts
    if per_expert <= 8:
        return GemmTiles(block_m=16)
    if per_expert < 64:
        return GemmTiles(block_m=64, down_block_n=128)
    small = GemmTiles(block_m=64, down_block_n=128)
    return GemmTiles(block_m=128, num_warps=8, down_block_n=128, small=small)


def moe_experts(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    spec: QuantSpec,
    tiles: GemmTiles | None = None,
    shared: Shared | None = None,
) -> torch.Tensor:
    """Routed experts of one MoE layer, all on the GPU with no host sync. Up to GEMV_TOKENS
    tokens (unless tiles are given) take the GEMV path, else the grouped GEMM.
    x: [T, D]; router_logits: [T, E]; gate_up: (packed [E, 2I, D*bits/32], scales, biases
    [E, 2I, D/g]); down: (packed [E, D, I*bits/32], scales, biases). Returns [T, D]; with a
    shared expert, the layer's output (`naive.combine`): given its weights, they run as a
    (top_k + 1)-th assignment of every token (expert id E in the grouped GEMM's routing),
    given its output, that is added in the combine kernel."""
    t, d = x.shape
    e, two_i = gate_up[0].shape[:2]
    inter = two_i // 2
    x = x.contiguous()
    gemv = t <= GEMV_TOKENS and tiles is None
    fold = shared is not None and shared.weights is not None
    if shared is not None and not fold and shared.output is None:
        raise ValueError("a shared expert needs its weights or its output")
    shared_gate_up, shared_down = shared.weights if fold else (None, None)
    # the folded shared expert: one more slot per token, id 0 for the GEMVs (which tell it by
    # its slot), E for the grouped GEMM's routing (its own group of rows)
    weights, ids = topk_route(router_logits, top_k, shared.gate if fold else None,
                              shared_id=0 if gemv else e)  # fmt: skip
    slots = top_k + fold
    h = torch.empty(t * slots, inter, device=x.device, dtype=x.dtype)
    # weighted expert rows, summed per token by the combine: fp32 for a few decode tokens, the
    # activation dtype in prefill (t * k rows of D: at 4K tokens 268 MB each way in fp32)
    partial = torch.empty(t * slots, d, device=x.device, dtype=torch.float32 if gemv else x.dtype)
    if gemv:
        chained = _chained(t, x.device)
        _launch_gemv(x, gate_up, h, None, ids, slots, True, spec, shared_gate_up, chained)
        _launch_gemv(h, down, partial, weights, ids, slots, False, spec, shared_down, chained)
    else:
        tiles = tiles or tiles_for(t * top_k, e)
        routing = align(ids, e + fold, tiles.block_m, tiles.small and tiles.small.block_m or 0)
        _launch(x, gate_up, h, None, routing, inter, slots, True, spec, tiles, shared_gate_up)
        _launch(h, down, partial, weights.reshape(-1), routing, d, slots, False, spec,
                tiles.down(), shared_down)  # fmt: skip
    return _combine(partial, slots, x.dtype, None if fold else shared)
