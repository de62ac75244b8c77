"""The whole model through the Triton kernels (interpreter on CPU) equals the reference path:
varlen batched prefill, then batched decode steps; on the GPU also with bf16 recurrent
state, which both paths round the same way (to nearest) when they store it."""

import pytest
import torch

from sparrow.kernels import get_backend, set_backend
from sparrow.loader.random_checkpoint import PRESETS, random_model
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err

CFG = PRESETS["qwen3.6-tiny"].replace(vocab_size=256, initializer_range=0.1)


@pytest.fixture
def backend():
    previous = get_backend()
    yield set_backend
    set_backend(previous)


def _run(model, prompts, decode, state_dtype="float32"):
    batch = SequenceBatch(model, len(prompts), 128, state_dtype=state_dtype)
    with torch.no_grad():
        out = [model.logits(batch.forward(prompts))]
        for ids in decode:
            out.append(model.logits(batch.forward(ids[:, None])))
    return torch.cat(out)


@pytest.mark.parametrize(
    "device, state_dtype, tol",
    [
        ("cpu", "float32", 1e-4),
        pytest.param("cuda", "float32", 1e-4, marks=pytest.mark.gpu),
        pytest.param("cuda", "bfloat16", 1e-3, marks=pytest.mark.gpu),
    ],
)
def test_kernel_path_matches_reference(backend, device, state_dtype, tol):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_model(CFG, seed=3, device=device, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).to(device) for n in (37, 70, 1)]
    decode = [torch.randint(0, 256, (3,), generator=gen).to(device) for _ in range(4)]
    backend("reference")
    expected = _run(model, prompts, decode, state_dtype)
    backend("triton")
    assert rel_err(_run(model, prompts, decode, state_dtype), expected) < tol
