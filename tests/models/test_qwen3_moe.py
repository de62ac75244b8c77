"""Qwen3-MoE against the HF oracle (transformers 5.17 `Qwen3MoeForCausalLM`), fp32 on CPU:
prefill, cached decode and two sequences in one step, chunked prefill, YaRN; checkpoints
both ways (HF's `save_pretrained` into `load_checkpoint`, `write_random_checkpoint` into
HF's `from_pretrained`); the 4-bit model against its dequantised float twin; config parsing
and the tensor-parallel plan."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from sparrow.config import ConfigError, QuantConfig
from sparrow.distributed.shard import Shard, cut_shape, pieces, shard_args
from sparrow.layers.quantized import QuantizedEmbedding, QuantizedExperts, QuantizedLinear
from sparrow.layers.rotary import YarnScaling
from sparrow.loader.mlx_writer import save_mlx_checkpoint
from sparrow.loader.random_checkpoint import write_random_checkpoint
from sparrow.loader.weights import build_empty_model, load_checkpoint, load_tensors
from sparrow.models import model_args_from_hf
from sparrow.models.qwen3_moe import PRESETS, ModelArgs, shard_plan
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err

TOL = 1e-4
DECODE_STEPS = 6

# GQA 2:1, head_dim 24 (not a power of two), top-4 of 16 experts 40 wide: a decode step
# leaves 12 experts without a row.
SMALL = ModelArgs(
    vocab_size=300,
    hidden_size=64,
    num_layers=5,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=24,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=40,
    eos_token_ids=(2,),
)
# Qwen3-30B-A3B's config.json as published (transformers 4.51 keys).
REAL = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Matrices N(0, 1 / fan_in) (experts' by their last dim), norm weights 1 + N(0, 0.2^2):
    HF's init (norms 1, std 0.02) would hide a wrong norm or near-uniform attention."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else noise / p.shape[-1] ** 0.5)


def _hf_model(cfg: ModelArgs, seed: int) -> Qwen3MoeForCausalLM:
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg.to_hf_config())).eval()
    _randomize(hf, seed)
    return hf


def _logits(model, ids: list[int]) -> torch.Tensor:
    return model.logits(SequenceBatch(model, 1, len(ids)).forward([ids]))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours, HF, checkpoint): HF's model with random weights written by its own
    `save_pretrained`, read back by `load_checkpoint`."""
    hf = _hf_model(SMALL, seed=0)
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    return load_checkpoint(path, progress=False), hf, path


def test_save_pretrained_checkpoint_loads_exactly(models):
    ours, hf, path = models
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "model.layers.4.mlp.experts.15.up_proj.weight" in f.keys()  # per expert
    theirs = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        assert torch.equal(t, theirs[name]), name


