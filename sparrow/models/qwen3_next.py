"""Qwen3-Next (`qwen3_next`, Qwen3-Next-80B-A3B): args, model, weight names, caches.

The Gated DeltaNet / gated-attention hybrid of Qwen3.5/3.6 (`qwen3_5_moe`) in its first
form: layers as `layer_types` says (every `full_attention_interval`-th is full attention),
each followed by the sparse MoE with a gated shared expert; zero-centred RMSNorms (1 + w);
plain 1-D partial RoPE; text only. Unlike Qwen3.5, the checkpoint fuses each Gated DeltaNet's
input projections into `in_proj_qkvz` and `in_proj_ba`, rows grouped by key head (HF's
`fix_query_key_value_ordering`): the layer holds them as stored (`GatedDeltaNet(fused_qkvz=
True)`) and regroups the projection's output. Weight names read, MLX layout changes and the
random init are Qwen3.5's; the release keeps the text model under `model.` with one tensor
per expert (`release_tensors`); multi-token-prediction weights (`mtp.*`) are not loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparrow.config import ConfigError, QuantConfig
from sparrow.distributed.shard import (
    ShardPlan,
    cols,
    rows,
)
from sparrow.layers.attention import GatedAttention
from sparrow.layers.decoder import DecoderStack
from sparrow.layers.gated_deltanet import GatedDeltaNet
from sparrow.layers.norms import ZeroCenteredRMSNorm
from sparrow.layers.rotary import ROPE_TYPES, RotaryEmbedding, YarnScaling
from sparrow.models import common, qwen3_5_moe, qwen3_moe
from sparrow.models.qwen3_5_moe import FULL_ATTENTION, LINEAR_ATTENTION, sparse_moe

NAME = "qwen3_next"
MODEL_TYPES = ("qwen3_next",)
HF_PREFIX = "model."
# Qwen3's tokenizer and formats, with the longer context's model_max_length.
SPEAKS = dataclasses.replace(
    qwen3_moe.SPEAKS,
    tokenizer=dataclasses.replace(
        qwen3_moe.SPEAKS.tokenizer,
        config=qwen3_moe.SPEAKS.tokenizer.config | {"model_max_length": 262144},
    ),
)
# HF 5.17's Qwen3NextConfig: its defaults for keys a config.json leaves out, where they
# differ from the ModelArgs defaults (the released checkpoint's values), and the legacy
# layer-type names it still reads.
_HF_MISSING = {"rope_theta": 10_000.0, "max_position_embeddings": 32768}
_LEGACY_LAYER_TYPES = {
    "conv": LINEAR_ATTENTION,
    "mamba": LINEAR_ATTENTION,
    "attention": FULL_ATTENTION,
}
_EOS = 151645  # <|im_end|>
_DENSE_INTERMEDIATE = 5120  # the release's dense MLP width (no layer is dense)


@dataclass(frozen=True)
class ModelArgs(qwen3_5_moe.HybridArgs):
    """Qwen3-Next. Defaults are Qwen3-Next-80B-A3B's checkpoint (`from_hf` fills keys a
    config.json leaves out with HF's defaults instead)."""

    architecture: str = NAME
    vocab_size: int = 151936
    hidden_size: int = 2048
    num_layers: int = 48
    layer_types: tuple[str, ...] = ()
    # Gated full attention.
    num_attention_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    rope_scaling: YarnScaling | None = None  # rope_type "yarn"; None: plain RoPE
    # Gated DeltaNet.
    linear_conv_kernel: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    # Mixture of experts (every layer: configs with dense MLP layers are rejected).
    num_experts: int = 512
    num_experts_per_tok: int = 10
    # expert parallelism: (first, count) of the routed experts this rank holds; None: all
    expert_range: tuple[int, int] | None = None
    # tensor parallelism: (first, count) of the vocabulary rows held here; None: all
    vocab_range: tuple[int, int] | None = None
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    # Everything else.
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    eos_token_ids: tuple[int, ...] = (_EOS,)
    quantization: QuantConfig | None = None  # set for checkpoints stored quantised
    full_attention_interval: int = 4  # the layout when layer_types is not given

    def __post_init__(self) -> None:
        if not self.layer_types and self.full_attention_interval > 0:
            every = self.full_attention_interval  # layers 3, 7, 11, ... for 4, as HF lays out
            types = tuple(
                FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION
                for i in range(self.num_layers)
            )
            object.__setattr__(self, "layer_types", types)
        # Qwen3.5's checks (positive sizes, layer types, head and expert ratios, rotary
        # width): the two configs share those fields and rules
        qwen3_5_moe.validate(self)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelArgs:
        """Parse the dict of an HF `config.json` (model_type `qwen3_next`). Raises
        ConfigError on unsupported or inconsistent configs."""
        for key, expected in (
            ("hidden_act", "silu"),
            ("attention_bias", False),
            ("norm_topk_prob", True),
        ):
            if key in raw and raw[key] != expected:
                raise ConfigError(f"{key}={raw[key]!r} is not supported (expected {expected!r})")
        # HF takes a legacy `rope_scaling` block in place of rope_parameters, `type` for
        # rope_type, and rope keys at the top level
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError("rope_parameters must be a JSON object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"rope_type {rope_type!r} is not supported (expected one of "
                f"{', '.join(map(repr, ROPE_TYPES))})"
            )
        eos = raw.get("eos_token_id")
        eos = _EOS if eos is None or eos == [] else eos  # HF leaves it null by default
        values: dict[str, Any] = dict(_HF_MISSING)
        try:
            for name, key in qwen3_5_moe.HF_TEXT_KEYS.items():
                if key in raw:
                    values[name] = type(getattr(cls, name))(raw[key])  # int, float or bool
            for key in qwen3_5_moe.ROPE_KEYS:
                if key in rope or key in raw:
                    values[key] = float(rope.get(key, raw.get(key)))
            if "full_attention_interval" in raw:
                values["full_attention_interval"] = int(raw["full_attention_interval"])
            if rope_type == "yarn":
                values["rope_scaling"] = YarnScaling.from_hf(
                    rope,
                    values["max_position_embeddings"],
                    raw.get("original_max_position_embeddings"),
                )
            layer_types = [_LEGACY_LAYER_TYPES.get(t, t) for t in raw.get("layer_types") or ()]
            cfg = cls(
                **values,
                layer_types=tuple(layer_types),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
                quantization=QuantConfig.from_checkpoint(raw),
            )
            _check_every_layer_sparse(
                cfg, int(raw.get("decoder_sparse_step", 1)), raw.get("mlp_only_layers") or []
            )
            return cfg
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed config: {e}") from e

    def to_hf_config(self) -> dict[str, Any]:
        """The released config.json (model_type `qwen3_next`, every layer sparse), in its
        keys: `rope_theta`, `partial_rotary_factor` and `rope_scaling` at the top level (what
        mlx-lm reads; HF reads them too), the dense `intermediate_size` no layer uses."""
        eos = self.eos_token_ids
        scaling = self.rope_scaling.to_hf() if self.rope_scaling is not None else None
        return {key: getattr(self, f) for f, key in qwen3_5_moe.HF_TEXT_KEYS.items()} | {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": NAME,
            "layer_types": list(self.layer_types),
            "full_attention_interval": self.full_attention_interval,
            "hidden_act": "silu",
            "attention_bias": False,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "intermediate_size": _DENSE_INTERMEDIATE,
            **{key: getattr(self, key) for key in qwen3_5_moe.ROPE_KEYS},
            "rope_scaling": scaling,
            "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
        }


def _check_every_layer_sparse(cfg: ModelArgs, step: int, mlp_only: list[int]) -> None:
    """HF gives layer i a dense MLP if i is in mlp_only_layers or (i + 1) is not a multiple
    of decoder_sparse_step; Sparrow runs the sparse MoE in every layer."""
    if step <= 0:
        raise ConfigError(f"decoder_sparse_step must be positive, got {step}")
    dense = [i for i in range(cfg.num_layers) if i in mlp_only or (i + 1) % step]
    if dense:
        raise ConfigError(
            f"dense MLP layers {dense} (decoder_sparse_step={step}, mlp_only_layers="
            f"{mlp_only}) are not supported: every layer must be sparse MoE "
            "(decoder_sparse_step 1, mlp_only_layers empty)"
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
                fused_qkvz=True,
            )
        self.mlp = sparse_moe(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # The same residual stream as Qwen3.5's layer: mixer, MoE, adds fused into the norms.
    mixer = qwen3_5_moe.DecoderLayer.mixer
    forward = qwen3_5_moe.DecoderLayer.forward


class Qwen3NextModel(DecoderStack):
    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.config = cfg
        vocab = cfg.vocab_range[1] if cfg.vocab_range else cfg.vocab_size
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        # 1-D positions: every rotary frequency on the first (temporal) axis
        sections = (cfg.rotary_dim // 2, 0, 0)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, sections, cfg.rope_scaling)
        self.requires_grad_(False)

    # Graph and cache rules are Qwen3.5's: same layers.
    prefill_graphs = qwen3_5_moe.Qwen3_5MoeModel.prefill_graphs
    cache_specs = qwen3_5_moe.Qwen3_5MoeModel.cache_specs


# Weight names, the fused-expert layout, the MLX layout (norms stored as 1 + w, conv
# [C, K, 1]) and HF's init are Qwen3.5's; `checkpoint_name` also skips `mtp.*`.
checkpoint_name = qwen3_5_moe.checkpoint_name
expert_target = qwen3_5_moe.expert_target
expert_slice = qwen3_5_moe.expert_slice
is_mlx_conv = qwen3_5_moe.is_mlx_conv
from_mlx = qwen3_5_moe.from_mlx
to_mlx = qwen3_5_moe.to_mlx
init = qwen3_5_moe.init


def release_tensors(
    param: str, tensor: torch.Tensor, mlx: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """How Qwen3-Next's releases store a parameter: under `model.` (`lm_head.weight` apart);
    experts one tensor per expert (`mlp.experts.E.{gate,up,down}_proj.weight`) in the float
    release, stacked as `mlp.switch_mlp.*` with `to_mlx`'s changes in mlx-lm's layout."""
    if mlx:
        return common.lay_out(param, to_mlx(param, tensor), HF_PREFIX, "", "switch_mlp")
    return common.lay_out(param, tensor, HF_PREFIX, "", "per_expert")


def shard_plan(cfg: ModelArgs, expert_parallel: bool) -> ShardPlan:
    """As Qwen3.5/3.6's, but the Gated DeltaNet key heads go with their value heads: the
    in-projections' rows are grouped by key head, so a rank's heads are one contiguous block
    of them, and the conv's [q | k | v] channels, the decay and the out-projection's columns
    follow."""
    kd, vd, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    mixer = [
        (r"\.linear_attn\.in_proj_qkvz\.", rows(2 * kd + 2 * vd)),
        (r"\.linear_attn\.in_proj_ba\.", rows(2 * hv)),
        (r"\.linear_attn\.conv1d\.", rows(kd, kd, vd)),
        (r"\.linear_attn\.(dt_bias|A_log)$", rows(hv)),
        (r"\.linear_attn\.out_proj\.", cols(vd)),
    ]
    return qwen3_5_moe.hybrid_shard_plan(cfg, expert_parallel, mixer)


PRESETS = {
    "qwen3-next-80b-a3b": ModelArgs(),
    # Small enough for CPU tests (full vocabulary, 4 layers, 2 value heads per key head).
    "qwen3-next-tiny": ModelArgs(
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
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

Model = Qwen3NextModel
