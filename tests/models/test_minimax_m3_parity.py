"""MiniMax M3 in fp32 against HF's `MiniMaxM3VLForCausalLM` sharing its weights: prefill,
cached decode, chunked prefill, a batch of two lengths, the legacy config form.

The tiny configs make MSA selection matter: blocks of 4-8 tokens and top-2/3 of them, so
prompts of 40-90 tokens keep a fraction of their keys per query; odd head and index dims,
full and sparse, dense and MoE layers mixed; router correction biases random (HF initialises
them to 0, which would hide a bias applied to the weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

from sparrow.loader.weights import load_tensors
from sparrow.models import model_args_from_hf
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err

TOL = 1e-4
FULL, SPARSE = "full_attention", "minimax_m3_sparse"

# fmt: off
TEXT = dict(
    vocab_size=251, hidden_size=56, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=2, head_dim=24, index_n_heads=2, index_head_dim=20,
    index_block_size=4, index_topk_blocks=3, num_local_experts=7, num_experts_per_tok=3,
    intermediate_size=20, dense_intermediate_size=36, shared_intermediate_size=12,
    layer_types=[FULL, SPARSE, SPARSE, FULL],
    mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    initializer_range=0.1, eos_token_id=250,
)
# The checkpoint's own spelling: sparse_attention_config and moe_layer_freq, top-level rope
# keys; two local blocks, 3 KV groups, rotary dim (16 * 0.75 = 12) below the index dim (16).
LEGACY = dict(
    vocab_size=199, hidden_size=40, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=3, head_dim=16, num_local_experts=5, num_experts_per_tok=2,
    intermediate_size=12, dense_intermediate_size=20, shared_intermediate_size=8,
    sparse_attention_config={"sparse_num_index_heads": 3, "sparse_index_dim": 16,
                             "sparse_block_size": 8, "sparse_topk_blocks": 2,
                             "sparse_local_block": 2, "sparse_attention_freq": [0, 1, 1],
                             "sparse_init_block": 0, "sparse_score_type": "max"},
    moe_layer_freq=[0, 1, 1], rope_theta=50_000.0, partial_rotary_factor=0.75, rotary_dim=12,
    initializer_range=0.1, eos_token_id=0,
)
# fmt: on


def build(text: dict, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF model, ours on the same weights), fp32."""
    torch.manual_seed(seed)
    config = MiniMaxM3VLTextConfig(**text)
    hf = MiniMaxM3VLForCausalLM(config).eval()
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    args = model_args_from_hf({"model_type": "minimax_m3_vl_text"} | text)
    return hf, load_tensors(args, hf.state_dict(), dtype=torch.float32)


@pytest.fixture(scope="module")
def models():
    return build(TEXT)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def test_args_follow_hf_config():
    args = model_args_from_hf({"model_type": "minimax_m3_vl_text"} | LEGACY)
    hf = MiniMaxM3VLTextConfig(**LEGACY)
    assert args.layer_types == tuple(hf.layer_types) == (FULL, SPARSE, SPARSE)
    assert args.mlp_layer_types == tuple(hf.mlp_layer_types) == ("dense", "sparse", "sparse")
    assert (args.index_block_size, args.index_topk_blocks, args.index_local_blocks) == (8, 2, 2)
    assert args.rotary_dim == 12 and args.rope_theta == 50_000.0
    # rotary_dim alone is not read: HF rotates the whole head (partial_rotary_factor 1.0).
    alone = {k: v for k, v in LEGACY.items() if k != "partial_rotary_factor"}
    assert model_args_from_hf({"model_type": "minimax_m3_vl_text"} | alone).rotary_dim == 16


def test_prefill_matches_hf(models):
    hf, ours = models
    ids = prompt(71, TEXT["vocab_size"], 0)
    got = ours.logits(SequenceBatch(ours, 1, 80).forward([ids]))
    assert rel_err(got, hf_logits(hf, ids)) < TOL


def test_selection_changes_the_result(models):
    """The prompt is long enough that MSA drops keys: with every block selected (a dense
    model) the logits move far beyond the tolerance."""
    hf, ours = models
    ids = prompt(71, TEXT["vocab_size"], 0)
    dense, _ = build(TEXT | {"index_topk_blocks": 64})
    assert rel_err(hf_logits(dense, ids), hf_logits(hf, ids)) > 1e-2


@torch.no_grad()
def test_cached_decode_matches_hf(models):
    """8 greedy steps with HF's cache, then ours fed the same tokens."""
    hf, ours = models
    ids = prompt(45, TEXT["vocab_size"], 1)
    out = hf(torch.tensor([ids]), use_cache=True)
    rows, tokens = [out.logits[0, -1:]], [int(out.logits[0, -1].argmax())]
    for _ in range(7):
        out = hf(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
        rows.append(out.logits[0])
        tokens.append(int(out.logits[0, -1].argmax()))
    batch = SequenceBatch(ours, 1, 60)
    got = [ours.logits(batch.forward([ids]))[-1:]]
    got += [ours.logits(batch.forward([[t]])) for t in tokens[:-1]]
    assert rel_err(torch.cat(got), torch.cat(rows).float()) < TOL


def test_chunked_prefill_equals_one_piece(models):
    hf, ours = models
    ids = prompt(66, TEXT["vocab_size"], 2)
    whole = ours.logits(SequenceBatch(ours, 1, 70).forward([ids]))
    batch = SequenceBatch(ours, 1, 70)
    pieces = [
        ours.logits(batch.forward([ids[i : i + n]]))
        for i, n in zip((0, 5, 22, 23, 50), (5, 17, 1, 27, 16), strict=True)
    ]
    assert rel_err(torch.cat(pieces), whole) < TOL
    assert rel_err(whole, hf_logits(hf, ids)) < TOL


def test_batch_of_two_lengths_matches_hf(models):
    hf, ours = models
    a, b = prompt(53, TEXT["vocab_size"], 3), prompt(19, TEXT["vocab_size"], 4)
    both = ours.logits(SequenceBatch(ours, 2, 64).forward([a, b]))
    assert rel_err(both[: len(a)], hf_logits(hf, a)) < TOL
    assert rel_err(both[len(a) :], hf_logits(hf, b)) < TOL


def test_legacy_config_matches_hf():
    hf, ours = build(LEGACY, seed=5)
    ids = prompt(90, LEGACY["vocab_size"], 6)
    batch = SequenceBatch(ours, 1, 96)
    got = torch.cat(
        [ours.logits(batch.forward([ids[:61]])), ours.logits(batch.forward([ids[61:]]))]
    )
    assert rel_err(got, hf_logits(hf, ids)) < TOL
