"""The routed experts of one MoE layer on the GPU, with no host sync (capturable in a CUDA
graph): top-k routing (`routing.topk_route`), then the expert GEMVs (`expert_gemv`: decode
sizes) or align + the grouped GEMMs (`grouped_gemm`), then the combine (`combine`).
"""

from __future__ import annotations

import torch

from sparrow.kernels import pdl
from sparrow.kernels.moe.combine import combine
from sparrow.kernels.moe.expert_gemv import ExpertGemvTiles, expert_gemvs
from sparrow.kernels.moe.grouped_gemm import GemmTiles, grouped_gemms
from sparrow.kernels.moe.routing import topk_route
from sparrow.kernels.moe.shared import Shared
from sparrow.quant.affine import QuantSpec

# Up to this many tokens each assignment runs as a GEMV (decode batches). The whole layer in a
# CUDA graph on the H200, GEMVs vs grouped GEMM: 8 tokens 64.8 vs 150.1 us, 16: 106.2 vs 195.4,
# 32: 192.0 vs 283.8, 48: 275.4 vs 309.0, 64: 359.7 vs 347.7 (the GEMM's tiles: best of 48).
GEMV_TOKENS = 48


def default_tiles(tokens: int, top_k: int, num_experts: int,
                  device: torch.device) -> ExpertGemvTiles | GemmTiles:  # fmt: skip
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
    weights, ids = topk_route(router_logits, top_k, shared.gate if fold else None,
                              shared_id=0 if gemv else e)  # fmt: skip
    if gemv:  # weighted rows in fp32 for a few decode tokens
        partial = expert_gemvs(x, gate_up, down, weights, ids, spec, tiles, shared_w)
    else:
        partial = grouped_gemms(x, gate_up, down, weights, ids, e + fold, spec, tiles, shared_w)
    apart = shared is not None and not fold
    return combine(partial, top_k + fold, x.dtype, *((shared.output, shared.gate) if apart
                                                     else ()))  # fmt: skip
