"""What batch-invariant mode (`kernels.batch_invariant`) relies on, checked on the running
platform: a GEMM's rows are the same bits at any row count from 16 on, at any position and
in a batched GEMM of any batch; exp, log1p, rsqrt, cos and sin take one formula at every
position of a tensor; row-wise reductions do not depend on the rows beside them. And what it
gives: GEMMs, sigmoid, silu and softplus whose rows and elements do not depend on the rest of
the tensor; attention, the causal conv and the gated delta rule whose tokens are the same
bits alone (decode) and among a prompt's or beside other sequences."""

import pytest
import torch
import torch.nn.functional as F

from sparrow.kernels.attention import naive
from sparrow.kernels.batch_invariant import MIN_ROWS, BatchInvariantOps
from sparrow.kernels.causal_conv1d.naive import (
    causal_conv1d,
    causal_conv1d_step,
    causal_conv1d_tokens,
)
from sparrow.kernels.gated_delta_rule.naive import (
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_varlen,
)
from tests.conftest import rel_err

# (K, N) of the built-in model's projections: fused qkv, o_proj, the GDN in- and
# out-projections, router + shared-expert gate, experts, lm_head; and odd ones
SHAPES = [(128, 384), (128, 128), (128, 784), (256, 128), (128, 16), (128, 256), (128, 4096)]
SHAPES += [(60, 33), (512, 1000)]
COUNTS = [16, 17, 31, 64, 127, 300, 1031]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_gemm_rows_from_16_on_are_the_same_bits_at_any_count(k, n):
    """The platform's property the mode stands on; if this fails, the mode's promise does
    not hold on this machine."""
    gen = _gen()
    w, x = torch.randn(n, k, generator=gen), torch.randn(max(COUNTS) + 40, k, generator=gen)
    whole = F.linear(x, w)
    for m in COUNTS:
        for start in (0, 7, 40):
            assert torch.equal(F.linear(x[start : start + m], w), whole[start : start + m]), m


@pytest.mark.parametrize("m", [MIN_ROWS, 33, 200])
def test_batched_gemm_rows_from_16_on_are_the_same_bits_at_any_count(m):
    """The attention's two products per key block (2 K/V heads, head dim 32, 256 keys)."""
    gen = _gen(1)
    q, k = torch.randn(2, 300, 32, generator=gen), torch.randn(2, 32, 256, generator=gen)
    p, v = torch.randn(2, 300, 256, generator=gen), torch.randn(2, 256, 32, generator=gen)
    assert torch.equal(torch.bmm(q[:, 5 : 5 + m], k), torch.bmm(q, k)[:, 5 : 5 + m])
    assert torch.equal(torch.bmm(p[:, 5 : 5 + m], v), torch.bmm(p, v)[:, 5 : 5 + m])


@pytest.mark.parametrize("batch", [1, 2, 8, 24, 100])
def test_batched_gemm_matrices_are_the_same_bits_at_any_batch(batch):
    """The gated delta rule's products: a key row (16 with the mode's padding) by its
    sequence's state per value head, [B * Hv, 16, 32] @ [B * Hv, 32, 32]."""
    gen = _gen(7)
    a, b = torch.randn(800, MIN_ROWS, 32, generator=gen), torch.randn(800, 32, 32, generator=gen)
    whole = torch.bmm(a, b)
    assert torch.equal(torch.bmm(a[3 : 3 + batch], b[3 : 3 + batch]), whole[3 : 3 + batch])


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 9, 15, 16, 23])
def test_gemms_under_the_mode_at_any_row_count(m):
    gen = _gen(2)
    w, bias = torch.randn(257, 128, generator=gen), torch.randn(257, generator=gen)
    x = torch.randn(300, 128, generator=gen)
    a, b = torch.randn(8, 300, 32, generator=gen), torch.randn(8, 32, 33, generator=gen)
    with torch.inference_mode(), BatchInvariantOps():
        rows = x[100 : 100 + m]
        assert torch.equal(F.linear(rows, w), F.linear(x, w)[100 : 100 + m])
        assert torch.equal(F.linear(rows, w, bias), F.linear(x, w, bias)[100 : 100 + m])
        assert torch.equal(F.linear(rows[:, None], w)[:, 0], F.linear(rows, w))
        assert torch.equal(rows @ w.t(), (x @ w.t())[100 : 100 + m])
        assert torch.equal(torch.bmm(a[:, :m], b), torch.bmm(a, b)[:, :m])
        assert torch.equal(torch.einsum("hmk,hkn->hmn", a[:, :m], b), torch.bmm(a, b)[:, :m])
        assert F.linear(rows, w).is_contiguous() and torch.bmm(a[:, :m], b).is_contiguous()


