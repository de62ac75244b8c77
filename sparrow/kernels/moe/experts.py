"""The routed experts of one MoE layer on the GPU, with no host sync (capturable in a CUDA
graph): top-k routing (`routing.topk_route`), then the expert GEMVs (`expert_gemv`: decode
sizes) or align + the grouped GEMMs (`grouped_gemm`), then the combine (`combine`).

`moe_experts` routes from router logits (softmax top-k: Qwen) and runs SwiGLU experts;
`moe_experts_routed` takes a routing the model computed itself (MiniMax M3's sigmoid router)
and the experts' gated activation (`activations.Glu`: SwiGLU-OAI for M3).
"""

from __future__ import annotations

import torch

from sparrow.kernels import pdl
from sparrow.kernels.activations import SILU, Glu
from sparrow.kernels.moe.combine import combine
from sparrow.kernels.moe.expert_gemv import ExpertGemvTiles, expert_gemvs
from sparrow.kernels.moe.grouped_gemm import GemmTiles, grouped_gemms
from sparrow.kernels.moe.routing import topk_route
from sparrow.kernels.moe.shared import Shared
from sparrow.quant.affine import QuantSpec

# Up to this many tokens each assignment runs as a GEMV (decode batches). The whole layer with
# its shared expert on the H200, 8 distinct layers in turn in a CUDA graph (each reads its
# experts from HBM, as in a decode step; `bench.batch --kernels moe`), GEMVs vs grouped GEMM:
# 8 tokens 40.0 vs 124.1 us, 16: 67.9 vs 171.1, 32: 121.2 vs 256.0, 64: 230.2 vs 322.9. The
# GEMV tiles are the best of 8 sets at each size.
GEMV_TOKENS = 64


def default_tiles(
    tokens: int, top_k: int, num_experts: int, device: torch.device
) -> ExpertGemvTiles | GemmTiles:
    """The path and its tiles for a layer of this many tokens: the expert GEMVs up to
    GEMV_TOKENS (`ExpertGemvTiles.for_shape`), else the grouped GEMMs (`GemmTiles.for_shape`)."""
    if tokens <= GEMV_TOKENS:
        return ExpertGemvTiles.for_shape(tokens, pdl.enabled(device))
    return GemmTiles.for_shape(tokens * top_k, num_experts)


def moe_experts(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    spec: QuantSpec,
    tiles: ExpertGemvTiles | GemmTiles | None = None,
    shared: Shared | None = None,
) -> torch.Tensor:
    """Routed experts of one MoE layer, all on the GPU with no host sync. tiles pick the path:
    `ExpertGemvTiles` the expert GEMVs, `GemmTiles` the grouped GEMMs (default:
    `default_tiles`). x: [T, D]; router_logits: [T, E]; gate_up: (packed [E, 2I, D*bits/32],
    scales, biases [E, 2I, D/g]); down: (packed [E, D, I*bits/32], scales, biases). Returns
    [T, D]; with a shared expert, the layer's output (`naive.combine`): given its weights,
    they run as a (top_k + 1)-th assignment of every token (expert id E in the grouped
    GEMM's routing), given its output, that is added in the combine kernel."""
    e = gate_up[0].shape[0]
    x = x.contiguous()
    tiles = tiles or default_tiles(x.shape[0], top_k, e, x.device)
    gemv = isinstance(tiles, ExpertGemvTiles)
    fold = shared is not None and shared.weights is not None
    if shared is not None and not fold and shared.output is None:
        raise ValueError("a shared expert needs its weights or its output")
    shared_w = shared.weights if fold else (None, None)
    # the folded shared expert: one more slot per token, id 0 for the GEMVs (which tell it by
    # its slot), E for the grouped GEMM's routing (its own group of rows)
    weights, ids = topk_route(
        router_logits, top_k, shared.gate if fold else None, shared_id=0 if gemv else e
    )
    partial = _weighted_rows(x, weights, ids, gate_up, down, spec, tiles, e + fold, shared_w)
    apart = shared is not None and not fold
    return combine(partial, top_k + fold, x.dtype, *((shared.output, shared.gate) if apart else ()))


def moe_experts_routed(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    spec: QuantSpec,
    act: Glu = SILU,
    scale: float = 1.0,
    shared_output: torch.Tensor | None = None,
    tiles: ExpertGemvTiles | GemmTiles | None = None,
) -> torch.Tensor:
    """Routed experts of one MoE layer from a routing computed elsewhere, all on the GPU with
    no host sync. x: [T, D]; weights: [T, k] fp32; ids: [T, k] int32 or int64, each < E (not
    checked: that would read them on the host); gate_up, down and tiles as in `moe_experts`;
    act: the gated activation between the projections. Returns [T, D] in x's dtype:
    scale * sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (+ shared_output [T, D], an
    ungated shared expert's output). The scale multiplies each token's summed rows in the
    combine kernel (a constexpr there: no kernel of its own, and exact for a power of two
    such as MiniMax M3's routed_scaling_factor 2.0)."""
    t, k = ids.shape
    if weights.shape != ids.shape or x.shape[0] != t:
        raise ValueError(
            f"routing weights {list(weights.shape)} and ids {list(ids.shape)} "
            f"do not fit x {list(x.shape)}"
        )
    if weights.dtype != torch.float32 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"routing weights must be fp32 and ids int32/int64, got {weights.dtype} and {ids.dtype}"
        )
    e = gate_up[0].shape[0]
    x = x.contiguous()
    tiles = tiles or default_tiles(t, k, e, x.device)
    partial = _weighted_rows(
        x, weights.contiguous(), ids.contiguous(), gate_up, down, spec, tiles, e, (None, None), act
    )
    return combine(partial, k, x.dtype, shared_output, scale=scale)


def _weighted_rows(
    x, weights, ids, gate_up, down, spec, tiles, num_groups, shared_w, act: Glu = SILU
) -> torch.Tensor:
    """The assignments' weighted rows [T * k, D]: the expert GEMVs (fp32 rows, for a few
    decode tokens) or the grouped GEMMs (rows in x's dtype), as tiles say."""
    if isinstance(tiles, ExpertGemvTiles):
        return expert_gemvs(x, gate_up, down, weights, ids, spec, tiles, shared_w, act)
    return grouped_gemms(x, gate_up, down, weights, ids, num_groups, spec, tiles, shared_w, act)
