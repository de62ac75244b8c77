"""Quantise-on-load, the quantised reference path, and MLX-layout checkpoints."""

import json

import pytest
import torch
from safetensors import safe_open

from sparrow.config import QuantConfig
from sparrow.kernels.quant_gemv.gdn import quant_gemv_conv
from sparrow.layers.quantized import QuantizedEmbedding, QuantizedExperts, QuantizedLinear
from sparrow.loader.mlx_writer import save_mlx_checkpoint
from sparrow.loader.random_checkpoint import PRESETS, write_random_checkpoint
from sparrow.loader.weights import CheckpointError, load_checkpoint
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err

CFG = PRESETS["qwen3.6-tiny"].replace(vocab_size=512)
DECODE_STEPS = 2  # through the kernels under the interpreter: ~10 s a step on 2 cores


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    return write_random_checkpoint(
        path, CFG, seed=5, dtype=torch.float32, tokenizer=False, progress=False
    )


@pytest.fixture(scope="module")
def quantized(float_ckpt):
    return load_checkpoint(float_ckpt, quantize=QuantConfig.mlx_default(), progress=False)


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(SequenceBatch(model, 1, len(ids)).forward([ids]))


def _dequantized_float_model(float_ckpt, quantized):
    """The float model whose weights are exactly the quantised model's dequantised weights."""
    model = load_checkpoint(float_ckpt, progress=False)
    for path, module in quantized.named_modules():
        if isinstance(module, QuantizedLinear):
            model.get_submodule(path).weight.copy_(module.dequantized_weight(torch.float32))
        elif isinstance(module, QuantizedEmbedding):
            model.get_submodule(path).weight.copy_(module(torch.arange(CFG.vocab_size)))
        elif isinstance(module, QuantizedExperts):
            target = model.get_submodule(path)
            for e in range(CFG.num_experts):
                gate_up, down = module.expert_weights(e)
                target.gate_up_proj[e], target.down_proj[e] = gate_up, down
    return model


def test_quantised_modules_follow_the_mlx_policy(quantized):
    layer = quantized.layers[0]
    assert isinstance(layer.mlp.experts, QuantizedExperts) and layer.mlp.experts.spec.bits == 4
    assert layer.mlp.gate.spec.bits == 8 and layer.mlp.shared_expert_gate.spec.bits == 8
    assert isinstance(quantized.embed_tokens, QuantizedEmbedding)
    assert isinstance(quantized.lm_head, QuantizedLinear)
    assert layer.linear_attn.conv1d.weight.dtype == torch.float32  # stays float
    assert layer.mlp.experts.gate_up_proj.dtype == torch.int32


def test_quantised_path_equals_float_path_on_dequantised_weights(float_ckpt, quantized):
    ids = torch.randint(0, CFG.vocab_size, (45,), generator=torch.Generator().manual_seed(0))
    expected = _logits(_dequantized_float_model(float_ckpt, quantized), ids)
    assert rel_err(_logits(quantized, ids), expected) < 1e-5


def test_mlx_layout_round_trip(tmp_path, float_ckpt, quantized):
    out = save_mlx_checkpoint(quantized, tmp_path / "mlx", shard_bytes=256 << 10)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["language_model.model.layers.2.mlp.gate"]["bits"] == 8
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.layers.1.mlp.switch_mlp.up_proj.scales" in index
    assert "language_model.lm_head.biases" in index

    def read(name):
        with safe_open(str(out / index[name]), "pt") as f:
            return f.get_tensor(name)

    assert read("language_model.model.layers.0.linear_attn.conv1d.weight").shape == (
        CFG.linear_conv_dim,
        4,
        1,
    )
    norm = read("language_model.model.layers.0.input_layernorm.weight")
    assert torch.equal(norm, torch.ones_like(norm))  # zero-init w is stored as 1 + w
    assert read("language_model.model.layers.0.mlp.switch_mlp.down_proj.weight").dtype == (
        torch.uint32
    )

    reloaded = load_checkpoint(out, progress=False)
    assert reloaded.config.quantization is not None
    for name, t in quantized.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], t), name


def test_float_mlx_layout_loads(tmp_path, float_ckpt):
    model = load_checkpoint(float_ckpt, progress=False)
    out = save_mlx_checkpoint(model, tmp_path / "mlx-float")
    ids = torch.arange(30)
    assert torch.equal(_logits(load_checkpoint(out, progress=False), ids), _logits(model, ids))


