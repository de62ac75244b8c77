"""MoE routing on the GPU, with no host synchronisation (capturable in a CUDA graph).

    topk_route:  router logits [T, E] -> weights [T, k] fp32, expert ids [T, k] int32
    align:       ids -> Routing (sorted ids, blocks of one or two sizes), see naive.align

`align` is three small kernels: a histogram of assignments per expert (one per program, added
with atomics), a scan of the padded counts into group offsets and the block maps (first row
and expert of each block), and a scatter of each assignment to its slot (an atomic cursor per
expert). Output sizes depend only on T, k, E and the block sizes, never on the routing itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.launch import fast
from sparrow.kernels.moe.naive import Blocks, Routing, max_blocks
from sparrow.kernels.pdl import launch_args, wait_for_previous


@triton.jit
def _sortable(bits, FLIP: tl.constexpr):
    """Float bits (int32) <-> an int32 that orders like the floats: negative values get their
    FLIP bits (magnitude) inverted. Its own inverse (the sign bit is kept)."""
    return bits ^ ((bits >> 31) & FLIP)


@triton.jit
def route_row(p_logits, E, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The router of one token from its E logits at p_logits: (weights [K] fp32 summing to 1,
    expert ids [K] int32, in the first K of BLOCK_K >= K lanes), as `naive.route` (softmax,
    top-K, renormalised: the weights are a softmax over the K chosen logits, the other
    experts' terms cancel).

    K rounds of one max each over keys that order like the logits with the reversed expert
    index in the low bits (ties go to the lowest index, like torch.topk on distinct values).
    16-bit logits leave at least 13 low bits of their fp32 form zero, so index and value fit
    in one int32 (E <= 8192); fp32 logits take int64 keys. The winner's logit is read back
    from its key, so a round is a single reduction. On the H200 (the MoE layer in a CUDA
    graph, 1 / 8 tokens) 15.69 / 54.97 us against 16.73 / 56.27 with int64 keys over the
    softmax's probability bits."""
    o_e = tl.arange(0, BLOCK_E)
    b_l = tl.load(p_logits + o_e, mask=o_e < E, other=-float("inf"))
    WIDE: tl.constexpr = b_l.dtype == tl.float32
    LOW: tl.constexpr = BLOCK_E - 1  # the index bits
    FLIP: tl.constexpr = 0x7FFFFFFF if WIDE else 0x7FFFFFFF ^ LOW
    b_key = _sortable(b_l.to(tl.float32).to(tl.int32, bitcast=True), FLIP)
    if WIDE:
        b_key = (b_key.to(tl.int64) << 32) | (LOW - o_e)
        b_key = tl.where(o_e < E, b_key, -(2**63))
    else:
        b_key = tl.where(o_e < E, b_key | (LOW - o_e), -(2**31))
    o_k = tl.arange(0, BLOCK_K)
    b_v = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)  # lanes past K: weight 0
    b_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(K):
        best = tl.max(b_key, axis=0)
        idx = LOW - (best & LOW).to(tl.int32)
        if WIDE:
            high = (best >> 32).to(tl.int32)
        else:
            high = best & ~LOW
        b_v = tl.where(o_k == i, _sortable(high, FLIP).to(tl.float32, bitcast=True), b_v)
        b_i = tl.where(o_k == i, idx, b_i)
        b_key = tl.where(o_e == idx, -(2**63) if WIDE else -(2**31), b_key)
    b_p = tl.exp(b_v - tl.max(b_v, axis=0))
    return b_p / tl.sum(b_p, axis=0), b_i


