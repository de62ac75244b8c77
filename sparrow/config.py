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
from sparrow.quant.fp8 import Fp8Spec


class ConfigError(ValueError):
    """A config.json that is unknown, malformed or inconsistent."""


_MLX_PREFIX = re.compile(
    r"^(language_model\.model\.|language_model\.|model\.language_model\.|model\.)"
)


@dataclass(frozen=True)
class QuantConfig:
    """Which modules are quantised and how: a default spec plus per-module overrides.

    An override key matches a module path exactly or as a suffix (`mlp.gate` matches
    `layers.3.mlp.gate`); its value is the spec (group-affine `QuantSpec` or FP8 blocks
    `Fp8Spec`), or None to keep that module in float. The default is group-affine at `bits`
    in groups of `group_size`, or FP8 blocks where `fp8` is set. `method`: the format a
    checkpoint's config.json declares ("mlx": MLX's `quantization` block; "fp8": HF's
    `quant_method: fp8`; "compressed-tensors"), which the loader reads it by.
    """

    bits: int = 4
    group_size: int = 64
    overrides: tuple[tuple[str, QuantSpec | Fp8Spec | None], ...] = ()
    fp8: Fp8Spec | None = None
    method: str = "mlx"

    @classmethod
    def mlx_default(cls, bits: int = 4, group_size: int = 64) -> QuantConfig:
        """MLX's policy for this model: router and shared-expert gate at 8 bits."""
        eight = QuantSpec(8, group_size)
        return cls(bits, group_size, (("mlp.gate", eight), ("mlp.shared_expert_gate", eight)))

    @classmethod
    def fp8_default(cls, block: tuple[int, int] = (128, 128)) -> QuantConfig:
        """HF's FP8 block format (`quant.fp8`) as Qwen3.6's FP8 release applies it: every
        linear layer and the routed experts; the embedding, lm_head, routers, the shared
        expert's gate and Gated DeltaNet's a / b projections stay float, and so do matrices
        that do not fill whole blocks (as HF's FP8 quantiser leaves them)."""
        keep = (
            "embed_tokens",
            "lm_head",
            "mlp.gate",
            "mlp.shared_expert_gate",
            "linear_attn.in_proj_a",
            "linear_attn.in_proj_b",
            "linear_attn.in_proj_ba",
        )
        return cls(overrides=tuple((k, None) for k in keep), fp8=Fp8Spec(*block), method="fp8")

    @classmethod
    def from_name(cls, name: str | None) -> QuantConfig | None:
        """ "4bit" / "8bit" (the MLX policy at that width), "fp8" (`fp8_default`) or None (no
        quantisation)."""
        if name is None:
            return None
        if name == "fp8":
            return cls.fp8_default()
        if name not in ("4bit", "8bit"):
            raise ConfigError(f"unknown quantisation {name!r}; expected '4bit', '8bit' or 'fp8'")
        return cls.mlx_default(bits=int(name.removesuffix("bit")))

    @classmethod
    def from_checkpoint(cls, raw: dict[str, Any]) -> QuantConfig | None:
        """The quantisation a checkpoint's config.json declares: MLX's `quantization` block,
        HF's `quant_method` "fp8" (`from_hf_fp8`) or "compressed-tensors" (read by
        `loader.compressed_tensors`); None for a float checkpoint. ConfigError for other
        methods."""
        quant = raw.get("quantization") or raw.get("quantization_config")
        if quant is None:
            return None
        if not isinstance(quant, dict):
            raise ConfigError("quantization must be a JSON object")
        method = quant.get("quant_method")
        if method == "fp8":
            return cls.from_hf_fp8(quant)
        if method == "compressed-tensors":
            return cls(method="compressed-tensors")
        if method is not None:
            raise ConfigError(
                f"quantization method {method!r} is not supported (supported: MLX "
                "group-affine 4/8-bit, 'fp8' block-scaled, 'compressed-tensors' "
                "pack-quantized int4/int8 and float-quantized FP8)"
            )
        return cls.from_mlx(quant)

    @classmethod
    def from_hf_fp8(cls, raw: dict[str, Any]) -> QuantConfig:
        """HF's `quant_method: "fp8"` block (`fmt` e4m3, `weight_block_size`, float32 or bf16
        `weight_scale_inv`): which modules are FP8 the loader reads from the tensors, as HF
        writes them (`modules_to_not_convert` and matrices that do not fill whole blocks
        stay float)."""
        fmt = raw.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ConfigError(f"fp8 fmt {fmt!r} is not supported (e4m3 only)")
        if raw.get("scale_fmt", "float") != "float":
            raise ConfigError(f"fp8 scale_fmt {raw['scale_fmt']!r} is not supported (float only)")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"fp8 activation_scheme {raw['activation_scheme']!r} is not supported "
                "(dynamic only: weights FP8, activations as they come)"
            )
        block = raw.get("weight_block_size")
        try:
            spec = Fp8Spec(*(int(b) for b in block)) if block is not None else Fp8Spec(None, None)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"fp8 weight_block_size {block!r}: expected [rows, cols]") from e
        return cls(fp8=spec, method="fp8")

    def spec_for(self, path: str) -> QuantSpec | Fp8Spec | None:
        for key, spec in self.overrides:
            if path == key or path.endswith("." + key):
                return spec
        return self.fp8 or QuantSpec(self.bits, self.group_size)

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
    `enforce_eager`: never replay decode steps from captured CUDA graphs. `batch_invariant`
    (CPU only): a sequence's logits are the same bits whatever else its steps hold, however
    its prompt is split into chunks, and whether a token was decoded or recomputed as part of
    a prompt (`kernels.batch_invariant`; as vLLM's VLLM_BATCH_INVARIANT), at the cost of
    running recurrent layers one token at a time."""

    device: str = "auto"
    dtype: str = "auto"
    enforce_eager: bool = False
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: expected one of {list(DTYPES)}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device {self.device!r}: expected auto, cpu, cuda or cuda:N")
        if self.batch_invariant and self.device.startswith("cuda"):
            raise ConfigError("batch_invariant runs on the CPU: set device='cpu'")


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
        `gpu_memory_utilization=`, `dtype=`, `quantization="fp8"` or "4bit" / "8bit", also
        as `quantize=`, ...) sorted into the sub-configs. Unknown keywords raise ConfigError."""
        top = {f.name for f in fields(cls)} - set(_SECTIONS)
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        values: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key == "quantize" or (key == "quantization" and not isinstance(value, QuantConfig)):
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
