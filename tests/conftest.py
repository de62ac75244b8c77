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


@pytest.fixture(scope="module")
def hf_gdn_in_pytorch():
    """HF's GDN functions as written in PyTorch: where flash-linear-attention is importable
    HF runs its Triton kernels instead (TF32 dots on fp32 inputs), no longer an fp32 oracle
    (rel. errors of 2e-2..2e-1 on the H200 with fla 0.6.0 installed). Use it with
    `pytestmark = pytest.mark.usefixtures("hf_gdn_in_pytorch")`."""
    import inspect

    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
             "causal_conv1d_fn", "causal_conv1d_update")  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        for name in names:
            mp.setattr(modeling_qwen3_5_moe, name,
                       inspect.unwrap(getattr(modeling_qwen3_5_moe, name)))  # fmt: skip
        yield
