"""FP8 block-scaled versions of the model's linear layers and routed experts
(`quant.fp8`: float8_e4m3fn codes and a float32 `weight_scale_inv` per block, named as HF
names them: `<module>.weight` + `<module>.weight_scale_inv`; the fused experts'
`gate_up_proj` + `gate_up_proj_scale_inv`, `down_proj` + `down_proj_scale_inv`).

The weights stay FP8 in memory; each forward dequantises the layer it runs (an expert at a
time in the MoE) and runs the float matmul, on every device. A `gate_up_proj` holds gate and
up rows with their own block rows (`segments=2`: checkpoints store the two apart). FP8 layers
are not fused with their neighbours (`linear.fuse_linears` takes float and group-affine ones).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.kernels.moe import naive
from sparrow.layers.moe import Experts
from sparrow.layers.sigmoid_moe import OAIExperts
from sparrow.quant.fp8 import FP8, Fp8Spec, dequantize, scale_name


def _fp8_params(
    module: nn.Module, name: str, shape: tuple[int, ...], spec: Fp8Spec, segments: int
) -> None:
    """Register `name` (FP8 codes of `shape`) and its `weight_scale_inv` (float32)."""
    module.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=FP8), False))
    scales = torch.empty(spec.scale_shape(shape, segments), dtype=torch.float32)
    module.register_parameter(scale_name(name), nn.Parameter(scales, False))


class Fp8Linear(nn.Module):
    """A bias-free linear layer with FP8 weight [out, in] and its block scales."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        spec: Fp8Spec,
        segments: int = 1,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.spec, self.segments = spec, segments
        self.fp8_weights = {"weight": segments}  # FP8 parameter -> its segments (the loader)
        _fp8_params(self, "weight", (out_features, in_features), spec, segments)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, self.spec, dtype, self.segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype))


class Fp8Experts(Experts):
    """Routed experts with FP8 gate_up [E, 2I, hidden] (gate and up rows each with their
    block rows) and down [E, hidden, I]. Each expert that receives rows is dequantised and
    runs as the float reference (reads the routing on the host)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        spec: Fp8Spec,
        dtype: torch.dtype,
        expert_range: tuple[int, int] | None = None,
    ):
        """num_experts: those held here (`Experts`' expert_range); dtype: the float weights
        an expert dequantises to."""
        nn.Module.__init__(self)
        self.spec, self.dtype, self.expert_range = spec, dtype, expert_range
        self.fp8_weights = {"gate_up_proj": 2, "down_proj": 1}
        _fp8_params(self, "gate_up_proj", (num_experts, 2 * intermediate, hidden), spec, 2)
        _fp8_params(self, "down_proj", (num_experts, hidden, intermediate), spec, 1)

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(
            dequantize(
                getattr(self, n)[e], getattr(self, scale_name(n))[e], self.spec, self.dtype, k
            )
            for n, k in self.fp8_weights.items()
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights, ids: [T, k] -> [T, hidden] (`naive.experts`)."""
        return naive.experts(x, weights, ids, self.expert_weights, self.activation)


class Fp8OAIExperts(Fp8Experts):
    """FP8 `OAIExperts` (MiniMax M3's SwiGLU-OAI experts)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        spec: Fp8Spec,
        dtype: torch.dtype,
        alpha: float,
        limit: float,
        expert_range: tuple[int, int] | None = None,
    ):
        super().__init__(num_experts, hidden, intermediate, spec, dtype, expert_range)
        self.alpha, self.limit = alpha, limit

    activation = OAIExperts.activation
    scaled_sum = OAIExperts.scaled_sum


def _whole_blocks(spec: Fp8Spec, rows: int, cols: int) -> bool:
    return all(b is None or n % b == 0 for n, b in ((rows, spec.block_n), (cols, spec.block_k)))


def fp8_twin(
    module: nn.Module, path: str, spec: Fp8Spec, dtype: torch.dtype, whole_blocks: bool = False
) -> nn.Module | None:
    """The FP8 twin of a float linear layer or routed experts (empty, for the loader to
    fill); None for other modules (embeddings, routers and norms stay float) and, with
    `whole_blocks` (quantising on load), for matrices that do not fill whole blocks, which
    HF's FP8 quantiser leaves in float (`Fp8Quantize`); a checkpoint's own FP8 modules take
    the grid of their scales, whole or not."""
    if type(module) is nn.Linear and module.bias is None:
        segments = 2 if path.endswith("gate_up_proj") else 1
        rows, cols = module.out_features // segments, module.in_features
        if whole_blocks and not _whole_blocks(spec, rows, cols):
            return None
        return Fp8Linear(module.in_features, module.out_features, spec, segments)
    if isinstance(module, Experts) and type(module) in (Experts, OAIExperts):
        e, two_i, hidden = module.gate_up_proj.shape
        fits = _whole_blocks(spec, two_i // 2, hidden) and _whole_blocks(spec, hidden, two_i // 2)
        if whole_blocks and not fits:
            return None
        if isinstance(module, OAIExperts):
            return Fp8OAIExperts(
                e, hidden, two_i // 2, spec, dtype, module.alpha, module.limit, module.expert_range
            )
        return Fp8Experts(e, hidden, two_i // 2, spec, dtype, module.expert_range)
    return None
