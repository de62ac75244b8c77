"""Conv kernel vs reference: varlen mixes, lengths shorter than the kernel, decode, chaining."""

import pytest
import torch

from sparrow.kernels.causal_conv1d import naive
from sparrow.kernels.causal_conv1d.conv import causal_conv1d_varlen, state_pool

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _case(lengths, c, device, dtype=torch.float32, seed=0, position_major=False):
    """position_major: the pool as the engine lays it out (`state_pool`), else contiguous."""
    gen = torch.Generator().manual_seed(seed)
    # rows strided, as the layer passes them (a view of the fused in-projection)
    x = torch.randn(sum(lengths), c + 5, generator=gen).to(device, dtype)[:, 5:]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    states = torch.randn(len(lengths) + 3, c, 3, generator=gen).to(device, dtype)
    if position_major:
        states = state_pool(len(lengths) + 3, c, 4, device, dtype).copy_(states)
    slots = torch.randperm(len(lengths) + 3, generator=gen)[: len(lengths)].to(torch.int32)
    weight = torch.randn(c, 4, generator=gen).to(device, dtype)
    return x, cu.to(device), states, slots.to(device), weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("position_major", [False, True])
@pytest.mark.parametrize(
    "lengths, c",
    [
        ([1], 8),
        ([2, 1, 5], 60),
        ([63, 64, 65], 130),
        ([1, 1, 1, 1], 256),
        ([1, 1, 1], 200),
        ([200], 96),
    ],
)
def test_matches_reference(device, lengths, c, position_major):
    x, cu, states, slots, weight = _case(lengths, c, device, position_major=position_major)
    ref_states = states.cpu().clone()  # a CPU copy the reference updates in place
    expected = naive.causal_conv1d_varlen(x.cpu(), cu.cpu(), ref_states, slots.cpu(), weight.cpu())
    y = causal_conv1d_varlen(x, cu, states, slots, weight, max_len=max(lengths))
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states.cpu(), ref_states, rtol=0, atol=0)


@pytest.mark.gpu
def test_real_sizes_gpu():
    test_matches_reference("cuda", [1, 63, 64, 65, 1000], 8192, position_major=True)
    test_matches_reference("cuda", [1] * 64, 8192, position_major=True)  # decode


def test_chunked_equals_whole():
    x, _, states, _, weight = _case([50], 40, "cpu")
    slots = torch.tensor([2], dtype=torch.int32)
    whole_states = states.clone()
    whole = causal_conv1d_varlen(
        x, torch.tensor([0, 50], dtype=torch.int32), whole_states, slots, weight
    )
    parts = [
        causal_conv1d_varlen(
            x[a:b], torch.tensor([0, b - a], dtype=torch.int32), states, slots, weight
        )
        for a, b in ((0, 2), (2, 3), (3, 50))
    ]
    torch.testing.assert_close(torch.cat(parts), whole)
    torch.testing.assert_close(states, whole_states)


@pytest.mark.parametrize("device", DEVICES)
def test_states_saved_inside_sequences(device):
    """The conv state after the first n tokens of a sequence, stored to other rows of the
    pool: from x, from the old state (n < K - 1) or both, and at the sequence's end; the
    new states in the slots as without saves."""
    x, cu, states, slots, weight = _case([40, 2, 17], 24, device, position_major=True)
    states = torch.cat([states, torch.zeros(5, 24, 3, device=device)])
    before = states.cpu().clone()
    rows = torch.tensor([[6, 7], [8, -1], [9, 10]], dtype=torch.int32)
    at = torch.tensor([[1, 20], [2, 0], [17, 3]], dtype=torch.int32)
    ref_states = before.clone()
    naive.causal_conv1d_varlen(x.cpu(), cu.cpu(), ref_states, slots.cpu(), weight.cpu())
    causal_conv1d_varlen(
        x, cu, states, slots, weight, max_len=40, save_rows=rows.to(device), save_at=at.to(device)
    )
    starts = cu.tolist()
    for b in range(3):
        for row, n in zip(rows[b].tolist(), at[b].tolist(), strict=True):
            if row >= 0:
                seq = x[starts[b] : starts[b + 1]].cpu()
                expected = naive.conv_state_after(seq, before[int(slots[b])], n)
                torch.testing.assert_close(states[row].cpu(), expected, rtol=0, atol=0)
                ref_states[row] = expected
    torch.testing.assert_close(states.cpu(), ref_states, rtol=0, atol=0)