@triton.jit
def _topk_kernel(
    logits_ptr,
    w_ptr,
    ids_ptr,
    gate_ptr,
    E,
    stride_t,
    stride_g,
    shared_id,
    K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token per program (`route_row`; one warp, so every reduction stays in shuffles).
    SHARED: a (K + 1)-th column, weight sigmoid(gate[t]) and id shared_id, for a shared
    expert run as one more assignment."""
    wait_for_previous(USE_PDL)
    i_t = tl.program_id(0)
    b_w, b_i = route_row(logits_ptr + i_t * stride_t, E, K, BLOCK_E, BLOCK_K)
    o_k = tl.arange(0, BLOCK_K)
    tl.store(w_ptr + i_t * (K + SHARED) + o_k, b_w, mask=o_k < K)
    tl.store(ids_ptr + i_t * (K + SHARED) + o_k, b_i, mask=o_k < K)
    if SHARED:
        b_g = tl.load(gate_ptr + i_t * stride_g).to(tl.float32)
        tl.store(w_ptr + i_t * (K + 1) + K, tl.sigmoid(b_g))
        tl.store(ids_ptr + i_t * (K + 1) + K, shared_id)


@triton.jit(do_not_specialize=["n"])  # see kernels/launch.py
def _count_kernel(ids_ptr, counts_ptr, n, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Assignments per expert: a histogram of BLOCK ids per program, then one atomic add per
    expert (an atomic per assignment queued up to 8K deep on one counter at 8K tokens)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_e = tl.load(ids_ptr + o, mask=m, other=0)
    b_h = tl.histogram(b_e, BLOCK_E, mask=m)
    o_e = tl.arange(0, BLOCK_E)
    tl.atomic_add(counts_ptr + o_e, b_h, mask=b_h > 0)


@triton.jit
def _block_map(i_b, ends, values, start_step):
    """For block indices i_b [B]: the group each falls in (groups end at ends [E], a cumsum
    of blocks per group) and its first row values[group] + i_b * start_step, -1 for both past
    the last group's end."""
    o_e = tl.arange(0, ends.shape[0])
    # group of a block = number of groups that end at or before it
    b_x = tl.sum((ends[None, :] <= i_b[:, None]).to(tl.int32), axis=1)
    b_start = tl.sum(tl.where(o_e[None, :] == b_x[:, None], values[None, :], 0), axis=1)
    valid = i_b < tl.max(ends, axis=0)
    return tl.where(valid, b_start + i_b * start_step, -1), tl.where(valid, b_x, -1)


@triton.jit(do_not_specialize=["max_blocks"])  # see kernels/launch.py
def _scan_kernel(
    counts_ptr,
    offsets_ptr,
    start_ptr,
    expert_ptr,
    small_start_ptr,
    small_expert_ptr,
    E,
    max_blocks,
    BLOCK_M: tl.constexpr,
    SMALL_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Group sizes -> exclusive offsets of the experts' rows (program 0); the block maps,
    BLOCK_B blocks of each size per program (each program scans the E counts again: one
    program walking all blocks takes 28 us at 8K tokens). An expert's rows: full blocks of
    BLOCK_M, then the rest in one block of SMALL_M if it fits (SMALL_M > 0), else in one
    more of BLOCK_M (`naive.group_blocks`)."""
    o_e = tl.arange(0, BLOCK_E)
    b_c = tl.load(counts_ptr + o_e, mask=o_e < E, other=0)
    b_rest = b_c % BLOCK_M
    b_small = ((b_rest > 0) & (b_rest <= SMALL_M)).to(tl.int32)
    b_big = b_c // BLOCK_M + ((b_rest > 0) & (b_small == 0)).to(tl.int32)
    b_size = b_big * BLOCK_M + b_small * SMALL_M
    b_off = tl.cumsum(b_size, axis=0) - b_size
    if tl.program_id(0) == 0:
        tl.store(offsets_ptr + o_e, b_off, mask=o_e < E)
    o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    b_big_end = tl.cumsum(b_big, axis=0)
    b_start, b_x = _block_map(o_b, b_big_end, b_off - (b_big_end - b_big) * BLOCK_M, BLOCK_M)
    tl.store(start_ptr + o_b, b_start, mask=o_b < max_blocks)
    tl.store(expert_ptr + o_b, b_x, mask=o_b < max_blocks)
    if SMALL_M > 0:  # an expert's small block follows its big ones
        b_start, b_x = _block_map(o_b, tl.cumsum(b_small, axis=0), b_off + b_big * BLOCK_M, 0)
        tl.store(small_start_ptr + o_b, b_start, mask=o_b < E)
        tl.store(small_expert_ptr + o_b, b_x, mask=o_b < E)


@triton.jit(do_not_specialize=["n"])  # see kernels/launch.py
def _scatter_kernel(ids_ptr, offsets_ptr, cursor_ptr, sorted_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_e = tl.load(ids_ptr + o, mask=m, other=0)
    rank = tl.atomic_add(cursor_ptr + b_e, 1, mask=m)
    base = tl.load(offsets_ptr + b_e, mask=m, other=0)
    tl.store(sorted_ptr + base + rank, o, mask=m)


def check_router(num_experts: int, k: int, dtype: torch.dtype) -> None:
    """What `route_row` takes: 0 < k <= E, and for 16-bit logits E <= 8192 (the index bits
    of its int32 keys)."""
    if not 0 < k <= num_experts:
        raise ValueError(f"top-k {k} out of range for {num_experts} experts")
    if dtype != torch.float32 and num_experts > 8192:
        raise ValueError(f"{num_experts} experts: 16-bit router logits route at most 8192")


def topk_route(
    logits: torch.Tensor, k: int, shared_gate: torch.Tensor | None = None, shared_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, k] fp32 summing to 1, ids [T, k] int32). With
    shared_gate [T, 1] (logits), one more column: weight sigmoid(gate), id shared_id (the
    shared expert's weights are not among the E: 0 as a placeholder, or E for a routing
    that gives it a group of its own)."""
    t, e = logits.shape
    check_router(e, k, logits.dtype)
    if logits.stride(1) != 1:  # rows may be strided (a view of the fused router output)
        logits = logits.contiguous()
    cols = k + (shared_gate is not None)
    weights = torch.empty(t, cols, device=logits.device, dtype=torch.float32)
    ids = torch.empty(t, cols, device=logits.device, dtype=torch.int32)
    if t:
        gate = shared_gate if shared_gate is not None else logits
        fast(_topk_kernel)[(t,)](
            logits,
            weights,
            ids,
            gate,
            e,
            logits.stride(0),
            gate.stride(0),
            shared_id,
            K=k,
            SHARED=shared_gate is not None,
            BLOCK_E=triton.next_power_of_2(e),
            BLOCK_K=triton.next_power_of_2(k),
            num_warps=1,
            **launch_args(logits, (t,)),
        )
    return weights, ids


def align(ids: torch.Tensor, num_experts: int, block_m: int, small_m: int = 0) -> Routing:
    """ids: [T, k] int -> `naive.Routing` (see `naive.align`)."""
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    n, dev = flat.numel(), ids.device
    num_blocks = max_blocks(n, num_experts, block_m)
    counts, cursor = torch.zeros(2, num_experts, dtype=torch.int32, device=dev)  # one fill
    offsets = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    # both rows 16-byte aligned whatever num_blocks is (Triton specialises on alignment)
    width = triton.cdiv(num_blocks, 4) * 4
    big = Blocks(*torch.empty(2, width, dtype=torch.int32, device=dev)[:, :num_blocks])
    small = Blocks(*torch.empty(2, num_experts, dtype=torch.int32, device=dev)) if small_m else None
    block = 1024
    grid = (max(1, triton.cdiv(n, block)),)
    block_e = triton.next_power_of_2(num_experts)
    fast(_count_kernel)[grid](flat, counts, n, BLOCK=block, BLOCK_E=block_e)
    scan_grid = (triton.cdiv(max(num_blocks, num_experts), 64),)
    fast(_scan_kernel)[scan_grid](
        counts,
        offsets,
        *big,
        *(small or big),
        num_experts,
        num_blocks,
        BLOCK_M=block_m,
        SMALL_M=small_m,
        BLOCK_E=block_e,
        BLOCK_B=64,
    )
    fast(_scatter_kernel)[grid](flat, offsets, cursor, sorted_ids, n, BLOCK=block)
    return Routing(sorted_ids, big, small)