def _alone_and_in_place(fn, x: torch.Tensor, offsets=(0, 1, 5, 15, 16, 17, 40_000)) -> None:
    """fn's value of each element at `offsets` is the same computed alone and within x (long
    enough to be split between threads)."""
    whole = fn(x)
    for i in offsets:
        assert torch.equal(fn(x[i : i + 1]), whole[i : i + 1]), i
        assert torch.equal(fn(x[i : i + 13]), whole[i : i + 13]), i


def test_elementwise_ops_the_mode_relies_on_do_not_depend_on_position():
    x = torch.randn(70_001, generator=_gen(3)) * 4
    for fn in (torch.exp, torch.rsqrt, torch.cos, torch.sin):
        _alone_and_in_place(fn, x.abs() + 0.1 if fn is torch.rsqrt else x)
    _alone_and_in_place(torch.log1p, x.abs())


def test_activations_under_the_mode_do_not_depend_on_position():
    x = torch.randn(70_001, generator=_gen(4)) * 8
    x[:3] = torch.tensor([-100.0, 30.0, 100.0])  # saturated sigmoid, softplus' threshold
    with torch.inference_mode(), BatchInvariantOps():
        for fn in (torch.sigmoid, F.silu, F.softplus, lambda t: F.softplus(t, beta=2.0)):
            _alone_and_in_place(fn, x, offsets=(0, 1, 2, 5, 15, 16, 17, 40_000))
        inplace = x.clone()
        inplace.sigmoid_()
        assert torch.equal(inplace, torch.sigmoid(x))
        mode = [fn(x) for fn in (torch.sigmoid, F.silu, F.softplus)]
    for got, want in zip(mode, (torch.sigmoid(x), F.silu(x), F.softplus(x)), strict=True):
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("width", [8, 32, 128, 256, 4096])
def test_row_reductions_do_not_depend_on_the_rows_beside(width):
    x = torch.randn(300, width, generator=_gen(5)) * 3
    ops = [
        lambda t: t.sum(-1),
        lambda t: t.pow(2).mean(-1),
        lambda t: t.amax(-1),
        lambda t: torch.softmax(t, -1),
        lambda t: torch.log_softmax(t, -1),
        lambda t: t.cumsum(-1),
    ]
    for op in ops:
        whole = op(x)
        for rows in (slice(7, 8), slice(0, 3), slice(100, 117)):
            assert torch.equal(op(x[rows]), whole[rows])
        assert torch.equal(op(x[7]), whole[7])


