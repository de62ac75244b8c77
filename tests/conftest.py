import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


# Without a GPU, Triton kernels run on CPU tensors under the interpreter (how CI tests them).
# Triton reads the variable when a kernel is defined, so it is set before tests import them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
