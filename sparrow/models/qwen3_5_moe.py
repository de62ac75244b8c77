"""Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`, `qwen3_5_moe_text`): args, model, weight names, caches.

Layers: `layer_types[i]` picks Gated DeltaNet ("linear_attention") or gated full attention
("full_attention") as the token mixer; every layer then runs the sparse MoE. Parameters are
named exactly like the HF text model without its prefix (`layers.3.self_attn.q_proj.weight`),
so a checkpoint maps onto them by `checkpoint_name`.

A step takes the new tokens of several sequences back to back with their `StepMetadata`
(positions, block tables, state slots) and the `ModelCache` (one entry per layer, shaped by
`cache_specs`): a prompt, a prompt chunk, or one decode token per sequence all go through
the same `forward`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from sparrow.config import ConfigError, QuantConfig
from sparrow.core.cache_spec import CacheSpec
from sparrow.distributed import group
from sparrow.distributed.shard import (
    Rule,
    ShardPlan,
    cols,
    expert_rules,
    gated_mlp_rules,
    rows,
    vocab_rules,
)
from sparrow.kernels import use_triton
from sparrow.layers.attention import GatedAttention
from sparrow.layers.decoder import DecoderStack
from sparrow.layers.gated_deltanet import GatedDeltaNet
from sparrow.layers.metadata import StepMetadata
from sparrow.layers.moe import SparseMoE
from sparrow.layers.norms import ZeroCenteredRMSNorm
from sparrow.layers.rotary import ROPE_TYPES, RotaryEmbedding, YarnScaling
from sparrow.models import common
from sparrow.models.common import text_model_name
from sparrow.models.interface import Init, MediaFormat, Speaks, TokenizerLayout
from sparrow.multimodal.specs import QWEN3_5_MOE
from sparrow.multimodal.video import QWEN3_5_MOE_VIDEO

NAME = "qwen3_5_moe"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
HF_PREFIX = "model.language_model."
SPEAKS = Speaks(
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    tool_parser="qwen3",
    reasoning_parser="qwen3",
    tokenizer=TokenizerLayout(
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 262144,
        }
    ),
    media=MediaFormat(QWEN3_5_MOE, QWEN3_5_MOE_VIDEO),
)
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
# What HF's Qwen3_5MoeTextConfig assumes for keys a config.json leaves out, where it differs
# from the ModelArgs defaults (the released checkpoint's values).
_HF_MISSING = {"rope_theta": 10_000.0, "max_position_embeddings": 32768}

# ModelArgs field -> key of the HF text_config holding it (scalars only; Qwen3-Next's too).
HF_TEXT_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "linear_conv_kernel": "linear_conv_kernel_dim",
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "initializer_range": "initializer_range",
}
# Keys of the RoPE parameters block, same names on both sides.
ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


class HybridArgs:
    """The derived sizes and `replace` of a Gated DeltaNet hybrid's frozen args (Qwen3.5/3.6
    here, Qwen3-Next): the fields they read are each subclass's."""

    @property
    def max_context(self) -> int:
        """Positions the model takes: max_position_embeddings, or what its rope scaling
        reaches (vLLM's derived max_model_len)."""
        if self.rope_scaling is not None:
            return self.rope_scaling.max_positions
        return self.max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise conv: [q | k | v]."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def replace(self, **changes: Any) -> Self:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__} | changes
        relayout = {"num_layers", "full_attention_interval"} & set(changes)
        if relayout and "layer_types" not in changes:
            values["layer_types"] = ()
        return type(self)(**values)


