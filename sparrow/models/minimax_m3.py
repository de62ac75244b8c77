"""MiniMax M3 (`minimax_m3_vl`, `minimax_m3_vl_text`): args, model, weight names, caches.

Layers: `layer_types[i]` picks full attention ("full_attention") or MiniMax Sparse Attention
("minimax_m3_sparse": the MSA indexer selects key blocks), `mlp_layer_types[i]` a dense
SwiGLU-OAI MLP ("dense") or the sigmoid-routed MoE ("sparse"). The released checkpoint has
layers 0-2 full + dense and 3-59 sparse + MoE. Parameters are named like the HF text model
without its prefix (`layers.3.self_attn.indexer.q_proj.weight`); `checkpoint_name` maps the
HF-native names and the original MiniMax ones (`block_sparse_moe`, `index_q_proj`, per-expert
`w1/w3/w2`, separate `gate_proj/up_proj`) onto them, and `release_tensors` writes the
original ones (the release's config.json: `ModelArgs.to_hf_config`). Vision and MTP weights
are ignored.

Caches: paged K/V for every layer, plus one index key per token on sparse layers, in pages of
exactly `index_block_size` tokens (one page per MSA block; `ModelCache` rejects other sizes).

4-bit (group-affine, MLX layout, groups of 64): every linear layer (attention, indexer,
dense MLPs, shared experts, lm_head), the routed experts and the token embedding. What stays
in float: all norms and the routers (`mlp.gate`: weight and e_score_correction_bias), except
in a checkpoint that stores a router's weight quantised (mlx-lm's, at 8 bits), which loads
as stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from sparrow.config import ConfigError, QuantConfig
from sparrow.core.cache_spec import CacheSpec
from sparrow.distributed import group
from sparrow.distributed.shard import (
    ShardPlan,
    cols,
    expert_rules,
    gated_mlp_rules,
    rows,
    vocab_rules,
)
from sparrow.layers.decoder import DecoderStack
from sparrow.layers.metadata import StepMetadata
from sparrow.layers.msa import M3Attention
from sparrow.layers.norms import ZeroCenteredRMSNorm
from sparrow.layers.rotary import RotaryEmbedding
from sparrow.layers.sigmoid_moe import DenseMLP, SigmoidMoE
from sparrow.models import common
from sparrow.models.common import text_model_name
from sparrow.models.interface import Init, MediaFormat, Speaks, TokenizerLayout
from sparrow.multimodal.specs import MINIMAX_M3
from sparrow.multimodal.video import MINIMAX_M3_VIDEO

NAME = "minimax_m3"
MODEL_TYPES = ("minimax_m3_vl", "minimax_m3_vl_text")
HF_PREFIX = "language_model.model."  # the release's (HF's own classes: model.language_model.)
# The checkpoint's special tokens at its ids (bos, eos, role marker, vision); regular tokens
# take the ids below 200,000.
SPECIAL_TOKENS = {
    "]~b]": 200019,
    "[e~[": 200020,
    "]<]image[>[": 200025,
    "]<]video[>[": 200026,
    "]<]start of image[>[": 200029,
    "]<]end of image[>[": 200030,
    "]<]start of video[>[": 200031,
    "]<]end of video[>[": 200032,
    "]<]vision pad[>[": 200033,
    "]~!b[": 200034,
}
SPEAKS = Speaks(
    tool_parser="minimax_m3",
    reasoning_parser="minimax_m3",
    tokenizer=TokenizerLayout(
        {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": "]~!b[",
            "eos_token": "[e~[",
            "model_max_length": 1048576,
        },
        chat_template="minimax",
        vocab_limit=200_000,
        special_tokens=SPECIAL_TOKENS,
    ),
    media=MediaFormat(MINIMAX_M3, MINIMAX_M3_VIDEO, wrap_images=True),
)
FULL_ATTENTION, SPARSE_ATTENTION = "full_attention", "minimax_m3_sparse"
LAYER_TYPES = (FULL_ATTENTION, SPARSE_ATTENTION)
DENSE, MOE = "dense", "sparse"
MLP_LAYER_TYPES = (DENSE, MOE)

# ModelArgs field -> key of the HF text config (scalars only).
_HF_TEXT_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "num_experts": "num_local_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "intermediate_size",
    "dense_intermediate_size": "dense_intermediate_size",
    "shared_intermediate_size": "shared_intermediate_size",
    "routed_scaling_factor": "routed_scaling_factor",
    "swiglu_alpha": "swiglu_alpha",
    "swiglu_limit": "swiglu_limit",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_block_size": "index_block_size",
    "index_topk_blocks": "index_topk_blocks",
    "index_local_blocks": "index_local_blocks",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "initializer_range": "initializer_range",
}
# The checkpoint's `sparse_attention_config` keys, as HF's config maps them.
_LEGACY_SPARSE = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}
# HF's defaults for keys a config.json leaves out, where they differ from the checkpoint's.
_HF_MISSING = {"max_position_embeddings": 524288, "partial_rotary_factor": 1.0}


@dataclass(frozen=True)
class ModelArgs:
    """The text model of MiniMax M3. Defaults are the released checkpoint's (`from_hf` fills
    keys a config.json leaves out with HF's defaults instead)."""

    architecture: str = NAME
    vocab_size: int = 200064
    hidden_size: int = 6144
    num_layers: int = 60
    layer_types: tuple[str, ...] = ()  # () -> 3 full layers, then sparse
    mlp_layer_types: tuple[str, ...] = ()  # () -> 3 dense layers, then MoE
    num_attention_heads: int = 64
    num_kv_heads: int = 4
    head_dim: int = 128
    rope_theta: float = 5_000_000.0
    partial_rotary_factor: float = 0.5
    # MSA indexer.
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    # MLPs.
    num_experts: int = 128
    num_experts_per_tok: int = 4
    # expert parallelism: (first, count) of the routed experts this rank holds (the router
    # still scores all num_experts); None: all of them
    expert_range: tuple[int, int] | None = None
    # tensor parallelism: (first, count) of the vocabulary rows of the embedding and lm_head
    # this rank holds; None: all of them
    vocab_range: tuple[int, int] | None = None
    moe_intermediate_size: int = 3072
    dense_intermediate_size: int = 12288
    shared_intermediate_size: int = 3072
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Everything else.
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    eos_token_ids: tuple[int, ...] = (200020,)
    quantization: QuantConfig | None = None  # set for checkpoints stored quantised

    def __post_init__(self) -> None:
        first = min(3, self.num_layers)
        if not self.layer_types:
            types = (FULL_ATTENTION,) * first + (SPARSE_ATTENTION,) * (self.num_layers - first)
            object.__setattr__(self, "layer_types", types)
        if not self.mlp_layer_types:
            object.__setattr__(
                self, "mlp_layer_types", (DENSE,) * first + (MOE,) * (self.num_layers - first)
            )
        _validate(self)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelArgs:
        """Parse the dict of an HF `config.json` (`minimax_m3_vl` with `text_config`, or a
        bare `minimax_m3_vl_text`), legacy keys included. Raises ConfigError on unsupported
        or inconsistent configs."""
        text = raw.get("text_config", raw) if raw.get("model_type") == "minimax_m3_vl" else raw
        if not isinstance(text, dict):
            raise ConfigError("text_config must be a JSON object")
        try:
            values = _hf_values(cls, raw, text)
            return cls(**values, quantization=QuantConfig.from_checkpoint(raw))
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed config: {e}") from e

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    def sparse_settings(self) -> dict[str, int]:
        """What an MSA layer needs besides its attention shapes."""
        return {
            "index_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "block_size": self.index_block_size,
            "topk": self.index_topk_blocks,
            "local_blocks": self.index_local_blocks,
        }

    def replace(self, **changes: Any) -> ModelArgs:
        values = {f.name: getattr(self, f.name) for f in fields(self)} | changes
        if "num_layers" in changes:  # re-laid out unless given
            values["layer_types"] = changes.get("layer_types", ())
            values["mlp_layer_types"] = changes.get("mlp_layer_types", ())
        return ModelArgs(**values)

    def to_hf_text_config(self) -> dict[str, Any]:
        """The `text_config` of the released config.json (model_type `minimax_m3_vl_text`) in
        MiniMax's keys: `sparse_attention_config` (the indexer and which layers are sparse),
        `moe_layer_freq`, `rope_theta`, `partial_rotary_factor` and `rotary_dim` (HF reads
        the factor, mlx-lm and llama.cpp the dim), `scoring_func`, `n_shared_experts`."""
        flat = set(_LEGACY_SPARSE)
        text = {key: getattr(self, f) for f, key in _HF_TEXT_KEYS.items() if f not in flat}
        eos = self.eos_token_ids
        return text | {
            "model_type": "minimax_m3_vl_text",
            "hidden_act": "swigluoai",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
            "rotary_dim": self.rotary_dim,
            "sparse_attention_config": self.sparse_attention_config(),
            "moe_layer_freq": self.moe_layer_freq(),
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "n_shared_experts": 1,
            "qk_norm_type": "per_head",
            "use_gemma_norm": True,
            "eos_token_id": list(eos) if len(eos) > 1 else eos[0],
            "bos_token_id": 200034,
        }

    def sparse_attention_config(self) -> dict[str, Any]:
        """MiniMax's `sparse_attention_config`: the indexer's settings and, per layer, 1 for
        MiniMax Sparse Attention, 0 for full attention."""
        legacy = {key: getattr(self, f) for f, key in _LEGACY_SPARSE.items()}
        return legacy | {
            "sparse_init_block": 0,
            "sparse_score_type": "max",
            "sparse_attention_freq": [int(t == SPARSE_ATTENTION) for t in self.layer_types],
        }

    def moe_layer_freq(self) -> list[int]:
        """MiniMax's `moe_layer_freq`: per layer, 1 for the MoE, 0 for a dense MLP."""
        return [int(t == MOE) for t in self.mlp_layer_types]

    def to_hf_config(self) -> dict[str, Any]:
        """The released config.json (model_type `minimax_m3_vl`, text config nested), with
        `sparse_attention_config` and `moe_layer_freq` also at the top level, where
        llama.cpp's converter finds them (HF's config class drops them from the text
        config it keeps)."""
        text = self.to_hf_text_config()
        return {
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "model_type": "minimax_m3_vl",
            "text_config": text,
            "vision_config": {"model_type": "minimax_m3_vl_vision"},
            "image_token_index": 200025,
            "video_token_index": 200026,
            "tie_word_embeddings": self.tie_word_embeddings,
            "sparse_attention_config": text["sparse_attention_config"],
            "moe_layer_freq": text["moe_layer_freq"],
        }