@pytest.mark.parametrize("length", [1, 63, 255, 256, 257, 600])
def test_blocked_attention_rows_alone_and_among_a_prompts(length):
    gen = _gen(6)
    q = torch.randn(length, 4, 32, generator=gen)
    k, v = torch.randn(length, 2, 32, generator=gen), torch.randn(length, 2, 32, generator=gen)
    scale = 32**-0.5
    with torch.inference_mode(), BatchInvariantOps():
        whole = naive.blocked_attention(q, k, v, scale)
        for n in sorted({1, length // 2 + 1, length}):
            alone = naive.blocked_attention(q[n - 1 : n], k[:n], v[:n], scale)  # decode
            assert torch.equal(alone, whole[n - 1 : n]), n
            chunk = naive.blocked_attention(q[max(0, n - 7) : n], k[:n], v[:n], scale)
            assert torch.equal(chunk, whole[max(0, n - 7) : n]), n
    assert rel_err(whole, naive.causal_attention(q, k, v, scale)) < 1e-5


def test_conv_tokens_as_the_step_computes_them():
    """Every token of a prompt (and of chunks of it) through `causal_conv1d_tokens` is the
    decode step's bits, beside another sequence; and the conv's values."""
    gen = _gen(8)
    c, width, n = 40, 4, 23
    x, other = torch.randn(n, c, generator=gen), torch.randn(5, c, generator=gen)
    weight, start = torch.randn(c, width, generator=gen), torch.randn(c, width - 1, generator=gen)
    with torch.inference_mode(), BatchInvariantOps():
        states = torch.stack([start, start, torch.zeros_like(start)])
        stepped = [
            causal_conv1d_step(x[i : i + 1], states, torch.tensor([0]), weight) for i in range(n)
        ]
        pool = torch.stack([torch.zeros_like(start), start, torch.randn(c, 3, generator=gen)])
        tokens = causal_conv1d_tokens(
            torch.cat([other, x[:9]]), [5, 9], pool, torch.tensor([2, 1]), weight
        )
        rest = causal_conv1d_tokens(x[9:], [n - 9], pool, torch.tensor([1]), weight)
    assert torch.equal(torch.cat([tokens[5:], rest]), torch.cat(stepped))
    assert torch.equal(pool[1], states[0])
    want, _ = causal_conv1d(x, start, weight)
    assert rel_err(torch.cat(stepped), want) < 1e-5


def test_gated_delta_rule_token_by_token_beside_other_sequences():
    """A sequence's outputs and state are the same bits alone one token a call (decode),
    whole, in chunks, or beside other sequences of other lengths; states saved inside equal
    the state at that point; the values are the recurrence's."""
    gen = _gen(9)
    hk, hv, dk, dv, lens = 2, 4, 32, 32, [7, 19, 1]
    t = sum(lens)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v, beta = torch.randn(t, hv, dv, generator=gen), torch.rand(t, hv, generator=gen)
    g = -torch.rand(t, hv, generator=gen)
    start = torch.randn(hv, dk, dv, generator=gen) * 0.1
    mine = slice(7, 26)  # the 19-token sequence
    parts = (q[mine], k[mine], v[mine], g[mine], beta[mine])

    def pool():
        return torch.stack([torch.zeros_like(start), start, start, torch.zeros_like(start)])

    with torch.inference_mode(), BatchInvariantOps():
        together, pool_a = pool(), pool()
        out = recurrent_gated_delta_rule_varlen(
            q, k, v, g, beta, lens, together, torch.tensor([0, 1, 3]), [[], [(2, 11)], []]
        )
        alone = [
            recurrent_gated_delta_rule_varlen(
                *(x[i : i + 1] for x in parts), [1], pool_a, torch.tensor([1])
            )
            for i in range(19)
        ]
        chunked, pool_c = [], pool()
        for lo, hi in ((0, 11), (11, 12), (12, 19)):
            chunked.append(
                recurrent_gated_delta_rule_varlen(
                    *(x[lo:hi] for x in parts), [hi - lo], pool_c, torch.tensor([1])
                )
            )
            if hi == 11:
                saved = pool_c[1].clone()
    assert torch.equal(out[mine], torch.cat(alone)) and torch.equal(out[mine], torch.cat(chunked))
    assert torch.equal(together[1], pool_a[1]) and torch.equal(together[1], pool_c[1])
    assert torch.equal(together[2], saved)
    want, state = recurrent_gated_delta_rule(*parts, start)
    assert rel_err(out[mine], want) < 1e-5 and rel_err(together[1], state) < 1e-5
