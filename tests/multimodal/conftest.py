"""Fixtures for the multimodal tests: the HF processors, run by hf_oracle in a side process."""

import hf_oracle
import pytest


@pytest.fixture(scope="session")
def hf_oracle_run():
    """hf_oracle.Oracle: HF's pixel values, grid_thw and patch count; skips without torchvision."""
    if not (hf_oracle.SITE / "torchvision").is_dir():
        pytest.skip(f"oracle torchvision not found under {hf_oracle.SITE}")
    oracle = hf_oracle.Oracle()
    yield oracle
    oracle.close()
