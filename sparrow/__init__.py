"""Sparrow: an inference engine for sparse open-weight LLMs.

`from sparrow import LLM, SamplingParams` is the offline entry point; importing `sparrow`
alone does not import torch.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("sparrow.engine.llm", "LLM"),
    "SamplingParams": ("sparrow.core.sampling_params", "SamplingParams"),
}

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'sparrow' has no attribute {name!r}")
