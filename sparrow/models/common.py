"""Weight-name pieces several model files share: the text model's prefixes in HF and MLX
checkpoints, routed experts stored per expert (HF) or stacked (MLX's `switch_mlp`) filling
our fused [E, 2I, hidden] / [E, hidden, I] tensors, and the MLX hooks of a model whose MLX
layout is HF's."""

from __future__ import annotations

import re

import torch

# HF (`model.language_model.` in multimodal checkpoints, `model.` in text-only ones) and MLX
# (`language_model.model.`) prefixes of the text model, and the lm_head's names.
_PREFIX = re.compile(r"^(model\.language_model\.|language_model\.model\.|model\.)")
_LM_HEAD = re.compile(r"^(language_model\.)?lm_head\.(weight|scales|biases)$")
# One expert's projection (HF names; MiniMax's w1 / w3 / w2), or all experts' (MLX).
_PER_EXPERT = re.compile(
    r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.(weight)$"
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
    or None for all experts, projection, kind in weight/scales/biases). None for others."""
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
