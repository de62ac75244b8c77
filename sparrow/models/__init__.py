"""Model architectures, keyed by the `architecture` of a parsed ModelConfig.

Each architecture module exports `Model`, its weight-name mapping (`checkpoint_name`,
`expert_target`, `expert_slice`, MLX layout hooks); `Model.cache_spec()` says what it caches.
"""

from types import ModuleType

from sparrow.models import qwen3_5_moe

ARCHITECTURES: dict[str, ModuleType] = {"qwen3_5_moe": qwen3_5_moe}


def get_architecture(name: str) -> ModuleType:
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]
