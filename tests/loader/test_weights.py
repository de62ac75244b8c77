"""Checkpoint loading: layouts HF writes, and a clear error for each kind of bad checkpoint."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparrow.loader.random_checkpoint import random_model, random_tensors, write_random_checkpoint
from sparrow.loader.weights import CheckpointError, load_checkpoint, load_tensors
from sparrow.models.qwen3_5_moe import ModelArgs
from sparrow.worker.sequences import SequenceBatch

CFG = ModelArgs(
    vocab_size=128,
    hidden_size=32,
    num_layers=4,
    num_attention_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mrope_section=(1, 1, 0),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)


def _write(path, **kw):
    kw = {"seed": 3, "dtype": torch.float32, "tokenizer": False, "progress": False} | kw
    return write_random_checkpoint(path, CFG, **kw)


def _load(path):
    return load_checkpoint(path, "cpu", torch.float32, progress=False)


def _assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _load(_write(tmp_path_factory.mktemp("ref")))


def test_round_trip_matches_generated_tensors(tmp_path, reference):
    params = reference.state_dict()
    for name, t in random_tensors(CFG, seed=3, dtype=torch.float32):
        key = name.removeprefix("model.language_model.")
        torch.testing.assert_close(params[key], t, rtol=0, atol=0)


def test_sharded_checkpoint(tmp_path, reference):
    path = _write(tmp_path, shard_bytes=64 << 10)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    _assert_same(_load(path), reference)


def test_per_expert_names(tmp_path, reference):
    path = _write(tmp_path, per_expert=True)
    names = load_file(str(path / "model.safetensors")).keys()
    assert "model.language_model.layers.0.mlp.experts.5.up_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    _assert_same(_load(path), reference)


def test_random_model_on_device_equals_written_checkpoint(reference):
    _assert_same(random_model(CFG, seed=3, dtype=torch.float32), reference)


def test_hf_save_pretrained_layout(tmp_path):
    """What transformers 5.17 writes: bare text config, `model.` prefix, per-expert names."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**CFG.to_hf_text_config())).eval()
    hf.save_pretrained(tmp_path)
    ours = _load(tmp_path)
    ids = torch.arange(20) % CFG.vocab_size
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        actual = ours.logits(SequenceBatch(ours, 1, 20).forward([ids]))
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_in_memory_state_dict_shares_storage(reference):
    sd = {f"model.language_model.{k}": v for k, v in reference.state_dict().items()}
    sd["lm_head.weight"] = sd.pop("model.language_model.lm_head.weight")
    sd["mtp.layers.0.foo.weight"] = torch.zeros(3)  # ignored, like HF does
    model = load_tensors(CFG, sd, "cpu", torch.float32)
    w = reference.layers[0].mlp.experts.gate_up_proj
    assert model.layers[0].mlp.experts.gate_up_proj.data_ptr() == w.data_ptr()


# -- bad checkpoints --------------------------------------------------------------------------


def _edit(path, fn):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file))
    return file


EXPERTS = "model.language_model.layers.1.mlp.experts.gate_up_proj"


def test_missing_tensor(tmp_path):
    path = _write(tmp_path)
    _edit(path, lambda t: t.pop(EXPERTS))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensors: layers\.1\.mlp\.experts"
        r"\.gate_up_proj \(expected shape \[6, 32, 32\]\)",
    ):
        _load(path)


def test_missing_expert_of_per_expert_layout(tmp_path):
    path = _write(tmp_path, per_expert=True)
    _edit(path, lambda t: t.pop("model.language_model.layers.2.mlp.experts.4.down_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"layers\.2\.mlp\.experts\.down_proj \(expert 4, "
        r"down_proj; full shape \[6, 32, 16\]\)",
    ):
        _load(path)


def test_wrong_shape(tmp_path):
    path = _write(tmp_path)
    file = _edit(path, lambda t: t.update({EXPERTS: torch.zeros(6, 32, 31)}))
    with pytest.raises(CheckpointError) as e:
        _load(path)
    assert str(file) in str(e.value) and EXPERTS in str(e.value)
    assert "shape [6, 32, 31], expected [6, 32, 32]" in str(e.value)


def test_wrong_dtype(tmp_path):
    path = _write(tmp_path)
    name = "model.language_model.norm.weight"
    _edit(path, lambda t: t.update({name: torch.zeros(32, dtype=torch.int32)}))
    with pytest.raises(
        CheckpointError,
        match=r"norm\.weight.* dtype torch.int32, expected a "
        r"float dtype with shape \[32\]",
    ):
        _load(path)


def test_truncated_file(tmp_path):
    path = _write(tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable or truncated"):
        _load(path)


def test_tensor_of_another_model(tmp_path):
    path = _write(tmp_path)
    extra = "model.language_model.layers.9.mlp.gate.weight"
    _edit(path, lambda t: t.update({extra: torch.zeros(6, 32)}))
    with pytest.raises(CheckpointError, match=r"layers\.9\.mlp\.gate\.weight.*does not belong"):
        _load(path)


def test_index_lists_missing_shard(tmp_path):
    path = _write(tmp_path, shard_bytes=64 << 10)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard.name} which does not exist"):
        _load(path)


def test_no_weights(tmp_path):
    path = _write(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        _load(path)
