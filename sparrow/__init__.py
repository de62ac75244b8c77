"""Sparrow: an inference engine for sparse open-weight LLMs."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `sparrow.LLM` without importing torch for `import sparrow`.
    if name == "LLM":
        from sparrow.llm import LLM

        return LLM
    raise AttributeError(name)