def test_quantised_checkpoint_with_missing_scales(tmp_path, quantized):
    out = save_mlx_checkpoint(quantized, tmp_path / "broken")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    del tensors["language_model.model.layers.1.mlp.switch_mlp.up_proj.scales"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"layers\.1\.mlp\.experts\.gate_up_proj_scales "
        r"\(expert 0, up_proj",
    ):
        load_checkpoint(out, progress=False)


def test_4bit_error_is_measured(float_ckpt, quantized):
    """Not a bound on quality: random Gaussian weights are the worst case for 4 bits. The
    figure is recorded in docs/PERF.md; this guards against it silently getting worse."""
    ids = torch.randint(0, CFG.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    reference = _logits(load_checkpoint(float_ckpt, progress=False), ids)
    assert rel_err(_logits(quantized, ids), reference) < 0.35


def test_decode_with_triton_gemv_matches_reference(quantized):
    """The same greedy decode through the fused GEMV kernels (interpreter on CPU). The
    prompt takes the reference path either way: only the decode steps differ."""
    from sparrow.kernels import get_backend, set_backend

    prompt = torch.arange(20)

    def run(backend):
        set_backend("reference")
        batch = SequenceBatch(quantized, 1, 32)
        with torch.no_grad():
            logits = [quantized.logits(batch.forward([prompt]))[-1]]
            set_backend(backend)
            for _ in range(DECODE_STEPS):
                tok = logits[-1].argmax()[None]
                logits.append(quantized.logits(batch.forward([tok]))[0])
        return torch.stack(logits)

    previous = get_backend()
    try:
        assert rel_err(run("triton"), run("reference")) < 1e-4
    finally:
        set_backend(previous)


def test_one_token_decode_with_gdn_gemv_fusions(tmp_path, monkeypatch):
    """GDN heads of 64 (a quantisation group) take batch-1 decode's fused path: the conv in
    the in-projection's GEMV, the gated norm in the out-projection's. Greedy decode through
    it equals the reference path."""
    import sparrow.layers.gated_deltanet as gdn

    cfg = CFG.replace(
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_layers=2,
        layer_types=("linear_attention", "full_attention"),
    )
    ckpt = write_random_checkpoint(
        tmp_path, cfg, seed=7, dtype=torch.float32, tokenizer=False, progress=False
    )
    model = load_checkpoint(ckpt, quantize=QuantConfig.mlx_default(), progress=False)
    calls = []
    monkeypatch.setattr(
        gdn, "quant_gemv_conv", lambda *a, **k: calls.append(1) or quant_gemv_conv(*a, **k)
    )
    test_decode_with_triton_gemv_matches_reference(model)
    assert len(calls) == DECODE_STEPS * cfg.layer_types.count("linear_attention")


@pytest.mark.gpu
def test_one_token_gdn_fusions_gpu(monkeypatch):
    """bf16 on the GPU with GDN heads of 128 (the real model's): teacher-forced batch-1 decode
    through the fused path and with the fusions off give the same logits up to bf16 rounding
    (the fused path rounds the norm once in fp32, the layer three times in bf16)."""
    from sparrow.layers.gated_deltanet import GatedDeltaNet
    from sparrow.loader.random_checkpoint import random_model

    cfg = CFG.replace(linear_key_head_dim=128, linear_value_head_dim=128)
    model = random_model(cfg, 3, "cuda", torch.bfloat16, quantize=QuantConfig.mlx_default())
    fusions = GatedDeltaNet._gemv_fusions
    taken = []

    def run(fused):
        def gate(self, *args):
            taken.append(fusions(self, *args) if fused else None)
            return taken[-1]

        monkeypatch.setattr(GatedDeltaNet, "_gemv_fusions", gate)
        batch = SequenceBatch(model, 1, 32)
        with torch.no_grad():
            logits = [model.logits(batch.forward([torch.arange(20, device="cuda")]))[-1]]
            for tok in (5, 77, 300, 41):
                logits.append(model.logits(batch.forward([torch.tensor([tok], device="cuda")]))[0])
        return torch.stack(logits).float()

    fused, separate = run(True), run(False)
    fused_steps = sum(t is not None for t in taken)
    assert fused_steps == 4 * sum(t == "linear_attention" for t in cfg.layer_types)
    assert rel_err(fused[0], separate[0]) == 0  # the prompt: no decode step yet
    assert rel_err(fused, separate) < 2e-2, rel_err(fused, separate)
