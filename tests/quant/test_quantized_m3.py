"""MiniMax M3 in 4-bit: quantised on load (experts, attention, indexer, dense MLPs, shared
experts, embedding, lm_head; routers and norms in float), the quantised path equals the
float path on the dequantised weights, the MLX-layout checkpoint reads back the same, and the
Triton kernels (the fused 4-bit experts among them) equal the reference path."""

import pytest
import torch

from sparrow.config import QuantConfig
from sparrow.kernels.moe.experts import moe_experts_routed
from sparrow.layers.quantized import (
    QuantizedEmbedding,
    QuantizedExperts,
    QuantizedLinear,
    QuantizedOAIExperts,
)
from sparrow.loader.mlx_writer import save_mlx_checkpoint
from sparrow.loader.random_checkpoint import PRESETS, write_random_checkpoint
from sparrow.loader.weights import load_checkpoint
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err

CFG = PRESETS["minimax-m3-tiny"].replace(vocab_size=384, initializer_range=0.1)


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("m3-float")
    return write_random_checkpoint(
        path, CFG, seed=2, dtype=torch.float32, tokenizer=False, progress=False
    )


@pytest.fixture(scope="module")
def quantized(float_ckpt):
    return load_checkpoint(float_ckpt, quantize=QuantConfig.mlx_default(), progress=False)


def _logits(model, ids):
    return model.logits(SequenceBatch(model, 1, len(ids)).forward([ids]))


def _dequantized_float_model(float_ckpt, quantized):
    model = load_checkpoint(float_ckpt, progress=False)
    for path, module in quantized.named_modules():
        if isinstance(module, QuantizedLinear):
            model.get_submodule(path).weight.copy_(module.dequantized_weight(torch.float32))
        elif isinstance(module, QuantizedEmbedding):
            model.get_submodule(path).weight.copy_(module(torch.arange(CFG.vocab_size)))
        elif isinstance(module, QuantizedExperts):
            target = model.get_submodule(path)
            for e in range(CFG.num_experts):
                target.gate_up_proj[e], target.down_proj[e] = module.expert_weights(e)
    return model


def test_what_is_quantised(quantized):
    dense, sparse = quantized.layers[0], quantized.layers[1]
    assert isinstance(sparse.mlp.experts, QuantizedOAIExperts)
    assert sparse.mlp.experts.spec.bits == 4
    for m in (
        dense.mlp.gate_up_proj,
        dense.mlp.down_proj,
        sparse.mlp.shared_experts.gate_up_proj,
        sparse.self_attn.q_proj,
        sparse.self_attn.indexer.k_proj,
        quantized.lm_head,
    ):
        assert isinstance(m, QuantizedLinear) and m.spec.bits == 4
    assert isinstance(quantized.embed_tokens, QuantizedEmbedding)
    assert sparse.mlp.gate.weight.dtype == torch.float32  # the router stays float
    assert sparse.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert sparse.self_attn.indexer.q_norm.weight.dtype == torch.float32


def test_quantised_path_equals_float_path_on_dequantised_weights(float_ckpt, quantized):
    ids = torch.randint(0, CFG.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    expected = _logits(_dequantized_float_model(float_ckpt, quantized), ids.tolist())
    assert rel_err(_logits(quantized, ids.tolist()), expected) < 1e-5


def test_mlx_layout_round_trip(tmp_path, quantized):
    out = save_mlx_checkpoint(quantized, tmp_path / "mlx")
    again = load_checkpoint(out, progress=False)
    assert isinstance(again.layers[1].mlp.experts, QuantizedOAIExperts)
    ids = list(range(3, 60))
    assert rel_err(_logits(again, ids), _logits(quantized, ids)) == 0.0


@torch.no_grad()
def test_kernel_path_matches_reference(tmp_path, monkeypatch):
    """A 2-layer M3 (dense, then MoE) in 4 bits through every Triton kernel (the interpreter
    on a CPU) equals the reference path: a 50-token prefill (the experts' grouped GEMMs),
    then one decode step (the expert GEMVs). Full attention in both layers: the interpreted
    MSA kernels would double the time and are tested on their own (tests/kernels/msa)."""
    import sparrow.layers.quantized as quantized
    from sparrow.kernels import get_backend, set_backend

    cfg = CFG.replace(
        num_layers=2,
        layer_types=("full_attention", "full_attention"),
        mlp_layer_types=("dense", "sparse"),
    )
    ckpt = write_random_checkpoint(
        tmp_path, cfg, seed=3, dtype=torch.float32, tokenizer=False, progress=False
    )
    model = load_checkpoint(ckpt, quantize=QuantConfig.mlx_default(), progress=False)
    assert isinstance(model.layers[1].mlp.experts, QuantizedOAIExperts)
    ids = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(4))
    fused = []  # the tokens of each call of the fused experts

    def spy(x, *args):
        fused.append(len(x))
        return moe_experts_routed(x, *args)

    monkeypatch.setattr(quantized, "moe_experts_routed", spy)

    def run(backend):
        set_backend(backend)
        batch = SequenceBatch(model, 1, 64)
        return torch.cat(
            [model.logits(batch.forward([ids.tolist()])), model.logits(batch.forward([[7]]))]
        )

    previous = get_backend()
    try:
        expected = run("reference")
        got = run("triton")
    finally:
        set_backend(previous)
    assert fused == [50, 1] and rel_err(got, expected) < 1e-4
