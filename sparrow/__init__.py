"""Sparrow: an inference engine for sparse open-weight LLMs."""

__version__ = "0.1.0"
