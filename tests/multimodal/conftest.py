"""Fixtures for the multimodal tests: the HF processors built by hf_oracle."""

import hf_oracle
import pytest


@pytest.fixture(scope="session")
def hf_processors():
    """{"qwen": Qwen2VLImageProcessor, "m3": MiniMaxM3VLImageProcessor}; skips without them."""
    return hf_oracle.hf_processors()