def _hf_run(hf, prompt: list[int], decode: list[int]):
    """Prefill logits [L, V] and those of each teacher-forced decode step [N, V]."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache, steps = out.past_key_values, []
        for tok in decode:
            step = hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            steps.append(step.logits[0, -1])
            cache = step.past_key_values
    return out.logits[0], torch.stack(steps)


@pytest.mark.parametrize("lengths", [(37, 11), (1, 50)])
def test_batched_prefill_and_decode_match_hf(models, lengths):
    """Two prompts in one step, then decode steps of both at once, against HF run alone."""
    ours, hf, _ = models
    gen = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    decode = torch.randint(0, SMALL.vocab_size, (DECODE_STEPS, len(lengths)), generator=gen)
    batch = SequenceBatch(ours, len(prompts), max(lengths) + DECODE_STEPS)
    prefill = ours.logits(batch.forward(prompts)).split(list(lengths))
    steps = torch.stack(
        [ours.logits(batch.forward(decode[i, :, None])) for i in range(len(decode))]
    )
    for b, prompt in enumerate(prompts):
        hf_prefill, hf_steps = _hf_run(hf, prompt, decode[:, b].tolist())
        err = rel_err(prefill[b], hf_prefill)
        assert err < TOL, f"prefill of sequence {b}: rel err {err:.2e}"
        err = rel_err(steps[:, b], hf_steps)
        assert err < TOL, f"decode of sequence {b}: rel err {err:.2e}"


def test_chunked_prefill_matches_hf_single_pass(models):
    ours, hf, _ = models
    prompt = torch.randint(0, SMALL.vocab_size, (50,), generator=torch.Generator().manual_seed(7))
    batch = SequenceBatch(ours, 1, 50)
    chunks = [ours.logits(batch.forward([c])) for c in prompt.split([17, 1, 32])]
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0]
    err = rel_err(torch.cat(chunks), expected)
    assert err < TOL, f"rel err {err:.2e}"


def test_yarn_matches_hf():
    """YaRN over an original context of 16 positions: a 40-token prompt reaches past it."""
    cfg = SMALL.replace(
        num_layers=2,
        max_position_embeddings=64,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16),
    )
    hf = _hf_model(cfg, seed=1)
    assert ModelArgs.from_hf(hf.config.to_dict()) == cfg
    ours = load_tensors(cfg, hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = rel_err(_logits(ours, ids.tolist()), hf(ids[None]).logits[0])
    assert err < TOL, f"rel err {err:.2e}"


@pytest.mark.parametrize("tied", [False, True])
def test_random_checkpoint_loads_in_hf(tmp_path, tied):
    """`write_random_checkpoint` (the release's layout: one tensor per expert; lm_head tied
    or not) read by HF's `from_pretrained` and by `load_checkpoint` gives the same logits."""
    cfg = SMALL.replace(num_layers=2, initializer_range=0.1, tie_word_embeddings=tied)
    path = write_random_checkpoint(
        tmp_path, cfg, seed=3, dtype=torch.float32, tokenizer=False, progress=False
    )
    hf, info = Qwen3MoeForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    ours = load_checkpoint(path, progress=False)
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = rel_err(_logits(ours, ids.tolist()), hf.eval()(ids[None]).logits[0])
    assert err < TOL, f"rel err {err:.2e}"


def test_random_checkpoint_tokenizer_has_qwen3_ids(tmp_path):
    from tokenizers import Tokenizer

    write_random_checkpoint(tmp_path, SMALL.replace(num_layers=1), progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 151643
    assert tok.token_to_id("<|im_end|>") == 151645
    assert tok.token_to_id("</think>") == 151668


# Every in-dim a multiple of the quantisation group (64), so every linear layer, the experts
# and the embedding are quantised.
QUANT = SMALL.replace(
    vocab_size=512, num_layers=3, head_dim=32, num_experts=8, moe_intermediate_size=64
)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    path = write_random_checkpoint(
        tmp_path_factory.mktemp("float"),
        QUANT.replace(initializer_range=0.1),
        seed=5,
        dtype=torch.float32,
        tokenizer=False,
        progress=False,
    )
    return path, load_checkpoint(path, quantize=QuantConfig.mlx_default(), progress=False)


def _dequantized_float_model(path, quantized):
    """The float model whose weights are exactly the quantised model's dequantised weights."""
    model = load_checkpoint(path, progress=False)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            target = model.get_submodule(name) if name else model
            if isinstance(module, QuantizedLinear):
                target.weight.copy_(module.dequantized_weight(torch.float32))
            elif isinstance(module, QuantizedEmbedding):
                target.weight.copy_(module(torch.arange(QUANT.vocab_size)))
            elif isinstance(module, QuantizedExperts):
                for e in range(QUANT.num_experts):
                    target.gate_up_proj[e], target.down_proj[e] = module.expert_weights(e)
    return model


def test_quantised_model_equals_its_dequantised_float_twin(quantized):
    path, model = quantized
    layer = model.layers[0]
    assert isinstance(layer.mlp.experts, QuantizedExperts) and layer.mlp.experts.spec.bits == 4
    assert layer.mlp.gate.spec.bits == 8 and layer.mlp.shared_expert is None
    assert isinstance(layer.self_attn.o_proj, QuantizedLinear)
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert layer.self_attn.q_norm.weight.dtype == torch.float32  # norms stay float
    ids = torch.randint(0, QUANT.vocab_size, (45,), generator=torch.Generator().manual_seed(0))
    expected = _logits(_dequantized_float_model(path, model), ids.tolist())
    assert rel_err(_logits(model, ids.tolist()), expected) < 1e-5


def test_quantised_decode_with_kernels_matches_reference(quantized):
    """One decode step through the Triton kernels (interpreter on CPU, ~9 s): the routed
    experts' GEMVs without a shared expert, paged decode attention without a gate."""
    from sparrow.kernels import get_backend, set_backend

    _, model = quantized
    prompt = list(range(3, 23))

    def run(backend):
        set_backend("reference")
        batch = SequenceBatch(model, 1, 32)
        last = model.logits(batch.forward([prompt]))[-1]
        set_backend(backend)
        return torch.stack([last, model.logits(batch.forward([[int(last.argmax())]]))[0]])

    previous = get_backend()
    try:
        assert rel_err(run("triton"), run("reference")) < 1e-4
    finally:
        set_backend(previous)


def test_quantised_mlx_checkpoint_round_trip(tmp_path, quantized):
    """MLX layout: stacked `switch_mlp` experts, packed uint32 words, norms unshifted."""
    _, model = quantized
    out = save_mlx_checkpoint(model, tmp_path / "mlx", shard_bytes=256 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".mlp.switch_mlp.down_proj.scales" in name for name in index)
    reloaded = load_checkpoint(out, progress=False)
    for name, t in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], t), name


