"""What the engine, worker, loader, server, media pipeline and tensor parallelism ask of a
model, as code: `Architecture` (the module a model file is), `ModelArgs` (its parsed
config.json) and `Model` (its `nn.Module`), with `Speaks` (the text and media formats its
checkpoints speak) and `Init` (how its random weights are drawn).

A new architecture is one file in `models/` that satisfies `Architecture`, plus its line in
the registry (`models/__init__.py`); `tests/models/test_architectures.py` checks every
registered module against these protocols. Nothing outside `models/` branches on a family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from sparrow.config import QuantConfig
    from sparrow.core.cache_spec import CacheSpec
    from sparrow.distributed.shard import ShardPlan
    from sparrow.layers.metadata import StepMetadata
    from sparrow.multimodal.specs import ImageSpec
    from sparrow.multimodal.video import VideoSpec


class Init(Enum):
    """How a random checkpoint draws one parameter (HF's `_init_weights` of the family)."""

    NORMAL = "normal"  # N(0, initializer_range)
    ZEROS = "zeros"  # zero-centred RMSNorm weights (effective scale 1 + w)
    ONES = "ones"  # plain RMSNorm weights, Gated DeltaNet dt_bias
    LOG_UNIFORM = "log_uniform"  # Gated DeltaNet A_log = log U(0.01, 16)


@dataclass(frozen=True)
class TokenizerLayout:
    """The tokenizer files a random checkpoint of the family carries (ids and markers, not
    the real merges): the packaged Qwen vocabulary below `vocab_limit`, `special_tokens` at
    their ids (None: Qwen's own), and `config` for tokenizer_config.json (the chat template
    is `chat_template`, a name in `sparrow.chat_templates.TEMPLATES`)."""

    config: dict[str, Any]
    chat_template: str = "chatml"
    vocab_limit: int | None = None
    special_tokens: dict[str, int] | None = None


@dataclass(frozen=True)
class MediaFormat:
    """How the family's checkpoints see images and videos: the preprocessing specs
    (`multimodal.specs` / `multimodal.video` constants, overridden by a checkpoint's
    preprocessor configs) and whether an image's replacement carries its own start/end
    tokens (`wrap_images`)."""

    image: ImageSpec
    video: VideoSpec
    wrap_images: bool = False


@dataclass(frozen=True)
class Speaks:
    """What the family's checkpoints speak besides their weights."""

    # tokens that end a turn besides the config's eos ids (looked up in the tokenizer)
    stop_tokens: tuple[str, ...] = ()
    tool_parser: str | None = None  # a name in server.tool_parsers.PARSERS
    reasoning_parser: str | None = None  # a name in server.reasoning.PARSERS
    tokenizer: TokenizerLayout = field(default_factory=lambda: TokenizerLayout({}))
    media: MediaFormat | None = None  # None: text only


@runtime_checkable
class ModelArgs(Protocol):
    """A frozen dataclass parsed from an HF config.json (`from_hf`), written back by
    `to_hf_config` as the family's released checkpoint lays its config.json out. Fields every
    architecture has, whatever else it adds."""

    architecture: str  # the registry name of its module
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_experts: int
    moe_intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float
    eos_token_ids: tuple[int, ...]
    quantization: QuantConfig | None
    expert_range: tuple[int, int] | None  # expert parallelism: (first, count) held here
    vocab_range: tuple[int, int] | None  # tensor parallelism: (first, count) of the vocab

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelArgs: ...

    def to_hf_config(self) -> dict[str, Any]: ...

    def replace(self, **changes: Any) -> ModelArgs: ...

    @property
    def max_context(self) -> int:
        """Positions the model takes (past max_position_embeddings where rope scaling
        reaches further)."""
        ...


@runtime_checkable
class Model(Protocol):
    """The `nn.Module` of an architecture (`layers.decoder.DecoderStack` implements all but
    `cache_specs` and the class flags)."""

    config: ModelArgs
    # The vision tower (attached on load when the checkpoint has one), else None.
    visual: torch.nn.Module | None
    uses_mrope: ClassVar[bool]  # rotary positions are (t, h, w) around media
    joint_media: ClassVar[bool]  # the tower attends across all of a prompt's media
    media_merge: ClassVar[int]  # patches merged per placeholder token, per side
    cuda_graphs: ClassVar[bool]  # decode steps may replay CUDA graphs
    batch_invariant: ClassVar[bool]  # steps may run batch-invariant (`kernels.batch_invariant`)

    @property
    def prefill_graphs(self) -> bool:
        """Whether one-prompt prefills may replay CUDA graphs."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def forward(self, meta: StepMetadata, cache: Any) -> torch.Tensor:
        """The step's new tokens -> final-norm hidden states [T, hidden]."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""
        ...

    def embed_media(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """Patches of images and videos -> their placeholder embeddings."""
        ...

    def cache_specs(self) -> list[CacheSpec | None]:
        """What each layer keeps between steps (None: nothing)."""
        ...


@runtime_checkable
class Architecture(Protocol):
    """A model file as a module: its config, model, presets, weight names, MLX layout hooks,
    release layout, formats and tensor-parallel plan."""

    NAME: str  # the registry key; equals ModelArgs.architecture
    MODEL_TYPES: tuple[str, ...]  # the HF model_type values it runs
    HF_PREFIX: str  # where the family's released checkpoints keep the text model ("model.")
    ModelArgs: type
    Model: type
    PRESETS: dict[str, Any]  # `sparrow checkpoint random --preset` name -> ModelArgs
    SPEAKS: Speaks
    # An HF or MLX checkpoint tensor name -> parameter name (None: not the text model's).
    checkpoint_name: Callable[[str], str | None]
    # A piece of a fused tensor -> (fused parameter, expert or None, projection, kind).
    expert_target: Callable[[str], tuple[str, int | None, str, str] | None]
    # Rows of a fused [.., 2I, hidden] gate_up tensor one projection fills.
    expert_slice: Callable[[str, int], slice]
    # MLX layout: whether a tensor needs `from_mlx`'s transpose; the changes both ways.
    is_mlx_conv: Callable[[str, tuple[int, ...]], bool]
    from_mlx: Callable[[str, torch.Tensor], torch.Tensor]
    to_mlx: Callable[[str, torch.Tensor], torch.Tensor]
    # How the family's releases store a parameter (or a quantised one's packed words, scales
    # or biases): (name, tensor) pairs as the float release has them (mlx False) or as
    # mlx-lm's MLX layout has them (mlx True), for the writers in `loader/`.
    release_tensors: Callable[[str, torch.Tensor, bool], Iterator[tuple[str, torch.Tensor]]]
    # How random weights draw a parameter.
    init: Callable[[str], Init]
    # How a tensor- (or expert-) parallel rank splits the model (`distributed.shard`).
    shard_plan: Callable[[Any, bool], ShardPlan]
