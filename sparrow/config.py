"""Engine settings as data: frozen dataclasses, one per concern, composed into `EngineConfig`
and validated in `__post_init__`.

What a checkpoint's architecture is (`ModelArgs`) lives with the architecture in
`sparrow/models/`; this module holds what the engine is asked to do with it. Hot code
receives values from these objects, never the objects themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from sparrow.quant.affine import QuantSpec


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

    @classmethod
    def from_checkpoint(cls, raw: dict[str, Any]) -> QuantConfig | None:
        """The quantisation a checkpoint's config.json declares (MLX's `quantization` block),
        None for a float checkpoint; ConfigError for methods other than group-affine."""
        quant = raw.get("quantization") or raw.get("quantization_config")
        if quant is None:
            return None
        if not isinstance(quant, dict):
            raise ConfigError("quantization must be a JSON object")
        if "quant_method" in quant:
            raise ConfigError(
                f"quantization method {quant['quant_method']!r} is not supported "
                "(supported: MLX group-affine 4/8-bit)"
            )
        return cls.from_mlx(quant)

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


DTYPES = ("auto", "bfloat16", "float16", "float32")
INDEX_CACHE_DTYPES = ("auto", "fp8_e4m3")
RECURRENT_STATE_DTYPES = ("float32", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work a step takes. `max_model_len` None: the model's own context length."""

    # token budget per step: longer prompts prefill in chunks of this many tokens. 16,384
    # against 8,192 on the H200 (full-size Qwen3.6 4-bit, batch 1): 16K tokens 61,519 against
    # 57,527 tok/s, 64K 43,443 against 41,753; a step that prefills a chunk holds the
    # running decodes for its duration (~270 ms at 16K), so a server that values inter-token
    # latency over prefill speed sets less
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 64  # running requests at most
    max_model_len: int | None = None  # prompt + output tokens per request

    def __post_init__(self) -> None:
        _positive(self, "max_num_batched_tokens", "max_num_seqs", "max_model_len")


@dataclass(frozen=True)
class CacheConfig:
    """The cache's geometry. `block_size` None: the model's MSA block if it has one, else 128
    (a model with MSA layers takes no other). `num_blocks` None: as many blocks as fit in
    `gpu_memory_utilization` of the device memory left after the weights (8K tokens' worth on
    a CPU). `num_state_slots` None: one per sequence the scheduler may run.
    `enable_prefix_caching`: full KV blocks are kept by content and reused by requests that
    share their prefix. `num_state_snapshots`: saved recurrent states a shared prefix resumes
    from (models with recurrent layers; None: one per sequence the scheduler may run, 0 with
    prefix caching off). `index_cache_dtype`: how MSA layers keep their index keys, "auto" in
    the activation dtype, "fp8_e4m3" as e4m3 codes with an fp32 scale per token (about half
    the bytes decode's block selection reads; models without MSA layers take "auto" only).
    `recurrent_state_dtype`: how recurrent (Gated DeltaNet) layers keep their state between
    steps, "float32" (as HF) or "bfloat16" (half the bytes a decode step reads and writes
    for it; the kernels update it in fp32 and round it when they store it; models without
    recurrent layers take "float32" only)."""

    block_size: int | None = None  # tokens per KV block
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    num_state_slots: int | None = None  # per-request slots (recurrent state, next token)
    enable_prefix_caching: bool = True
    num_state_snapshots: int | None = None
    index_cache_dtype: str = "auto"
    recurrent_state_dtype: str = "float32"

    def __post_init__(self) -> None:
        _positive(self, "block_size", "num_blocks", "num_state_slots")
        if self.index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise ConfigError(
                f"index_cache_dtype {self.index_cache_dtype!r}: expected one of "
                f"{list(INDEX_CACHE_DTYPES)}"
            )
        if self.recurrent_state_dtype not in RECURRENT_STATE_DTYPES:
            raise ConfigError(
                f"recurrent_state_dtype {self.recurrent_state_dtype!r}: expected one of "
                f"{list(RECURRENT_STATE_DTYPES)}"
            )
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ConfigError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """`tensor_parallel_size` processes per engine (`sparrow.distributed`), each with a share
    of every layer; `enable_expert_parallel`: the routed experts are shared out whole among
    them (as vLLM's flag) instead of by their intermediate columns."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        _positive(self, "tensor_parallel_size")


@dataclass(frozen=True)
class DeviceConfig:
    """Where and in what precision. "auto": CUDA if present, bfloat16 there, float32 on a CPU.
    `enforce_eager`: never replay decode steps from captured CUDA graphs."""

    device: str = "auto"
    dtype: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: expected one of {list(DTYPES)}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device {self.device!r}: expected auto, cpu, cuda or cuda:N")


# EngineConfig.from_kwargs: flat keyword -> the sub-config holding it.
_SECTIONS = {
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is asked to do: which checkpoint (a directory, a Hugging Face
    Hub id `owner/name` at `revision` kept in `download_dir` or the Hub's cache, or None:
    the built-in default), how to load it (`load_format` "dummy": its config.json with
    random weights), on-load quantisation, and the scheduler, cache, parallel and device
    settings."""

    model: str | None = None
    revision: str | None = None  # a Hub id's branch, tag or commit; None: main
    download_dir: str | None = None  # Hub snapshots; None: HF_HUB_CACHE / HF_HOME
    load_format: str = "auto"
    quantization: QuantConfig | None = None  # quantise a float checkpoint on load
    seed: int = 0  # random weights of load_format "dummy"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format {self.load_format!r}: expected one of {list(LOAD_FORMATS)}"
            )
        for name in ("model", "download_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, str(getattr(self, name)))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Flat keywords as vLLM takes them (`max_model_len=`, `enforce_eager=`,
        `gpu_memory_utilization=`, `dtype=`, `quantize="4bit"`, ...) sorted into the
        sub-configs. Unknown keywords raise ConfigError."""
        top = {f.name for f in fields(cls)} - set(_SECTIONS)
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        values: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key == "quantize":
                values["quantization"] = QuantConfig.from_name(value)
                continue
            if key in top:
                values[key] = value
                continue
            owner = next(
                (n for n, c in _SECTIONS.items() if key in {f.name for f in fields(c)}), None
            )
            if owner is None:
                raise ConfigError(f"unknown engine setting {key!r}")
            sections[owner][key] = value
        return cls(**values, **{n: c(**sections[n]) for n, c in _SECTIONS.items()})
