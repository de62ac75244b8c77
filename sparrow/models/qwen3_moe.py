"""Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B): args, model, weight names, caches.

Every layer is full attention (GQA, plain q/k RMSNorms, RoPE over the whole head, no output
gate) followed by the sparse MoE (softmax router, top-k renormalised, SwiGLU experts, no
shared expert); all norms are plain RMSNorms (`w * x / rms(x)`, w init 1). Parameters are
named like the HF model without its `model.` prefix (`layers.3.self_attn.q_proj.weight`), so
a checkpoint maps onto them by `checkpoint_name`: HF's per-expert names (what transformers
5.17's `save_pretrained` writes) or fused `experts.gate_up_proj`, and MLX's `switch_mlp`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from sparrow.config import ConfigError, QuantConfig
from sparrow.core.cache_spec import CacheSpec
from sparrow.distributed import group
from sparrow.distributed.shard import ShardPlan, cols, expert_rules, rows, vocab_rules
from sparrow.kernels import use_triton
from sparrow.layers.attention import GatedAttention
from sparrow.layers.decoder import DecoderStack
from sparrow.layers.metadata import StepMetadata
from sparrow.layers.moe import SparseMoE
from sparrow.layers.norms import RMSNorm
from sparrow.layers.rotary import ROPE_TYPES, RotaryEmbedding, YarnScaling
from sparrow.models import common
from sparrow.models.common import text_model_name
from sparrow.models.interface import Init, Speaks, TokenizerLayout

NAME = "qwen3_moe"
MODEL_TYPES = ("qwen3_moe",)
# Qwen3's added tokens at their ids (the regular vocabulary ends at 151,643; the embedding
# has 151,936 rows).
SPECIAL_TOKENS = {
    token: 151643 + i
    for i, token in enumerate(
        (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        )
    )
}
SPEAKS = Speaks(
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    tool_parser="qwen3",  # qwen3-coder XML, or the JSON calls of Qwen3's own template
    reasoning_parser="qwen3",
    tokenizer=TokenizerLayout(
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 131072,
        },
        vocab_limit=151643,
        special_tokens=SPECIAL_TOKENS,
    ),
)
EOS_TOKEN_ID = 151645  # <|im_end|>: HF leaves eos_token_id null by default
_DENSE_INTERMEDIATE = 6144  # the release's dense MLP width (no layer is dense)
# Where the release (and HF's Qwen3MoeForCausalLM) keeps the text model's parameters.
HF_PREFIX = "model."

# ModelArgs field -> key of the HF config holding it (scalars only).
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "initializer_range": "initializer_range",
}
# What HF's Qwen3MoeConfig assumes for keys a config.json leaves out, where it differs from
# the ModelArgs defaults (Qwen3-30B-A3B's values). A missing head_dim is hidden / heads.
_HF_MISSING = {"num_layers": 24, "rope_theta": 10_000.0, "max_position_embeddings": 32768}
# Keys whose other values select layers or options this file does not run: (key, the value
# HF assumes when it is missing, the value run here).
_FIXED = (
    ("hidden_act", "silu", "silu"),
    ("attention_bias", False, False),
    ("use_sliding_window", False, False),
    ("decoder_sparse_step", 1, 1),
    ("mlp_only_layers", [], []),
    ("norm_topk_prob", False, True),
)


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Qwen3-MoE. Defaults are Qwen3-30B-A3B's checkpoint (`from_hf` fills keys a config.json
    leaves out with HF's defaults instead)."""

    architecture: str = NAME
    vocab_size: int = 151936
    hidden_size: int = 2048
    num_layers: int = 48
    # Attention.
    num_attention_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rope_scaling: YarnScaling | None = None  # rope_type "yarn"; None: plain RoPE
    # Mixture of experts.
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    # expert parallelism: (first, count) of the routed experts this rank holds (the router
    # still scores all num_experts); None: all of them
    expert_range: tuple[int, int] | None = None
    # tensor parallelism: (first, count) of the vocabulary rows of the embedding and lm_head
    # this rank holds; None: all of them
    vocab_range: tuple[int, int] | None = None
    # Everything else.
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,)
    quantization: QuantConfig | None = None  # set for checkpoints stored quantised

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelArgs:
        """Parse the dict of an HF `config.json` (model_type `qwen3_moe`). Raises ConfigError
        on unsupported or inconsistent configs."""
        rope = _supported_rope(raw)
        try:
            values = _hf_values(cls, raw, rope)
            return cls(**values, quantization=QuantConfig.from_checkpoint(raw))
        except (TypeError, ValueError, ZeroDivisionError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed config: {e}") from e

    @property
    def max_context(self) -> int:
        """Positions the model takes: max_position_embeddings, or what its rope scaling
        reaches (vLLM's derived max_model_len)."""
        if self.rope_scaling is not None:
            return self.rope_scaling.max_positions
        return self.max_position_embeddings

    def replace(self, **changes: Any) -> ModelArgs:
        return ModelArgs(
            **({f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | changes)
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The released config.json (model_type `qwen3_moe`, `Qwen3MoeForCausalLM`), in its
        keys: `rope_theta` and `rope_scaling` at the top level (what mlx-lm reads; HF reads
        them too), the dense `intermediate_size` no layer uses."""
        config = {key: getattr(self, f) for f, key in _HF_KEYS.items()}
        return config | {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "intermediate_size": _DENSE_INTERMEDIATE,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling is not None else None,
            "eos_token_id": self.eos_token_ids[0]
            if len(self.eos_token_ids) == 1
            else list(self.eos_token_ids),
        }


def _supported_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """The config's RoPE block, after ConfigError for any setting this file does not run."""
    for key, missing, expected in _FIXED:
        value = missing if raw.get(key) is None else raw[key]
        if value != expected:
            why = "" if key in raw else " (HF's value when the key is missing)"
            raise ConfigError(f"{key}={value!r}{why} is not supported (expected {expected!r})")
    # HF takes a legacy `rope_scaling` block in place of rope_parameters, and `type` for
    # rope_type
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError("rope_parameters must be a JSON object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"rope_type {rope_type!r} is not supported (expected one of "
            f"{', '.join(map(repr, ROPE_TYPES))})"
        )
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1:
        raise ConfigError("partial_rotary_factor is not supported: Qwen3-MoE rotates whole heads")
    return rope


def _hf_values(cls, raw: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """ModelArgs keywords from an HF config, as HF's Qwen3MoeConfig reads it."""
    values: dict[str, Any] = dict(_HF_MISSING)
    for name, key in _HF_KEYS.items():
        kind = type(getattr(cls, name))  # int, float or bool
        if key == "num_experts" and key not in raw:  # what HF 5.17 writes
            key = "num_local_experts"
        if key in raw:
            values[name] = kind(raw[key])
    if "rope_theta" in rope or "rope_theta" in raw:
        values["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta")))
    head_dim = raw.get("head_dim")
    if head_dim is None:  # HF's fallback
        heads = values.get("num_attention_heads", cls.num_attention_heads)
        head_dim = values.get("hidden_size", cls.hidden_size) // heads
    values["head_dim"] = int(head_dim)
    if rope.get("rope_type", rope.get("type")) == "yarn":
        values["rope_scaling"] = YarnScaling.from_hf(
            rope, values["max_position_embeddings"], raw.get("original_max_position_embeddings")
        )
    eos = raw.get("eos_token_id")
    eos = EOS_TOKEN_ID if eos is None or eos == [] else eos
    values["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (int(eos),)
    return values


def _validate(cfg: ModelArgs) -> None:
    positive = [
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "max_position_embeddings",
    ]
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim must be even (RoPE rotates pairs), got {cfg.head_dim}")
    if cfg.num_attention_heads % cfg.num_kv_heads:
        raise ConfigError(
            f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({cfg.num_kv_heads})"
        )
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(
            f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds num_experts "
            f"({cfg.num_experts})"
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.self_attn = GatedAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            output_gate=False,
            norm=RMSNorm,
        )
        self.mlp = SparseMoE(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            0,  # no shared expert
            cfg.expert_range,
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta: StepMetadata, cache):
        """x: the previous layer's MLP output (not yet added to the residual stream), or the
        embeddings with residual None. Returns (this layer's MLP output, the residual stream
        before it): each add goes with the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, cos, sin, meta, cache)
        # under tensor parallelism each rank's attention and MoE give partial sums
        residual, h = self.post_attention_layernorm.add(group.all_reduce(h), residual)
        return group.all_reduce(self.mlp(h)), residual


class Qwen3MoeModel(DecoderStack):
    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.config = cfg
        vocab = cfg.vocab_range[1] if cfg.vocab_range else cfg.vocab_size
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        # Plain 1-D RoPE over the whole head: every frequency takes the token's position.
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, (cfg.head_dim // 2, 0, 0), cfg.rope_scaling
        )
        self.requires_grad_(False)

    @property
    def prefill_graphs(self) -> bool:
        """Whether one-prompt prefills may replay CUDA graphs (ModelRunner reads this): with
        the kernels, which read sequence bounds on the device."""
        return use_triton(self.norm.weight)

    def cache_specs(self) -> list[CacheSpec | None]:
        """Paged K/V on every layer."""
        return [layer.self_attn.cache_spec() for layer in self.layers]


# Checkpoint names -> parameter names: HF's `model.` prefix, and the `model.language_model.`
# and `language_model.model.` forms of checkpoints that nest the text model.
def checkpoint_name(name: str) -> str | None:
    """Map an HF or MLX checkpoint tensor name to our parameter name (nothing is ignored):
    `model.layers.0.mlp.gate.weight` -> `layers.0.mlp.gate.weight`. Expert names keep their
    per-expert / switch_mlp form (see `expert_target`); fused HF `mlp.experts.gate_up_proj`
    and `down_proj` are our parameters as they are."""
    return text_model_name(name)


# Routed experts: HF per-expert names or MLX's stacked switch_mlp; the MLX layout is HF's.
expert_target, expert_slice = common.expert_target, common.expert_slice
is_mlx_conv, from_mlx, to_mlx = common.is_mlx_conv, common.from_mlx, common.to_mlx


def release_tensors(
    param: str, tensor: torch.Tensor, mlx: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """How Qwen3-MoE's releases store a parameter: under `model.` (`lm_head.weight` apart);
    experts one tensor per expert (`mlp.experts.E.{gate,up,down}_proj.weight`) in the float
    release, stacked as `mlp.switch_mlp.*` in mlx-lm's layout."""
    return common.lay_out(param, tensor, HF_PREFIX, "", "switch_mlp" if mlx else "per_expert")


def init(param: str) -> Init:
    """HF's init: RMSNorm weights 1, everything else N(0, initializer_range)."""
    return Init.ONES if param.endswith("norm.weight") else Init.NORMAL


def shard_plan(cfg: ModelArgs, expert_parallel: bool) -> ShardPlan:
    """Attention heads, (tensor parallel) every routed expert's intermediate columns or
    (expert parallel) whole experts, the vocabulary rows."""
    d = cfg.head_dim
    fields = ["num_attention_heads", "num_kv_heads"]
    inputs = {"attention heads x head_dim": cfg.num_attention_heads * d}
    if not expert_parallel:
        fields.append("moe_intermediate_size")
        inputs["moe_intermediate_size"] = cfg.moe_intermediate_size
    rules = [
        *vocab_rules(cfg.vocab_size),
        (r"\.self_attn\.q_proj\.", rows(cfg.num_attention_heads * d)),
        (r"\.self_attn\.(k_proj|v_proj)\.", rows(cfg.num_kv_heads * d)),
        (r"\.self_attn\.o_proj\.", cols(cfg.num_attention_heads * d)),
        *expert_rules(cfg.num_experts, cfg.moe_intermediate_size, expert_parallel),
    ]
    return ShardPlan(tuple(fields), inputs, tuple(rules))


PRESETS = {
    "qwen3-30b-a3b": ModelArgs(),
    # Small enough for CPU tests (full vocabulary, 4 layers).
    "qwen3-moe-tiny": ModelArgs(
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
}

Model = Qwen3MoeModel