def test_real_config_parses_to_the_preset():
    assert model_args_from_hf(REAL) == PRESETS["qwen3-30b-a3b"]
    assert PRESETS["qwen3-30b-a3b"].max_context == 40960


def test_hf_config_round_trips():
    """HF 5.17 writes `num_local_experts` and `rope_parameters`; both read back."""
    raw = Qwen3MoeConfig(**SMALL.to_hf_config()).to_dict()
    assert "num_local_experts" in raw and "num_experts" not in raw
    assert ModelArgs.from_hf(raw) == SMALL


def test_missing_keys_take_hf_defaults():
    ours = ModelArgs.from_hf({"model_type": "qwen3_moe", "norm_topk_prob": True})
    hf = Qwen3MoeConfig(norm_topk_prob=True)
    assert ours.num_layers == hf.num_hidden_layers == 24
    assert ours.head_dim == hf.hidden_size // hf.num_attention_heads == 64  # no head_dim
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.num_experts == hf.num_experts and ours.eos_token_ids == (151645,)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"num_experts_per_tok": 129}, "exceeds num_experts"),
        ({"head_dim": 127}, "head_dim must be even"),
        ({"num_experts": 0}, "num_experts must be positive"),
        ({"vocab_size": "many"}, "malformed config"),
    ],
)
def test_unsupported_configs_are_rejected(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelArgs.from_hf(REAL | change)


def test_missing_norm_topk_prob_is_rejected():
    """HF reads a missing norm_topk_prob as false (unnormalised top-k weights)."""
    raw = {k: v for k, v in REAL.items() if k != "norm_topk_prob"}
    with pytest.raises(ConfigError, match="norm_topk_prob=False .HF's value when the key"):
        ModelArgs.from_hf(raw)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_shard_plan_cuts_every_tensor_to_the_rank_model(expert_parallel):
    """Under TP 2 each checkpoint tensor's cut has the shape of the rank model's parameter."""
    full = build_empty_model(SMALL)
    plan = shard_plan(SMALL, expert_parallel)
    shard = Shard(1, 2, experts=expert_parallel)
    rank = build_empty_model(shard_args(SMALL, plan, shard))
    shapes = dict(rank.named_parameters())
    for name, p in full.named_parameters():
        got = cut_shape(tuple(p.shape), pieces(name, plan, shard))
        assert got == tuple(shapes[name].shape), name