def _hf_values(cls, raw: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    """ModelArgs keywords from an HF config's text part, as HF's config class reads it."""
    legacy = text.get("sparse_attention_config") or {}
    rope = text.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_type {rope['rope_type']!r} is not supported (expected 'default')")
    values: dict[str, Any] = dict(_HF_MISSING)
    for name, key in _HF_TEXT_KEYS.items():
        kind = type(getattr(cls, name))  # int, float or bool
        if key == "num_local_experts" and key not in text and "num_experts" in text:
            key = "num_experts"
        if key == "tie_word_embeddings" and key in raw:  # the top level wins, as in HF
            values[name] = bool(raw[key])
        elif key in text:
            values[name] = kind(text[key])
        if _LEGACY_SPARSE.get(name) in legacy:
            values[name] = kind(legacy[_LEGACY_SPARSE[name]])
    for key in ("rope_theta", "partial_rotary_factor"):  # top-level keys move into the block
        if key in rope or key in text:
            values[key] = float(rope.get(key, text.get(key)))
    layer_types, mlp_types = text.get("layer_types"), text.get("mlp_layer_types")
    if layer_types is None and "sparse_attention_freq" in legacy:
        layer_types = [
            SPARSE_ATTENTION if f else FULL_ATTENTION for f in legacy["sparse_attention_freq"]
        ]
    if mlp_types is None and text.get("moe_layer_freq") is not None:
        mlp_types = [MOE if f else DENSE for f in text["moe_layer_freq"]]
    n = values.get("num_layers", 60)
    values["layer_types"] = tuple(layer_types or (FULL_ATTENTION,) * n)  # HF's defaults
    values["mlp_layer_types"] = tuple(mlp_types or (MOE,) * n)
    eos = text.get("eos_token_id", raw.get("eos_token_id", 200020))
    eos = 200020 if eos is None or eos == [] else eos
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
        "index_n_heads",
        "index_head_dim",
        "index_block_size",
        "index_topk_blocks",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "dense_intermediate_size",
        "shared_intermediate_size",
        "max_position_embeddings",
    ]
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    for name, types, known in (
        ("layer_types", cfg.layer_types, LAYER_TYPES),
        ("mlp_layer_types", cfg.mlp_layer_types, MLP_LAYER_TYPES),
    ):
        if len(types) != cfg.num_layers:
            raise ConfigError(
                f"{name} has {len(types)} entries but num_hidden_layers is {cfg.num_layers}"
            )
        unknown = sorted(set(types) - set(known))
        if unknown:
            raise ConfigError(f"unknown {name} {unknown}; expected one of {list(known)}")
    if cfg.num_attention_heads % cfg.num_kv_heads:
        raise ConfigError(
            f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple "
            f"of num_key_value_heads ({cfg.num_kv_heads})"
        )
    if SPARSE_ATTENTION in cfg.layer_types and cfg.index_n_heads != cfg.num_kv_heads:
        raise ConfigError(
            f"index_n_heads ({cfg.index_n_heads}) must equal num_key_value_heads "
            f"({cfg.num_kv_heads}): one block selection per KV group"
        )
    bs = cfg.index_block_size
    if bs & (bs - 1):
        raise ConfigError(
            f"index_block_size must be a power of two (it is the cache page), got {bs}"
        )
    if cfg.index_local_blocks < 0:
        raise ConfigError(f"index_local_blocks must be >= 0, got {cfg.index_local_blocks}")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(
            f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds "
            f"num_local_experts ({cfg.num_experts})"
        )
    rotary = cfg.rotary_dim
    if not (0 < rotary <= cfg.head_dim) or rotary % 2:
        raise ConfigError(
            f"partial_rotary_factor {cfg.partial_rotary_factor} gives rotary dim "
            f"{rotary}; it must be even and in (0, head_dim={cfg.head_dim}]"
        )


