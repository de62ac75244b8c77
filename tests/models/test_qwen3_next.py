"""Qwen3-Next against the HF oracle (transformers 5.17 `Qwen3NextForCausalLM`), fp32 on CPU:
a checkpoint HF's `save_pretrained` writes loads here and gives HF's logits (batched prefill,
cached decode, chunked prefill); a random checkpoint written here loads in HF and gives
ours; the 4-bit model, the kernel path, configs HF accepts and those Sparrow rejects."""

import inspect

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from sparrow.config import ConfigError, QuantConfig
from sparrow.distributed.shard import Shard, pieces
from sparrow.kernels import get_backend, set_backend
from sparrow.layers.quantized import QuantizedEmbedding, QuantizedExperts, QuantizedLinear
from sparrow.layers.rotary import YarnScaling
from sparrow.loader.random_checkpoint import PRESETS, write_random_checkpoint
from sparrow.loader.weights import load_checkpoint
from sparrow.models import model_args_from_hf
from sparrow.models.qwen3_next import ModelArgs, shard_plan
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import randomize, rel_err

TOL = 1e-4
DECODE_STEPS = 6
LIN, FULL = "linear_attention", "full_attention"

# Every mechanism of the real model at awkward sizes: 5 layers in a layout that is not the
# default, GQA 2:1, rotary dim 8 of 32, 2 value heads per key head with key / value head
# dims 16 / 24, top-4 of 16 experts, a shared expert wider than the routed ones.
SMALL = ModelArgs(
    vocab_size=300,
    hidden_size=64,
    num_layers=5,
    layer_types=(LIN, FULL, LIN, LIN, FULL),
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    eos_token_ids=(299,),
)


@pytest.fixture(scope="module", autouse=True)
def hf_gdn_in_pytorch():
    """HF's GDN functions as written in PyTorch, not the hub / fla kernels they are wrapped
    to call where those are installed (see tests/conftest.py)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_module

    names = (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    )
    with pytest.MonkeyPatch.context() as mp:
        for name in names:
            mp.setattr(hf_module, name, inspect.unwrap(getattr(hf_module, name)))
        yield


def _hf_model(cfg: ModelArgs, seed: int) -> Qwen3NextForCausalLM:
    """HF's model of `cfg` with every parameter redrawn (`randomize`: norms and the decay
    parameters away from HF's init, so a wrong norm kind shows)."""
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(**cfg.to_hf_config())).eval()
    randomize(hf, seed)
    return hf


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """(the checkpoint HF's `save_pretrained` writes, HF's model), with multi-token-prediction
    tensors in a shard of their own (ignored, as in the release)."""
    path = tmp_path_factory.mktemp("hf")
    hf = _hf_model(SMALL, seed=1)
    hf.save_pretrained(path)
    save_file({"mtp.fc.weight": torch.ones(64, 128)}, str(path / "mtp.safetensors"))
    return path, hf


@pytest.fixture(scope="module")
def models(hf_checkpoint):
    """(ours loaded from HF's checkpoint, HF)."""
    path, hf = hf_checkpoint
    return load_checkpoint(path, progress=False), hf


