"""The whole model through the Triton kernels (interpreter on CPU) equals the reference path:
varlen batched prefill, then batched decode steps."""

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


def _run(model, prompts, decode):
    batch = SequenceBatch(model, len(prompts), 128)
    with torch.no_grad():
        out = [model.logits(batch.forward(prompts))]
        for ids in decode:
            out.append(model.logits(batch.forward(ids[:, None])))
    return torch.cat(out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("one_kernel_decode", [False, True])  # + the MoE combine in the GEMV
def test_kernel_path_matches_reference(backend, device, one_kernel_decode, monkeypatch):
    variants = "gdn_one_kernel,moe_combine" if one_kernel_decode else ""
    monkeypatch.setenv("SPARROW_EXPERIMENTAL", variants)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_model(CFG, seed=3, device=device, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).to(device) for n in (37, 70, 1)]
    decode = [torch.randint(0, 256, (3,), generator=gen).to(device) for _ in range(4)]
    backend("reference")
    expected = _run(model, prompts, decode)
    backend("triton")
    assert rel_err(_run(model, prompts, decode), expected) < 1e-4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_decode_variants_match(backend, device, monkeypatch):
    """A 4-bit model's decode with the router GEMV routing (`moe_route`), the combine in
    the down GEMV (`moe_combine`) and the mixers' output projection + add + norm in one
    kernel (`add_norm`) gives the logits of the separate kernels (one sequence: the router
    logits come from the same row GEMV either way)."""
    from sparrow.config import QuantConfig

    model = random_model(CFG, seed=5, device=device, dtype=torch.float32,
                         quantize=QuantConfig.from_name("4bit"))  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (9,), generator=gen).to(device)]
    decode = [torch.randint(0, 256, (1,), generator=gen).to(device) for _ in range(3)]
    backend("triton")
    outs = []
    for variants in ("", "moe_route,moe_combine,add_norm"):
        monkeypatch.setenv("SPARROW_EXPERIMENTAL", variants)
        outs.append(_run(model, prompts, decode))
    assert rel_err(outs[1], outs[0]) < 1e-5
