"""Configuration as data: frozen dataclasses parsed from a Hugging Face `config.json`.

Hot code receives values from these objects, never the objects themselves.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparrow.quant.affine import QuantSpec

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)

# model_type values this engine can run, mapped to the architecture that runs them.
SUPPORTED_MODEL_TYPES = {"qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe"}


class ConfigError(ValueError):
    """A config.json that is unknown, malformed or inconsistent."""


_MLX_PREFIX = re.compile(
    r"^(language_model\.model\.|language_model\.|model\.language_model\.|model\.)"
)


@dataclass(frozen=True)
class QuantConfig:
    """Which modules are quantised and how: a default spec plus per-module overrides.

    An override key matches a module path exactly or as a suffix (`mlp.gate` matches
    `layers.3.mlp.gate`); its value is the spec, or None to keep that module in float.
    """

    bits: int = 4
    group_size: int = 64
    overrides: tuple[tuple[str, QuantSpec | None], ...] = ()

    @classmethod
    def mlx_default(cls, bits: int = 4, group_size: int = 64) -> QuantConfig:
        """MLX's policy for this model: router and shared-expert gate at 8 bits."""
        eight = QuantSpec(8, group_size)
        return cls(bits, group_size, (("mlp.gate", eight), ("mlp.shared_expert_gate", eight)))

    @classmethod
    def from_name(cls, name: str | None) -> QuantConfig | None:
        """ "4bit" / "8bit" (the MLX policy at that width) or None (no quantisation)."""
        if name is None:
            return None
        if name not in ("4bit", "8bit"):
            raise ConfigError(f"unknown quantisation {name!r}; expected '4bit' or '8bit'")
        return cls.mlx_default(bits=int(name.removesuffix("bit")))

    def spec_for(self, path: str) -> QuantSpec | None:
        for key, spec in self.overrides:
            if path == key or path.endswith("." + key):
                return spec
        return QuantSpec(self.bits, self.group_size)

    @classmethod
    def from_mlx(cls, raw: dict[str, Any]) -> QuantConfig:
        """Parse an MLX `quantization` block (per-module entries keyed by module path)."""
        if raw.get("mode", "affine") != "affine":
            raise ConfigError(f"quantization mode {raw['mode']!r} is not supported (affine only)")
        try:
            bits, group = int(raw.get("bits", 4)), int(raw.get("group_size", 64))
            overrides = []
            for key, value in raw.items():
                if isinstance(value, dict):
                    spec = QuantSpec(
                        int(value.get("bits", bits)), int(value.get("group_size", group))
                    )
                    overrides.append((_MLX_PREFIX.sub("", key), spec))
                elif value is False:
                    overrides.append((_MLX_PREFIX.sub("", key), None))
            QuantSpec(bits, group)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"bad quantization block: {e}") from e
        return cls(bits, group, tuple(overrides))

    def to_mlx(self, module_paths: list[str]) -> dict[str, Any]:
        """The MLX `quantization` block, with an entry for each module that differs."""
        block: dict[str, Any] = {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}
        default = QuantSpec(self.bits, self.group_size)
        for path in module_paths:
            spec = self.spec_for(path)
            if spec != default:
                key = "language_model." + (path if path == "lm_head" else "model." + path)
                block[key] = (
                    False if spec is None else {"group_size": spec.group_size, "bits": spec.bits}
                )
        return block


# ModelConfig field -> key of the HF text_config holding it (scalars only).
_HF_TEXT_KEYS = {
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
_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


@dataclass(frozen=True)
class ModelConfig:
    """The text model of Qwen3.5/3.6 MoE (`qwen3_5_moe`). Defaults are Qwen3.6-35B-A3B."""

    architecture: str = "qwen3_5_moe"
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
    # Gated DeltaNet.
    linear_conv_kernel: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    # Mixture of experts.
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    # Everything else.
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    eos_token_ids: tuple[int, ...] = (248046,)
    quantization: QuantConfig | None = None  # set for checkpoints stored quantised

    def __post_init__(self) -> None:
        if not self.layer_types:
            # Default layout: every fourth layer is full attention (3, 7, 11, ...).
            types = tuple(
                FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION
                for i in range(self.num_layers)
            )
            object.__setattr__(self, "layer_types", types)
        _validate(self)

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

    def replace(self, **changes: Any) -> ModelConfig:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__} | changes
        if "num_layers" in changes and "layer_types" not in changes:
            values["layer_types"] = ()
        return ModelConfig(**values)

    def to_hf_text_config(self) -> dict[str, Any]:
        """The `text_config` dict of an HF `config.json` (model_type `qwen3_5_moe_text`)."""
        text = {key: getattr(self, f) for f, key in _HF_TEXT_KEYS.items()}
        return text | {
            "model_type": "qwen3_5_moe_text",
            "layer_types": list(self.layer_types),
            "full_attention_interval": 4,
            "hidden_act": "silu",
            "attention_bias": False,
            "attn_output_gate": True,
            "rope_parameters": {
                "rope_type": "default",
                **{key: getattr(self, key) for key in _ROPE_KEYS},
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            },
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


def _validate(cfg: ModelConfig) -> None:
    positive = [
        "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads",
        "head_dim", "linear_conv_kernel", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "shared_expert_intermediate_size", "max_position_embeddings",
    ]  # fmt: skip
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
    if sum(cfg.mrope_section) != rotary // 2:
        raise ConfigError(
            f"mrope_section {list(cfg.mrope_section)} must sum to rotary_dim/2 = {rotary // 2}"
        )


def _require(text: dict[str, Any], key: str, expected: Any) -> None:
    if key in text and text[key] != expected:
        raise ConfigError(f"{key}={text[key]!r} is not supported (expected {expected!r})")


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    """Parse the dict of an HF `config.json` (`qwen3_5_moe` with `text_config`, or a bare
    `qwen3_5_moe_text`) into a ModelConfig. Raises ConfigError on unknown or bad configs."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unknown model_type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    text = raw.get("text_config", raw) if model_type == "qwen3_5_moe" else raw
    if not isinstance(text, dict):
        raise ConfigError("text_config must be a JSON object")
    _require(text, "hidden_act", "silu")
    _require(text, "attention_bias", False)
    _require(text, "attn_output_gate", True)
    rope = text.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_type {rope['rope_type']!r} is not supported (expected 'default')")
    eos = text.get("eos_token_id", raw.get("eos_token_id", 248046))
    quant = raw.get("quantization") or raw.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError("quantization must be a JSON object")
    if quant is not None and "quant_method" in quant:
        raise ConfigError(
            f"quantization method {quant['quant_method']!r} is not supported "
            "(supported: MLX group-affine 4/8-bit)"
        )
    defaults = ModelConfig()
    values: dict[str, Any] = {}
    try:
        for field, key in _HF_TEXT_KEYS.items():
            if key in text or (key == "tie_word_embeddings" and key in raw):
                kind = type(getattr(defaults, field))  # int, float or bool
                values[field] = kind(text.get(key, raw.get(key)))
        for key in _ROPE_KEYS:
            if key in rope or key in text:
                values[key] = float(rope.get(key, text.get(key)))
        if "mrope_section" in rope:
            values["mrope_section"] = tuple(int(x) for x in rope["mrope_section"])
        return ModelConfig(
            **values,
            layer_types=tuple(text.get("layer_types") or ()),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
            quantization=QuantConfig.from_mlx(quant) if quant is not None else None,
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"malformed config: {e}") from e


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and parse `<model_dir>/config.json`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    try:
        return parse_hf_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