def test_save_pretrained_checkpoint_loads_byte_for_byte(hf_checkpoint, models):
    """The fused, key-head-grouped Gated DeltaNet projections and the per-expert tensors as
    HF stores them."""
    ours, _ = models
    stored = load_file(str(hf_checkpoint[0] / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in stored
    state = ours.state_dict()
    for name in ("in_proj_qkvz", "in_proj_ba"):
        key = f"layers.2.linear_attn.{name}.weight"
        assert torch.equal(state[key], stored[f"model.{key}"])
    up = stored["model.layers.4.mlp.experts.3.up_proj.weight"]
    assert torch.equal(
        state["layers.4.mlp.experts.gate_up_proj"][3, SMALL.moe_intermediate_size :], up
    )


def _hf_run(hf, prompt, decode_tokens):
    """Prefill logits [L, V] and the logits of each teacher-forced decode step [N, V]."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        steps, cache = [], out.past_key_values
        for tok in decode_tokens:
            step = hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            steps.append(step.logits[0, -1])
            cache = step.past_key_values
    return out.logits[0], torch.stack(steps)


@pytest.mark.parametrize("lengths", [(37, 70), (130, 1)])
def test_batched_prefill_and_decode_match_hf(models, lengths):
    ours, hf = models
    gen = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    decode = torch.randint(0, SMALL.vocab_size, (DECODE_STEPS, len(lengths)), generator=gen)
    batch = SequenceBatch(ours, len(prompts), max(lengths) + DECODE_STEPS)
    with torch.no_grad():
        prefill = ours.logits(batch.forward(prompts)).split(list(lengths))
        steps = [ours.logits(batch.forward(decode[i, :, None])) for i in range(DECODE_STEPS)]
    for b, prompt in enumerate(prompts):
        hf_prefill, hf_steps = _hf_run(hf, prompt, decode[:, b].tolist())
        err = rel_err(prefill[b], hf_prefill)
        assert err < TOL, f"prefill of sequence {b}: rel err {err:.2e}"
        err = rel_err(torch.stack([s[b] for s in steps]), hf_steps)
        assert err < TOL, f"decode of sequence {b}: rel err {err:.2e}"


def test_chunked_prefill_matches_hf_single_pass(models):
    """A prompt fed in three chunks (state carried across) gives HF's full-sequence logits."""
    ours, hf = models
    prompt = torch.randint(0, SMALL.vocab_size, (150,), generator=torch.Generator().manual_seed(7))
    batch = SequenceBatch(ours, 1, 150)
    with torch.no_grad():
        chunks = [ours.logits(batch.forward([c])) for c in prompt.split([63, 1, 86])]
        expected = hf(prompt[None]).logits[0]
    err = rel_err(torch.cat(chunks), expected)
    assert err < TOL, f"rel err {err:.2e}"


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(SequenceBatch(model, 1, len(ids)).forward([ids]))


# One value head per key head (the regrouping is a view), tied embeddings, YaRN.
ONE_TO_ONE = SMALL.replace(
    num_layers=4,
    layer_types=(),
    full_attention_interval=2,
    linear_num_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=1024),
    initializer_range=0.1,
)


@pytest.mark.parametrize("cfg", [SMALL.replace(initializer_range=0.1), ONE_TO_ONE])
def test_random_checkpoint_loads_in_hf(tmp_path, cfg):
    """`write_random_checkpoint` (the release's layout: `model.` prefix, one tensor per
    expert) read by HF's own loader: every tensor placed, none left over, and HF's logits."""
    path = write_random_checkpoint(
        tmp_path, cfg, seed=2, dtype=torch.float32, tokenizer=False, progress=False
    )
    hf, info = Qwen3NextForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = torch.randint(0, cfg.vocab_size, (75,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf.eval()(ids[None]).logits[0]
    err = rel_err(_logits(load_checkpoint(path, progress=False), ids), expected)
    assert err < TOL, f"rel err {err:.2e}"


# Input dims of every projection whole 4-bit groups of 64, so all of them are quantised.
QUANT = SMALL.replace(
    linear_value_head_dim=32, moe_intermediate_size=64, shared_expert_intermediate_size=64
)


def test_4bit_model_equals_the_float_model_on_its_dequantised_weights(tmp_path):
    path = write_random_checkpoint(
        tmp_path, QUANT, seed=5, dtype=torch.float32, tokenizer=False, progress=False
    )
    quantized = load_checkpoint(path, quantize=QuantConfig.mlx_default(), progress=False)
    gdn = quantized.layers[0].linear_attn
    assert isinstance(gdn.in_proj_qkvz, QuantizedLinear) and isinstance(
        gdn.out_proj, QuantizedLinear
    )
    model = load_checkpoint(path, progress=False)
    for name, module in quantized.named_modules():
        if isinstance(module, QuantizedLinear):
            model.get_submodule(name).weight.copy_(module.dequantized_weight(torch.float32))
        elif isinstance(module, QuantizedEmbedding):
            model.get_submodule(name).weight.copy_(module(torch.arange(QUANT.vocab_size)))
        elif isinstance(module, QuantizedExperts):
            target = model.get_submodule(name)
            for e in range(QUANT.num_experts):
                target.gate_up_proj[e], target.down_proj[e] = module.expert_weights(e)
    ids = torch.randint(0, QUANT.vocab_size, (45,), generator=torch.Generator().manual_seed(0))
    assert rel_err(_logits(quantized, ids), _logits(model, ids)) < 1e-5


def test_kernel_path_matches_reference(models):
    """Batched prefill and decode through the Triton kernels (the interpreter on CPU): the
    regrouped projections feed the conv, chunked-scan and fused decode-step kernels."""
    ours, _ = models
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=gen) for n in (37, 1)]
    decode = [torch.randint(0, SMALL.vocab_size, (2,), generator=gen) for _ in range(2)]

    def run(backend):
        set_backend(backend)
        batch = SequenceBatch(ours, 2, 64)
        with torch.no_grad():
            out = [ours.logits(batch.forward(prompts))]
            out += [ours.logits(batch.forward(ids[:, None])) for ids in decode]
        return torch.cat(out)

    previous = get_backend()
    try:
        expected = run("reference")
        assert rel_err(run("triton"), expected) < TOL
    finally:
        set_backend(previous)


# The released config.json of Qwen3-Next-80B-A3B-Instruct.
RELEASED = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_configs_parse_as_hf_reads_them():
    assert model_args_from_hf(RELEASED) == PRESETS["qwen3-next-80b-a3b"]
    assert PRESETS["qwen3-next-80b-a3b"].layer_types == tuple(Qwen3NextConfig().layer_types)
    hf = Qwen3NextConfig()  # HF's defaults where a config.json leaves keys out
    cfg = model_args_from_hf({"model_type": "qwen3_next"})
    assert (cfg.rope_theta, cfg.max_position_embeddings) == (
        hf.rope_parameters["rope_theta"],
        hf.max_position_embeddings,
    )
    assert cfg.rotary_dim == 64 and cfg.num_experts == hf.num_experts
    legacy = {
        "model_type": "qwen3_next",
        "num_hidden_layers": 2,
        "layer_types": ["mamba", "attention"],
    }
    assert model_args_from_hf(legacy).layer_types == (LIN, FULL)
    assert model_args_from_hf(SMALL.to_hf_config()) == SMALL
    assert model_args_from_hf(ONE_TO_ONE.to_hf_config()) == ONE_TO_ONE


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decoder_sparse_step": 2}, r"dense MLP layers \[0, 2, 4\]"),
        ({"mlp_only_layers": [1, 3]}, r"dense MLP layers \[1, 3\]"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be positive"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic"}}, "rope_type 'dynamic' is not supported"),
        ({"layer_types": [FULL] * 3}, "layer_types has 3 entries"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
        ({"num_hidden_layers": "many"}, "malformed config"),
    ],
)
def test_unsupported_configs_are_rejected(change, message):
    with pytest.raises(ConfigError, match=message):
        model_args_from_hf(SMALL.to_hf_config() | change)