@dataclass(frozen=True)
class ModelArgs(HybridArgs):
    """The text model of Qwen3.5/3.6 MoE. Defaults are Qwen3.6-35B-A3B's checkpoint (`from_hf`
    fills keys a config.json leaves out with HF's defaults instead)."""

    architecture: str = NAME
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_layers: int = 40
    layer_types: tuple[str, ...] = ()
    # Gated full attention.
    num_attention_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    rope_scaling: YarnScaling | None = None  # rope_type "yarn"; None: plain RoPE
    # Gated DeltaNet.
    linear_conv_kernel: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    # Mixture of experts.
    num_experts: int = 256
    num_experts_per_tok: int = 8
    # expert parallelism: (first, count) of the routed experts this rank holds (the router
    # still scores all num_experts); None: all of them
    expert_range: tuple[int, int] | None = None
    # tensor parallelism: (first, count) of the vocabulary rows of the embedding and lm_head
    # this rank holds; None: all of them
    vocab_range: tuple[int, int] | None = None
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    # Everything else.
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    eos_token_ids: tuple[int, ...] = (248046,)
    quantization: QuantConfig | None = None  # set for checkpoints stored quantised
    full_attention_interval: int = 4  # the layout when layer_types is not given

    def __post_init__(self) -> None:
        if not self.layer_types:
            # Every interval-th layer is full attention (3, 7, 11, ... for 4), as HF lays out.
            every = self.full_attention_interval
            types = tuple(
                FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION
                for i in range(self.num_layers)
            )
            object.__setattr__(self, "layer_types", types)
        validate(self)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelArgs:
        """Parse the dict of an HF `config.json` (`qwen3_5_moe` with `text_config`, or a bare
        `qwen3_5_moe_text`). Raises ConfigError on unsupported or inconsistent configs."""
        text = raw.get("text_config", raw) if raw.get("model_type") == "qwen3_5_moe" else raw
        if not isinstance(text, dict):
            raise ConfigError("text_config must be a JSON object")
        for key, expected in (
            ("hidden_act", "silu"),
            ("attention_bias", False),
            ("attn_output_gate", True),
        ):
            if key in text and text[key] != expected:
                raise ConfigError(f"{key}={text[key]!r} is not supported (expected {expected!r})")
        # HF takes a legacy `rope_scaling` block in place of rope_parameters, and `type`
        # for rope_type
        rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError("rope_parameters must be a JSON object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"rope_type {rope_type!r} is not supported (expected one of "
                f"{', '.join(map(repr, ROPE_TYPES))})"
            )
        eos = text.get("eos_token_id")
        eos = raw.get("eos_token_id") if eos is None else eos
        eos = 248046 if eos is None or eos == [] else eos  # HF leaves it null by default
        values: dict[str, Any] = dict(_HF_MISSING)
        try:
            for name, key in HF_TEXT_KEYS.items():
                kind = type(getattr(cls, name))  # int, float or bool
                if key == "tie_word_embeddings" and key in raw:  # HF ties by the top level
                    values[name] = bool(raw[key])
                elif key in text:
                    values[name] = kind(text[key])
            for key in ROPE_KEYS:
                if key in rope or key in text:
                    values[key] = float(rope.get(key, text.get(key)))
            if "mrope_section" in rope:
                values["mrope_section"] = tuple(int(x) for x in rope["mrope_section"])
            if "full_attention_interval" in text:
                values["full_attention_interval"] = int(text["full_attention_interval"])
            if rope_type == "yarn":
                values["rope_scaling"] = YarnScaling.from_hf(
                    rope,
                    values["max_position_embeddings"],
                    text.get("original_max_position_embeddings"),
                )
            return cls(
                **values,
                layer_types=tuple(text.get("layer_types") or ()),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
                quantization=QuantConfig.from_checkpoint(raw),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed config: {e}") from e

    def to_hf_text_config(self) -> dict[str, Any]:
        """The `text_config` dict of an HF `config.json` (model_type `qwen3_5_moe_text`)."""
        text = {key: getattr(self, f) for f, key in HF_TEXT_KEYS.items()}
        return text | {
            "model_type": "qwen3_5_moe_text",
            "layer_types": list(self.layer_types),
            "full_attention_interval": self.full_attention_interval,
            "hidden_act": "silu",
            "attention_bias": False,
            "attn_output_gate": True,
            "rope_parameters": {
                "rope_type": "default",
                **{key: getattr(self, key) for key in ROPE_KEYS},
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            }
            | (self.rope_scaling.to_hf() if self.rope_scaling is not None else {}),
            "eos_token_id": self.eos_token_ids[0]
            if len(self.eos_token_ids) == 1
            else list(self.eos_token_ids),
            "mamba_ssm_dtype": "float32",
        }

    def to_hf_config(self) -> dict[str, Any]:
        """A full HF `config.json` of model_type `qwen3_5_moe` (text config nested)."""
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": self.to_hf_text_config(),
            "vision_config": {
                "model_type": "qwen3_5_moe_vision",
                "out_hidden_size": self.hidden_size,
            },
            "image_token_id": 248056,
            "video_token_id": 248057,
            "vision_start_token_id": 248053,
            "vision_end_token_id": 248054,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


def validate(cfg: ModelArgs) -> None:
    """ConfigError for sizes the layers cannot run (also Qwen3-Next's checks)."""
    positive = [
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_kv_heads",
        "full_attention_interval",
        "head_dim",
        "linear_conv_kernel",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "max_position_embeddings",
    ]
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    if len(cfg.layer_types) != cfg.num_layers:
        raise ConfigError(
            f"layer_types has {len(cfg.layer_types)} entries but num_hidden_layers is "
            f"{cfg.num_layers}"
        )
    unknown = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"unknown layer types {unknown}; expected one of {list(LAYER_TYPES)}")
    if cfg.num_attention_heads % cfg.num_kv_heads:
        raise ConfigError(
            f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({cfg.num_kv_heads})"
        )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(
            f"linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({cfg.linear_num_key_heads})"
        )
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(
            f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds num_experts "
            f"({cfg.num_experts})"
        )
    rotary = cfg.rotary_dim
    if not (0 < rotary <= cfg.head_dim) or rotary % 2:
        raise ConfigError(
            f"partial_rotary_factor {cfg.partial_rotary_factor} gives rotary dim {rotary}; it "
            f"must be even and in (0, head_dim={cfg.head_dim}]"
        )
    # mrope_section is not checked against the rotary width: HF slices it to fit (text
    # positions are equal on all three axes, so the split does not change text).


def sparse_moe(cfg: ModelArgs) -> SparseMoE:
    """The MoE block of one layer (also built alone by benchmarks and tests)."""
    return SparseMoE(
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
        cfg.expert_range,
    )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArgs, layer_type: str):
        super().__init__()
        self.is_attention = layer_type == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                cfg.rms_norm_eps,
            )
        else:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel,
                cfg.rms_norm_eps,
            )
        self.mlp = sparse_moe(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.is_attention else self.linear_attn

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
        # under tensor parallelism each rank's mixer and MoE give partial sums
        residual, h = self.post_attention_layernorm.add(group.all_reduce(h), residual)
        return group.all_reduce(self.mlp(h)), residual


class Qwen3_5MoeModel(DecoderStack):
    uses_mrope = True

    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.config = cfg
        vocab = cfg.vocab_range[1] if cfg.vocab_range else cfg.vocab_size
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.rotary = RotaryEmbedding(
            cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section, cfg.rope_scaling
        )
        self.requires_grad_(False)

    @property
    def prefill_graphs(self) -> bool:
        """Whether one-prompt prefills may replay CUDA graphs (ModelRunner reads this): only
        when every Gated DeltaNet layer takes the kernels, which read sequence bounds on the
        device; the reference path splits the step by lengths read on the host."""
        return use_triton(self.norm.weight) and all(
            layer.linear_attn.kernels_fit for layer in self.layers if not layer.is_attention
        )

    def cache_specs(self) -> list[CacheSpec | None]:
        """What each layer keeps between steps: paged K/V for attention, conv + recurrent
        state slots for Gated DeltaNet."""
        return [layer.mixer.cache_spec() for layer in self.layers]


# Checkpoint names -> parameter names. Vision tower and multi-token-prediction weights are
# not used by the text model.
_IGNORED = re.compile(r"^(mtp\.|model\.visual\.|visual\.|vision_tower\.|model\.mtp\.)")
# Norms whose MLX weights carry the +1 of the zero-centred RMSNorm.
_SHIFTED_NORMS = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$")


def checkpoint_name(name: str) -> str | None:
    """Map an HF or MLX checkpoint tensor name to our parameter name; None if ignored.

    `model.language_model.layers.0.mlp.gate.weight` -> `layers.0.mlp.gate.weight`;
    `lm_head.weight` / `language_model.lm_head.scales` -> `lm_head.weight` / `lm_head.scales`.
    Expert names keep their per-expert / switch_mlp form: see `expert_target`.
    """
    return None if _IGNORED.match(name) else text_model_name(name)


# Routed experts: HF per-expert names or MLX's stacked switch_mlp (`models.common`).
expert_target = common.expert_target
expert_slice = common.expert_slice


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


def release_tensors(
    param: str, tensor: torch.Tensor, mlx: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """How Qwen3.5/3.6's releases store a parameter. The float release: under
    `model.language_model.` (`lm_head.weight` apart), experts fused as we hold them
    (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], no `.weight`). MLX
    (mlx-community): under `language_model.model.` (`language_model.lm_head.*`), experts as
    `mlp.switch_mlp.{gate,up,down}_proj.*`, `to_mlx`'s conv and norm changes."""
    if mlx:
        return common.lay_out(
            param, to_mlx(param, tensor), "language_model.model.", "language_model.", "switch_mlp"
        )
    return common.lay_out(param, tensor, HF_PREFIX, "", "fused")


def init(param: str) -> Init:
    """HF's init: zero-centred RMSNorms 0, the Gated DeltaNet's output norm and dt_bias 1,
    A_log log U(0.01, 16), everything else N(0, initializer_range)."""
    if param.endswith("A_log"):
        return Init.LOG_UNIFORM
    if param.endswith(("dt_bias", "linear_attn.norm.weight")):
        return Init.ONES
    return Init.ZEROS if param.endswith("norm.weight") else Init.NORMAL


def shard_plan(cfg: ModelArgs, expert_parallel: bool) -> ShardPlan:
    """Attention heads (q rows hold each head's [q | gate]), Gated DeltaNet key and value
    heads (with their conv channels, gates and decay), the shared expert's and (tensor
    parallel) every routed expert's intermediate columns, the vocabulary rows."""
    kd, vd, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    mixer = [
        (r"\.linear_attn\.(in_proj_qkv|conv1d)\.", rows(kd, kd, vd)),
        (r"\.linear_attn\.in_proj_z\.", rows(vd)),
        (r"\.linear_attn\.(in_proj_b\.|in_proj_a\.|dt_bias$|A_log$)", rows(hv)),
        (r"\.linear_attn\.out_proj\.", cols(vd)),
    ]
    return hybrid_shard_plan(cfg, expert_parallel, mixer)


def hybrid_shard_plan(cfg: Any, expert_parallel: bool, mixer: list[Rule]) -> ShardPlan:
    """The plan of a Gated DeltaNet hybrid (Qwen3.5/3.6, Qwen3-Next) around the `mixer`
    rules of its Gated DeltaNet projections: the heads and widths divided by the ranks, gated
    attention's heads, the routed and shared experts, the vocabulary rows."""
    d = cfg.head_dim
    fields = ["num_attention_heads", "num_kv_heads", "linear_num_key_heads"]
    fields += ["linear_num_value_heads", "shared_expert_intermediate_size"]
    inputs = {
        "attention heads x head_dim": cfg.num_attention_heads * d,
        "value heads x linear_value_head_dim": cfg.linear_value_dim,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }
    if not expert_parallel:
        fields.append("moe_intermediate_size")
        inputs["moe_intermediate_size"] = cfg.moe_intermediate_size
    rules = [
        *vocab_rules(cfg.vocab_size),
        (r"\.self_attn\.q_proj\.", rows(2 * cfg.num_attention_heads * d)),
        (r"\.self_attn\.(k_proj|v_proj)\.", rows(cfg.num_kv_heads * d)),
        (r"\.self_attn\.o_proj\.", cols(cfg.num_attention_heads * d)),
        *mixer,
        *expert_rules(cfg.num_experts, cfg.moe_intermediate_size, expert_parallel),
        *gated_mlp_rules(r"\.mlp\.shared_expert", cfg.shared_expert_intermediate_size),
    ]
    return ShardPlan(tuple(fields), inputs, tuple(rules))


PRESETS = {
    "qwen3.6-35b-a3b": ModelArgs(),
    # Small enough for CPU tests (full vocabulary, 4 layers).
    "qwen3.6-tiny": ModelArgs(
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        mrope_section=(2, 1, 1),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
}

Model = Qwen3_5MoeModel