def _mlp(cfg: ModelArgs, mlp_type: str) -> nn.Module:
    if mlp_type == DENSE:
        return DenseMLP(
            cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit
        )
    return SigmoidMoE(
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.shared_intermediate_size,
        cfg.routed_scaling_factor,
        cfg.swiglu_alpha,
        cfg.swiglu_limit,
        cfg.expert_range,
    )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArgs, layer_type: str, mlp_type: str):
        super().__init__()
        sparse = cfg.sparse_settings() if layer_type == SPARSE_ATTENTION else None
        self.self_attn = M3Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            sparse,
        )
        self.mlp = _mlp(cfg, mlp_type)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta: StepMetadata, cache):
        """x: the previous layer's MLP output (not yet added to the residual stream), or the
        embeddings with residual None. Returns (this layer's MLP output, the residual stream
        before it): each add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, cos, sin, meta, cache)
        # under tensor parallelism each rank's attention and MLP give partial sums
        residual, h = self.post_attention_layernorm.add(group.all_reduce(h), residual)
        return group.all_reduce(self.mlp(h)), residual


class MiniMaxM3Model(DecoderStack):
    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.config = cfg
        vocab = cfg.vocab_range[1] if cfg.vocab_range else cfg.vocab_size
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, t, m)
            for t, m in zip(cfg.layer_types, cfg.mlp_layer_types, strict=True)
        )
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        # Plain 1-D RoPE: every frequency takes the token's (text) position.
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, (cfg.rotary_dim // 2, 0, 0))
        self.requires_grad_(False)

    # Decode steps replay CUDA graphs (the MSA decode selection and attention read no host
    # values); prefill steps select each sequence's blocks with its context length read on
    # the host, so they run eagerly (ModelRunner reads both).
    prefill_graphs = False
    # HF 5.17's tower attends across all the images of a call (MiniMax's reference attends
    # within each): the engine encodes a prompt's media together to match it.
    joint_media = True
    # MSA's block selection and sparse attention have no batch-invariant form
    batch_invariant = False

    def cache_specs(self) -> list[CacheSpec | None]:
        """Paged K/V on every layer; sparse layers add the index keys (pages of one MSA block)."""
        return [layer.self_attn.cache_spec() for layer in self.layers]


# Checkpoint names -> parameter names.
_IGNORED = re.compile(
    r"^(model\.)?(mtp\.|vision_tower\.|multi_modal_projector\.|"
    r"patch_merge_mlp\.)"
)
# The original MiniMax spellings (what HF's VL conversion maps from) -> HF-native.
_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.mlp\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.self_attn\.index_(q|k)_(proj|norm)\."), r".self_attn.indexer.\1_\2."),
)
# The dense MLPs' (and shared experts') separate gate / up projections.
_GATE_UP = re.compile(
    r"^(layers\.\d+\.mlp(?:\.shared_experts)?)\.(gate_proj|up_proj)\."
    r"(weight|scales|biases|weight_scale_inv)$"
)


def checkpoint_name(name: str) -> str | None:
    """Map an HF-native or original MiniMax tensor name to our parameter name; None if
    ignored. `language_model.model.layers.3.block_sparse_moe.e_score_correction_bias` ->
    `layers.3.mlp.gate.e_score_correction_bias`. Pieces of fused tensors keep their form:
    see `expert_target`."""
    if _IGNORED.match(name):
        return None
    name = text_model_name(name)
    for pattern, target in _RENAMES:
        name = pattern.sub(target, name)
    return name


def expert_target(name: str) -> tuple[str, int | None, str, str] | None:
    """For a piece of a fused tensor (after `checkpoint_name`): (fused parameter, expert
    index or None for all experts / a 2-D dense gate_up, projection, kind in
    weight/scales/biases/weight_scale_inv)."""
    found = common.expert_target(name)
    if found is not None:
        return found
    m = _GATE_UP.match(name)
    if m:
        return f"{m.group(1)}.gate_up_proj.weight", None, m.group(2), m.group(3)
    return None


expert_slice = common.expert_slice
# M3's MLX layout is HF's (no conv, no shifted norms).
is_mlx_conv, from_mlx, to_mlx = common.is_mlx_conv, common.from_mlx, common.to_mlx

# Parameter names -> MiniMax's (the inverse of `_RENAMES`): the MoE block of a layer is
# `block_sparse_moe` (a dense layer's MLP stays `mlp`), the router's correction bias sits on
# the block, the indexer's projections and norms on the attention.
_RELEASE_RENAMES = (
    (re.compile(r"\.mlp\.(gate|experts|shared_experts)\."), r".block_sparse_moe.\1."),
    (re.compile(r"\.gate\.e_score_correction_bias$"), ".e_score_correction_bias"),
    (re.compile(r"\.self_attn\.indexer\.(q|k)_(proj|norm)\."), r".self_attn.index_\1_\2."),
)
# A dense MLP's or the shared expert's fused [gate | up] rows (weight, scales or biases).
_FUSED_GATE_UP = re.compile(r"^(.+)\.gate_up_proj\.(weight|scales|biases)$")
_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def release_tensors(
    param: str, tensor: torch.Tensor, mlx: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """How MiniMax M3's releases store a parameter, in MiniMax's names under
    `language_model.model.` (`language_model.lm_head.weight`): `block_sparse_moe.gate`,
    `block_sparse_moe.e_score_correction_bias`, `self_attn.index_{q,k}_{proj,norm}`, dense and
    shared-expert MLPs as separate `gate_proj` / `up_proj` / `down_proj`. Routed experts: one
    tensor per expert in the float release (`experts.E.{w1,w3,w2}.weight`: gate, up, down),
    stacked as `switch_mlp.{gate,up,down}_proj.*` in mlx-lm's layout (its names after
    `sanitize`)."""
    for pattern, target in _RELEASE_RENAMES:
        param = pattern.sub(target, param)
    m = _FUSED_GATE_UP.match(param)
    if m is not None:
        gate, up = tensor.chunk(2, dim=-2)
        pieces = [(f"{m.group(1)}.gate_proj.{m.group(2)}", gate)]
        pieces.append((f"{m.group(1)}.up_proj.{m.group(2)}", up))
    else:
        pieces = [(param, tensor)]
    experts = "switch_mlp" if mlx else "per_expert"
    for name, t in pieces:
        yield from common.lay_out(name, t, HF_PREFIX, "language_model.", experts, _EXPERT_NAMES)


def init(param: str) -> Init:
    """HF's init (zero-centred RMSNorms 0, the rest N(0, initializer_range)), except the
    router's correction bias: N(0, initializer_range) (HF: 0), so that it matters."""
    return Init.ZEROS if param.endswith("norm.weight") else Init.NORMAL