def test_tensor_parallel_rank_reads_whole_key_head_groups():
    """Rows grouped by key head: rank 1 of 2 reads the second half of the fused projections
    as one block; the conv's [q | k | v] channels per part."""
    kd, vd = SMALL.linear_key_dim, SMALL.linear_value_dim
    plan, rank = shard_plan(SMALL, False), Shard(1, 2)
    qkvz = 2 * kd + 2 * vd
    assert pieces("layers.0.linear_attn.in_proj_qkvz.weight", plan, rank) == (
        0,
        [(qkvz // 2, qkvz)],
    )
    assert pieces("layers.0.linear_attn.in_proj_ba.weight", plan, rank) == (0, [(4, 8)])
    assert pieces("layers.0.linear_attn.conv1d.weight", plan, rank) == (
        0,
        [(kd // 2, kd), (kd + kd // 2, 2 * kd), (2 * kd + vd // 2, 2 * kd + vd)],
    )


def test_tensor_parallel_ranks_sum_to_the_whole(hf_checkpoint, models):
    """Two ranks' shares of HF's checkpoint (`load_checkpoint(shard=)`, in one process): fed
    what a Gated DeltaNet, an attention and an MoE block of the whole model get, the ranks'
    partial outputs sum to the whole block's output."""
    ours, _ = models
    blocks = {  # name -> (the block in a model, its layer's cache index or None: no cache)
        "gdn": (lambda m: m.layers[0].linear_attn, 0),
        "attention": (lambda m: m.layers[1].self_attn, 1),
        "moe": (lambda m: m.layers[2].mlp, None),
    }
    inputs = {}

    def keep(name):
        def hook(_, args):
            inputs[name] = tuple(a.clone() if torch.is_tensor(a) else a for a in args)

        return hook

    hooks = [get(ours).register_forward_pre_hook(keep(n)) for n, (get, _) in blocks.items()]
    _logits(ours, torch.randint(0, SMALL.vocab_size, (40,)))
    for hook in hooks:
        hook.remove()

    def run(model, name):
        get, layer = blocks[name]
        args = inputs[name]
        if layer is not None:  # the same step over an empty cache of the model's own heads
            args = (*args[:-1], SequenceBatch(model, 1, 64).cache.layers[layer])
        with torch.no_grad():
            return get(model)(*args)

    ranks = [load_checkpoint(hf_checkpoint[0], shard=Shard(r, 2), progress=False) for r in (0, 1)]
    assert ranks[1].layers[0].linear_attn.in_proj_qkvz.out_features == (
        SMALL.linear_key_dim + SMALL.linear_value_dim
    )
    for name in blocks:
        err = rel_err(run(ranks[0], name) + run(ranks[1], name), run(ours, name))
        assert err < TOL, f"{name}: rel err {err:.2e}"


def test_4bit_one_token_decode_through_the_kernels(tmp_path):
    """Batch-1 decode of a 4-bit model with Gated DeltaNet heads of a quantisation group
    (where Qwen3.5 takes the GEMV fusions, whose conv epilogue the grouped rows do not fit)
    through the kernels (the interpreter on CPU) equals the reference path."""
    cfg = QUANT.replace(
        num_layers=2,
        layer_types=(LIN, FULL),
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    path = write_random_checkpoint(
        tmp_path, cfg, seed=6, dtype=torch.float32, tokenizer=False, progress=False
    )
    model = load_checkpoint(path, quantize=QuantConfig.mlx_default(), progress=False)
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(8))

    def run(backend):
        set_backend("reference")
        batch = SequenceBatch(model, 1, 32)
        with torch.no_grad():
            logits = [model.logits(batch.forward([prompt]))[-1]]
            set_backend(backend)
            for _ in range(2):
                logits.append(model.logits(batch.forward([logits[-1].argmax()[None]]))[0])
        return torch.stack(logits)

    previous = get_backend()
    try:
        assert rel_err(run("triton"), run("reference")) < TOL
    finally:
        set_backend(previous)
