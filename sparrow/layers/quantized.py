"""Quantised versions of the model's weight-holding modules, and the policy for which
modules are quantised.

What is quantised (the MLX policy, so checkpoints are interchangeable): every linear layer,
the routed experts and the token embedding, when their input dim is a multiple of the group
size. The MoE router (`mlp.gate`) and the shared-expert gate (`mlp.shared_expert_gate`) use
8 bits; everything else 4. What stays in floating point: all norms, the GDN depthwise conv,
`A_log` and `dt_bias`, and MiniMax M3's sigmoid router, which is quantised only where the
config names its full path (a checkpoint's stored layout, `formats.stored_quantization`:
mlx-lm stores it at 8 bits). Modules whose spec is FP8 blocks (`quant.fp8.Fp8Spec`) become
their `layers.fp8` twins instead; quantised on load, only those whose matrices fill whole
blocks (what HF's FP8 quantiser converts).

Quantised parameters sit beside each other: `<module>.weight` (packed int32 words),
`<module>.scales`, `<module>.biases`; for the fused experts `gate_up_proj` with
`gate_up_proj_scales` / `gate_up_proj_biases` (and the same for `down_proj`).

Forward passes: the reference path dequantises, then runs a float matmul; with the Triton
backend, linear layers at decode sizes run the fused-dequant GEMV instead (one row: the row
GEMV; 2-64: tensor cores) where it is the faster (`gemv.fused_pays`), otherwise a one-pass
dequantisation kernel then the matmul, and the routed experts run GPU routing + fused-dequant
expert GEMVs or grouped GEMMs (`QuantizedExperts.route_and_run`; MiniMax M3's own routing:
`sigmoid_moe`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.config import QuantConfig
from sparrow.kernels import use_triton
from sparrow.kernels.dequant.dequant import dequantize as dequantize_kernel
from sparrow.kernels.moe import naive
from sparrow.kernels.moe.experts import moe_experts, moe_experts_routed
from sparrow.kernels.moe.routing import topk_route
from sparrow.kernels.moe.shared import Shared
from sparrow.kernels.quant_gemv.gemv import fused_pays, quant_gemv
from sparrow.layers.fp8 import fp8_twin
from sparrow.layers.linear import fuse_all
from sparrow.layers.moe import Experts
from sparrow.layers.sigmoid_moe import OAIExperts, SigmoidRouter
from sparrow.quant.affine import QuantSpec, dequantize, quantize
from sparrow.quant.fp8 import Fp8Spec


def companion(param: str, kind: str) -> str:
    """Name of the scales/biases parameter that goes with a packed weight parameter."""
    if param == "weight" or param.endswith(".weight"):
        return param[: -len("weight")] + kind
    return f"{param}_{kind}"


def _packed_params(
    module: nn.Module, name: str, shape: tuple[int, ...], spec: QuantSpec, dtype: torch.dtype
) -> None:
    """Register `name` (packed words) and its scales/biases for a float weight of `shape`."""
    module.register_parameter(
        name, nn.Parameter(torch.empty(spec.packed_shape(shape), dtype=torch.int32), False)
    )
    for kind in ("scales", "biases"):
        value = torch.empty(spec.group_shape(shape), dtype=dtype)
        module.register_parameter(companion(name, kind), nn.Parameter(value, False))


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.logical_shapes = {"weight": (out_features, in_features)}
        _packed_params(self, "weight", (out_features, in_features), spec, dtype)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scales, self.biases, self.spec, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if use_triton(x) and fused_pays(rows.shape[0], self.out_features, self.in_features):
            y = quant_gemv(rows, self.weight, self.scales, self.biases, self.spec)
            return y.reshape(*x.shape[:-1], self.out_features)
        if use_triton(x):  # where fused does not pay: one-pass dequantisation, then one GEMM
            w = dequantize_kernel(self.weight, self.scales, self.biases, self.spec, x.dtype)
            return F.linear(x, w)
        return F.linear(x, self.dequantized_weight(x.dtype))

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(first half of the outputs) * second half: this layer as a fused gate_up
        [2I, K]. With the Triton backend the GEMV computes it in its epilogue (one kernel
        instead of three at decode)."""
        rows = x.reshape(-1, self.in_features)
        if use_triton(x) and fused_pays(rows.shape[0], self.out_features, self.in_features):
            h = quant_gemv(rows, self.weight, self.scales, self.biases, self.spec, gated=True)
            return h.reshape(*x.shape[:-1], self.out_features // 2)
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up


class QuantizedEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, spec: QuantSpec, dtype: torch.dtype):
        super().__init__()
        self.spec, self.dtype = spec, dtype
        self.logical_shapes = {"weight": (num_embeddings, dim)}
        _packed_params(self, "weight", (num_embeddings, dim), spec, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(
            self.weight[ids], self.scales[ids], self.biases[ids], self.spec, self.scales.dtype
        )


class QuantizedSigmoidRouter(SigmoidRouter, QuantizedLinear):
    """MiniMax M3's router with a group-affine weight [E, H] (float e_score_correction_bias
    [E]): the logits as a `QuantizedLinear` computes them, in x's dtype (mlx-lm's quantised
    `gate`), the routing `SigmoidRouter`'s."""

    def __init__(self, hidden: int, num_experts: int, spec: QuantSpec, dtype: torch.dtype):
        QuantizedLinear.__init__(self, hidden, num_experts, spec, dtype)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return QuantizedLinear.forward(self, x)


class QuantizedExperts(Experts):
    """Experts with 4-bit gate_up [E, 2I, hidden] and down [E, hidden, I] weights."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        spec: QuantSpec,
        dtype: torch.dtype,
        expert_range: tuple[int, int] | None = None,
    ):
        """num_experts: those held here (`Experts`' expert_range)."""
        nn.Module.__init__(self)
        self.spec, self.expert_range = spec, expert_range
        self.logical_shapes = {
            "gate_up_proj": (num_experts, 2 * intermediate, hidden),
            "down_proj": (num_experts, hidden, intermediate),
        }
        for name, shape in self.logical_shapes.items():
            _packed_params(self, name, shape, spec, dtype)

    def route_and_run(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        top_k: int,
        shared: nn.Module | None = None,
        shared_gate: torch.Tensor | None = None,
    ):
        """With the Triton backend: GPU routing + fused-dequant expert GEMVs or grouped GEMMs,
        no host sync. A shared expert quantised like one routed expert runs inside the
        experts' kernels (one more assignment per token); otherwise as its own layers, its
        output added in the combine kernel. Inside is faster eagerly at every size on the
        H200 (`bench.moe`, 64 / 512 / 2,048 / 8,192 tokens: 809 / 755 / 1,012 / 2,163 us
        against 965 / 1,004 / 1,172 / 2,354 as its own layers: dequantise + cuBLAS per
        projection, 6 launches more), in a CUDA graph 20-40 us slower from 2K tokens (cuBLAS
        beats our GEMM on its shapes)."""
        if not use_triton(x):
            return super().route_and_run(x, router_logits, top_k, shared, shared_gate)
        rows = x.reshape(-1, x.shape[-1])
        if self.expert_range is not None:  # routed on all experts, run on those held here
            weights, ids = self.held(*topk_route(router_logits, top_k))
            side = None if shared is None else torch.sigmoid(shared_gate) * shared(x)
            return moe_experts_routed(
                rows, weights, ids, *self.packed(), self.spec, shared_output=side
            )
        side = None
        if shared is not None:
            weights = self._like_an_expert(shared)
            side = Shared(shared_gate, output=None if weights else shared(x), weights=weights)
        return moe_experts(rows, router_logits, top_k, *self.packed(), self.spec, shared=side)

    def packed(self) -> tuple[tuple, tuple]:
        """(gate_up, down) as the expert kernels take them: (packed words, scales, biases)."""
        return (
            (self.gate_up_proj, self.gate_up_proj_scales, self.gate_up_proj_biases),
            (self.down_proj, self.down_proj_scales, self.down_proj_biases),
        )

    def _like_an_expert(self, shared: nn.Module) -> tuple[tuple, tuple] | None:
        """The shared expert's packed (gate_up, down) if they match one routed expert's
        format and shapes, else None."""
        mods = shared.projections() if hasattr(shared, "projections") else None
        if mods is None or not all(isinstance(m, QuantizedLinear) for m in mods):
            return None
        packed = tuple((m.weight, m.scales, m.biases) for m in mods)
        mine = (
            (self.gate_up_proj, self.gate_up_proj_scales),
            (self.down_proj, self.down_proj_scales),
        )
        for m, (w, s, _), (ew, es) in zip(mods, packed, mine, strict=True):
            if (
                m.spec != self.spec
                or w.shape != ew.shape[1:]
                or s.shape != es.shape[1:]
                or s.dtype != es.dtype
            ):
                return None
        return packed

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.gate_up_proj_scales.dtype
        return tuple(
            dequantize(
                getattr(self, n)[e],
                getattr(self, f"{n}_scales")[e],
                getattr(self, f"{n}_biases")[e],
                self.spec,
                dtype,
            )
            for n in ("gate_up_proj", "down_proj")
        )


class QuantizedOAIExperts(QuantizedExperts):
    """4-bit `OAIExperts`. With the Triton backend the fused expert kernels (expert GEMVs up
    to 48 tokens, else grouped GEMMs; SwiGLU-OAI in their epilogue, no host sync); otherwise
    each expert that receives rows is dequantised and runs as the float reference (reads the
    routing on the host)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        spec,
        dtype,
        alpha: float,
        limit: float,
        expert_range: tuple[int, int] | None = None,
    ):
        super().__init__(num_experts, hidden, intermediate, spec, dtype, expert_range)
        self.alpha, self.limit = alpha, limit

    activation = OAIExperts.activation
    glu = OAIExperts.glu

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """x: [T, H]; weights, ids: [T, k]. sum_j w_tj * expert_{ids_tj}(x_t), [T, H]."""
        if use_triton(x):
            return self._fused(x, weights, ids)
        return naive.experts(x, weights, ids, self.expert_weights, self.activation)

    def scaled_sum(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        scale: float,
        shared: torch.Tensor,
    ) -> torch.Tensor:
        """`OAIExperts.scaled_sum`. With the Triton backend the combine kernel scales each
        token's routed sum (fp32) and adds shared, rounding once to x's dtype."""
        if use_triton(x):
            return self._fused(x, weights, ids, scale, shared)
        return OAIExperts.scaled_sum(self, x, weights, ids, scale, shared)

    def _fused(self, x, weights, ids, scale: float = 1.0, shared=None) -> torch.Tensor:
        return moe_experts_routed(
            x, weights, ids, *self.packed(), self.spec, self.glu(), scale, shared
        )


def _experts_twin(module: Experts, spec: QuantSpec, dtype: torch.dtype) -> QuantizedExperts:
    e, two_i, hidden = module.gate_up_proj.shape
    return QuantizedExperts(e, hidden, two_i // 2, spec, dtype, module.expert_range)


def _oai_experts_twin(
    module: OAIExperts, spec: QuantSpec, dtype: torch.dtype
) -> QuantizedOAIExperts:
    e, two_i, hidden = module.gate_up_proj.shape
    return QuantizedOAIExperts(
        e, hidden, two_i // 2, spec, dtype, module.alpha, module.limit, module.expert_range
    )


# Float experts -> their group-affine quantised twin (empty, for the loader to fill), by class;
# a subclass takes its own entry before its base's.
EXPERT_TWINS = {OAIExperts: _oai_experts_twin, Experts: _experts_twin}


def quantize_modules(
    model: nn.Module, qcfg: QuantConfig, dtype: torch.dtype, prefix: str = ""
) -> nn.Module:
    """Swap the model's weight-holding modules for quantised ones following `qcfg` (call it
    under `torch.device("meta")`: the loader fills the new parameters). `prefix` is the
    model's own path in the full model, for the per-module overrides. Returns the model."""
    named = {key for key, _ in qcfg.overrides}
    for path, module in list(model.named_modules()):
        spec = qcfg.spec_for(prefix + path)
        if spec is None:
            continue
        if isinstance(spec, Fp8Spec):  # the default spec (on load) only over whole blocks
            new = fp8_twin(module, prefix + path, spec, dtype, prefix + path not in named)
            if new is None:
                continue
        elif isinstance(module, nn.Linear) and module.in_features % spec.group_size == 0:
            new = QuantizedLinear(module.in_features, module.out_features, spec, dtype)
        elif (
            type(module) is SigmoidRouter
            and prefix + path in named
            and module.weight.shape[-1] % spec.group_size == 0
        ):
            new = QuantizedSigmoidRouter(*module.weight.shape[::-1], spec, dtype)
        elif isinstance(module, nn.Embedding) and module.embedding_dim % spec.group_size == 0:
            new = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, spec, dtype)
        elif (
            isinstance(module, Experts)
            and not hasattr(module, "spec")
            and all(
                w.shape[-1] % spec.group_size == 0 for w in (module.gate_up_proj, module.down_proj)
            )
        ):
            new = next(make for cls, make in EXPERT_TWINS.items() if isinstance(module, cls))(
                module, spec, dtype
            )
        else:
            continue
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def quantized_copy(
    module: nn.Module, qcfg: QuantConfig, dtype: torch.dtype, prefix: str = ""
) -> nn.Module:
    """A quantised twin of a float module: weights quantised from it, float parameters (norms,
    conv) shared. For benchmarking one layer without building a whole model."""
    float_params = dict(module.named_parameters())
    with torch.device("meta"):
        twin = copy.deepcopy(module).to("meta")
        quantize_modules(twin, qcfg, dtype, prefix)
    state = {}
    for path, m in twin.named_modules():
        for name in getattr(m, "logical_shapes", {}):
            full = f"{path}.{name}" if path else name
            packed, scales, biases = quantize(float_params[full], m.spec, dtype)
            state[full] = packed
            state[companion(full, "scales")], state[companion(full, "biases")] = scales, biases
    for name, _ in twin.named_parameters():
        state.setdefault(name, float_params.get(name))
    twin.load_state_dict(state, strict=True, assign=True)
    fuse_all(twin)  # as the loader leaves a model: projections of one input fused
    return twin
