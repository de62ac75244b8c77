"""Qwen3.5 / Qwen3.6 MoE text model (`qwen3_5_moe`): the plain-PyTorch reference path.

Layers: `layer_types[i]` picks Gated DeltaNet ("linear_attention") or gated full attention
("full_attention") as the token mixer; every layer then runs the sparse MoE. Parameters are
named exactly like the HF text model without its prefix (`layers.3.self_attn.q_proj.weight`),
so a checkpoint maps onto them by `checkpoint_name`.

A step takes the new tokens of several sequences back to back with their `StepMetadata`
(positions, block tables, state slots) and the `ModelCache` (paged K/V per attention layer,
conv + recurrent state pools per GDN layer): a prompt, a prompt chunk, or one decode token per
sequence all go through the same `forward`. `cache_spec` says what the cache must hold.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from sparrow.config import FULL_ATTENTION, ModelConfig
from sparrow.layers.attention import GatedAttention
from sparrow.layers.gated_deltanet import GatedDeltaNet
from sparrow.layers.moe import SparseMoE
from sparrow.layers.norms import ZeroCenteredRMSNorm
from sparrow.layers.rotary import RotaryEmbedding
from sparrow.worker.cache import CacheSpec, ModelCache, StepMetadata


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        self.is_attention = layer_type == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.mlp = SparseMoE(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta: StepMetadata, cache):
        """x: the previous layer's output (its MLP's, not yet added to the residual stream),
        or the embeddings with residual None. Returns (this layer's MLP output, the residual
        stream before it): each add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add(x, residual)
        if self.is_attention:
            h = self.self_attn(h, cos, sin, meta, cache)
        else:
            h = self.linear_attn(h, meta, cache)
        residual, h = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class Qwen3_5MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (weights may be packed integers)."""
        return self.norm.weight.dtype

    def cache_spec(self) -> CacheSpec:
        cfg = self.config
        return CacheSpec(
            num_attention_layers=sum(layer.is_attention for layer in self.layers),
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            num_recurrent_layers=sum(not layer.is_attention for layer in self.layers),
            conv_shape=(cfg.linear_conv_dim, cfg.linear_conv_kernel - 1),
            state_shape=(cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim),
        )  # fmt: skip

    def forward(self, meta: StepMetadata, cache: ModelCache) -> torch.Tensor:
        """Run the step's new tokens (meta.input_ids [T]); reads and extends the cache.
        Returns final-norm hidden states [T, hidden]."""
        x = self.embed_tokens(meta.input_ids)
        cos, sin = self.rotary.cos_sin(meta.positions, x.dtype)
        attn = iter(zip(cache.k, cache.v, strict=True))
        recurrent = iter(zip(cache.conv, cache.state, strict=True))
        residual = None
        for layer in self.layers:
            caches = next(attn) if layer.is_attention else next(recurrent)
            x, residual = layer(x, residual, cos, sin, meta, caches)
        return self.norm.add(x, residual)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


# Checkpoint names -> parameter names. Vision tower and multi-token-prediction weights are
# not used by the text model.
_IGNORED = re.compile(r"^(mtp\.|model\.visual\.|visual\.|vision_tower\.|model\.mtp\.)")
_PREFIX = re.compile(r"^(model\.language_model\.|language_model\.model\.|model\.)")
_LM_HEAD = re.compile(r"^(language_model\.)?lm_head\.(weight|scales|biases)$")
# HF per-expert names, and MLX's stacked `switch_mlp` projections (all experts at once).
_PER_EXPERT = re.compile(
    r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight)$"
)
_SWITCH_MLP = re.compile(
    r"^(layers\.\d+\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$"
)
# Norms whose MLX weights carry the +1 of the zero-centred RMSNorm.
_SHIFTED_NORMS = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$")


def checkpoint_name(name: str) -> str | None:
    """Map an HF or MLX checkpoint tensor name to our parameter name; None if ignored.

    `model.language_model.layers.0.mlp.gate.weight` -> `layers.0.mlp.gate.weight`;
    `lm_head.weight` / `language_model.lm_head.scales` -> `lm_head.weight` / `lm_head.scales`.
    Expert names keep their per-expert / switch_mlp form: see `expert_target`.
    """
    if _IGNORED.match(name):
        return None
    m = _LM_HEAD.match(name)
    if m:
        return f"lm_head.{m.group(2)}"
    return _PREFIX.sub("", name, count=1)


def expert_target(name: str) -> tuple[str, int | None, str, str] | None:
    """For an expert tensor name (after `checkpoint_name`): (fused parameter, expert index or
    None for all experts, projection, kind in weight/scales/biases). None for other names."""
    m = _PER_EXPERT.match(name)
    if m:
        mlp, expert, proj, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    else:
        m = _SWITCH_MLP.match(name)
        if m is None:
            return None
        mlp, expert, proj, kind = m.group(1), None, m.group(2), m.group(3)
    fused = "gate_up_proj" if proj in ("gate_proj", "up_proj") else "down_proj"
    return f"{mlp}.experts.{fused}", expert, proj, kind


def expert_slice(proj: str, intermediate: int) -> slice:
    """Rows of the fused [2I, hidden] gate_up tensor that one projection fills."""
    if proj == "gate_proj":
        return slice(0, intermediate)
    if proj == "up_proj":
        return slice(intermediate, 2 * intermediate)
    return slice(None)


def is_mlx_conv(param: str, shape: tuple[int, ...]) -> bool:
    """MLX stores the depthwise conv as [C, K, 1] (HF: [C, 1, K])."""
    return param.endswith("conv1d.weight") and shape[-1] == 1 and shape[1] != 1


def from_mlx(param: str, tensor: torch.Tensor) -> torch.Tensor:
    """Undo MLX's layout changes for one tensor: conv [C, K, 1] -> [C, 1, K], and the +1
    baked into zero-centred RMSNorm weights (model.norm included)."""
    if param.endswith("conv1d.weight"):
        return tensor.transpose(1, 2)
    if _SHIFTED_NORMS.search(param) or param == "norm.weight":
        return tensor.float() - 1.0
    return tensor


def to_mlx(param: str, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of `from_mlx`, for writing MLX-layout checkpoints."""
    if param.endswith("conv1d.weight"):
        return tensor.transpose(1, 2)
    if _SHIFTED_NORMS.search(param) or param == "norm.weight":
        return (tensor.float() + 1.0).to(tensor.dtype)
    return tensor


Model = Qwen3_5MoeModel