def shard_plan(cfg: ModelArgs, expert_parallel: bool) -> ShardPlan:
    """Attention heads with their index heads (one per KV group; the index key is
    replicated), the shared experts', dense MLPs' and (tensor parallel) every routed
    expert's intermediate columns, the vocabulary rows."""
    d = cfg.head_dim
    fields = ["num_attention_heads", "num_kv_heads", "index_n_heads"]
    fields += ["shared_intermediate_size", "dense_intermediate_size"]
    inputs = {
        "attention heads x head_dim": cfg.num_attention_heads * d,
        "shared_intermediate_size": cfg.shared_intermediate_size,
        "dense_intermediate_size": cfg.dense_intermediate_size,
    }
    if not expert_parallel:
        fields.append("moe_intermediate_size")
        inputs["moe_intermediate_size"] = cfg.moe_intermediate_size
    rules = [
        *vocab_rules(cfg.vocab_size),
        (r"\.self_attn\.indexer\.q_proj\.", rows(cfg.index_n_heads * cfg.index_head_dim)),
        (r"\.self_attn\.indexer\.", None),
        (r"\.self_attn\.q_proj\.", rows(cfg.num_attention_heads * d)),
        (r"\.self_attn\.(k_proj|v_proj)\.", rows(cfg.num_kv_heads * d)),
        (r"\.self_attn\.o_proj\.", cols(cfg.num_attention_heads * d)),
        *expert_rules(cfg.num_experts, cfg.moe_intermediate_size, expert_parallel),
        *gated_mlp_rules(r"\.mlp\.shared_experts", cfg.shared_intermediate_size),
        *gated_mlp_rules(r"\.mlp", cfg.dense_intermediate_size),  # the dense layers
    ]
    return ShardPlan(tuple(fields), inputs, tuple(rules))


PRESETS = {
    "minimax-m3": ModelArgs(),
    # 2 full + dense, 2 sparse + MoE layers; MSA blocks of 16 tokens, top-2 of them.
    "minimax-m3-tiny": ModelArgs(
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        layer_types=(FULL_ATTENTION, SPARSE_ATTENTION, SPARSE_ATTENTION, FULL_ATTENTION),
        mlp_layer_types=(DENSE, MOE, MOE, DENSE),
        index_n_heads=2,
        index_head_dim=32,
        index_block_size=16,
        index_topk_blocks=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        dense_intermediate_size=128,
        shared_intermediate_size=64,
    ),
}

Model = MiniMaxM3Model
