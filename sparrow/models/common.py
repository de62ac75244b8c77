"""Weight-name pieces several model files share: the text model's prefixes in HF and MLX
checkpoints, routed experts stored per expert (HF) or stacked (MLX's `switch_mlp`) filling
our fused [E, 2I, hidden] / [E, hidden, I] tensors and laid out back that way (`lay_out`),
and the MLX hooks of a model whose MLX layout is HF's."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

# HF (`model.language_model.` in multimodal checkpoints, `model.` in text-only ones) and MLX
# (`language_model.model.`) prefixes of the text model, and the lm_head's names.
_PREFIX = re.compile(r"^(model\.language_model\.|language_model\.model\.|model\.)")
_LM_HEAD = re.compile(r"^(language_model\.)?lm_head\.(weight|scales|biases)$")
# One expert's projection (HF names; MiniMax's w1 / w3 / w2: the weight, or its FP8 block
# scales, or, from a converted compressed-tensors module, its group-affine scales and biases),
# or all experts' (MLX).
_PER_EXPERT = re.compile(
    r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale_inv|scales|biases)$"
)
_SWITCH_MLP = re.compile(
    r"^(layers\.\d+\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$"
)
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def text_model_name(name: str) -> str:
    """A checkpoint name without the text model's prefix: `model.language_model.layers.0.x`
    and `language_model.model.layers.0.x` -> `layers.0.x`; `language_model.lm_head.scales`
    -> `lm_head.scales`."""
    m = _LM_HEAD.match(name)
    if m:
        return f"lm_head.{m.group(2)}"
    return _PREFIX.sub("", name, count=1)


def expert_target(name: str) -> tuple[str, int | None, str, str] | None:
    """For a routed expert's tensor name (after the prefix): (fused parameter, expert index
    or None for all experts, projection, kind in weight/scales/biases/weight_scale_inv). None
    for others."""
    m = _PER_EXPERT.match(name)
    if m:
        mlp, expert, proj, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        proj = _PROJ.get(proj, proj)
    else:
        m = _SWITCH_MLP.match(name)
        if m is None:
            return None
        mlp, expert, proj, kind = m.group(1), None, m.group(2), m.group(3)
    fused = "gate_up_proj" if proj in ("gate_proj", "up_proj") else "down_proj"
    return f"{mlp}.experts.{fused}", expert, proj, kind


def expert_slice(proj: str, intermediate: int) -> slice:
    """Rows of a fused [.., 2I, hidden] gate_up tensor that one projection fills."""
    if proj == "gate_proj":
        return slice(0, intermediate)
    if proj == "up_proj":
        return slice(intermediate, 2 * intermediate)
    return slice(None)


def is_mlx_conv(param: str, shape: tuple[int, ...]) -> bool:
    """No convolutions to transpose."""
    return False


def from_mlx(param: str, tensor: torch.Tensor) -> torch.Tensor:
    """MLX stores every tensor as HF does."""
    return tensor


def to_mlx(param: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# Our fused routed experts: gate_up [E, 2I, hidden] (gate rows first), down [E, hidden, I];
# quantised, the packed words keep the name and `_scales` / `_biases` sit beside them.
_FUSED_EXPERTS = re.compile(r"^(.+)\.experts\.(gate_up_proj|down_proj)(?:_(scales|biases))?$")
# Names of one expert's projections in HF's per-expert layout.
HF_EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


def expert_projections(
    param: str, tensor: torch.Tensor
) -> tuple[str, str, list[tuple[str, torch.Tensor]]] | None:
    """A fused routed-expert parameter split by projection: (the MLP's path, kind in
    weight/scales/biases, [(projection, [E, rows, cols])]); None for other parameters."""
    m = _FUSED_EXPERTS.match(param)
    if m is None:
        return None
    mlp, fused, kind = m.group(1), m.group(2), m.group(3) or "weight"
    if fused == "down_proj":
        return mlp, kind, [("down_proj", tensor)]
    gate, up = tensor.chunk(2, dim=-2)
    return mlp, kind, [("gate_proj", gate), ("up_proj", up)]


def lay_out(
    param: str,
    tensor: torch.Tensor,
    prefix: str,
    head_prefix: str,
    experts: str,
    expert_names: dict[str, str] = HF_EXPERT_NAMES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for one parameter: under `prefix` (the lm_head under
    `head_prefix`), routed experts as they are ("fused": `experts.gate_up_proj`), one tensor
    per expert and projection ("per_expert": `experts.E.<expert_names[proj]>.<kind>`) or
    stacked by projection ("switch_mlp": MLX's `switch_mlp.<proj>.<kind>`)."""
    if param.startswith("lm_head."):
        yield head_prefix + param, tensor
        return
    split = expert_projections(param, tensor) if experts != "fused" else None
    if split is None:
        yield prefix + param, tensor
        return
    mlp, kind, pieces = split
    for proj, t in pieces:
        if experts == "switch_mlp":
            yield f"{prefix}{mlp}.switch_mlp.{proj}.{kind}", t
        else:
            for e, w in enumerate(t):
                yield f"{prefix}{mlp}.experts.{e}.{expert_names[proj]}.{kind}", w
