"""The batched decode references (no host reads, so CUDA graphs can capture them) against the
per-sequence references they batch, on awkward shapes: head dims 24 / 40 / 48, 3 sequences
with uneven contexts, slots out of order, tables wider than any context."""

import torch

from sparrow.kernels.attention import naive as attention
from sparrow.kernels.causal_conv1d import naive as conv
from sparrow.kernels.gated_delta_rule import naive as gdn
from tests.conftest import rel_err

TOL = 1e-5


def test_decode_attention_matches_per_sequence():
    torch.manual_seed(0)
    block, hkv, hq, d = 4, 3, 6, 48
    contexts = torch.tensor([1, 9, 22], dtype=torch.int32)
    k_cache, v_cache = torch.randn(2, 40, block, hkv, d).unbind(0)
    tables = torch.randperm(40)[: 3 * 9].view(3, 9).int()  # 9 blocks: wider than 22 tokens
    q = torch.randn(3, hq, d)
    cu = torch.arange(4, dtype=torch.int32)
    want = attention.paged_attention(q, k_cache, v_cache, tables, cu, contexts, 0.3)
    got = attention.paged_decode_attention(
        q, k_cache, v_cache, tables, contexts, 0.3, blocks_per_step=2
    )
    assert rel_err(got, want) < TOL
    wider = torch.cat((tables, tables[:, :3]), dim=1)  # padding columns add nothing
    again = attention.paged_decode_attention(
        q, k_cache, v_cache, wider, contexts, 0.3, blocks_per_step=2
    )
    assert torch.equal(again, got)


def test_conv_step_matches_per_sequence():
    torch.manual_seed(1)
    channels, kernel = 40, 4
    states = torch.randn(5, channels, kernel - 1)
    weight, x = torch.randn(channels, kernel), torch.randn(3, channels)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    want = [
        conv.causal_conv1d(x[i : i + 1], states[s].clone(), weight)
        for i, s in enumerate(slots.tolist())
    ]
    after = states.clone()
    got = conv.causal_conv1d_step(x, after, slots, weight)
    assert rel_err(got, torch.cat([y for y, _ in want])) < TOL
    for (_, state), s in zip(want, slots.tolist(), strict=True):
        assert rel_err(after[s], state) < TOL
    assert torch.equal(after[[1, 3]], states[[1, 3]])  # other slots untouched


def test_recurrent_step_matches_per_sequence():
    torch.manual_seed(2)
    hk, hv, dk, dv = 3, 6, 24, 40
    pool = torch.randn(4, hv, dk, dv)
    q, k = torch.randn(2, 3, hk, dk).unbind(0)
    v = torch.randn(3, hv, dv)
    g, beta = -torch.rand(3, hv), torch.rand(3, hv)
    slots = torch.tensor([2, 3, 0], dtype=torch.int32)
    after = pool.clone()
    got = gdn.recurrent_step_batched(q, k, v, g, beta, after, slots)
    for i, s in enumerate(slots.tolist()):
        o, state = gdn.recurrent_gated_delta_rule(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], pool[s]
        )
        assert rel_err(got[i], o[0]) < TOL and rel_err(after[s], state) < TOL
    assert torch.equal(after[1], pool[1])
