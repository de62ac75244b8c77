"""Batch-invariant CPU numerics: a row of a step's result is the same bits whatever else
the step holds (`EngineConfig.device.batch_invariant`, `--batch-invariant`).

Two kinds of torch CPU op give a row's values that depend on the rest of the tensor
(torch 2.13, MKL sgemm, AVX-512; `tests/kernels/test_batch_invariant_ops.py` checks both on
the running platform, so a platform that breaks them fails there):

- a GEMM's rows depend on its row count below 16 rows (1-3 take a GEMV, 5, 7 and 9 other
  kernels), never from 16 on: every row is the same bits at any count >= 16 and at any
  position. `BatchInvariantOps` runs every mm / addmm / bmm / baddbmm on at least
  `MIN_ROWS` rows (zero rows appended, then sliced off);
- sigmoid, silu and softplus compute the elements past a tensor's last full vector (and
  past each thread's share) with a scalar formula an ulp apart from the vector one, so an
  element's value depends on where it falls. Under `BatchInvariantOps` they are composed
  of exp and log1p (which take one formula at every position) and exactly rounded
  arithmetic.

Row-wise reductions (sum, mean, amax, softmax, log_softmax, cumsum over the last dim) and
exactly rounded elementwise ops are the same bits per row already. What the mode cannot fix
op by op, the layers choose in it: attention over fixed-size key blocks for prefill and
decode alike (`kernels.attention.naive.blocked_attention`), Gated DeltaNet and its conv one
token at a time per sequence (`GatedDeltaNet._mix_token_by_token`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

MIN_ROWS = 16


def _rows(op, a: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
    """op(a, *rest), a GEMM whose output rows are a's rows (dim -2 of both), with a grown to
    MIN_ROWS rows (zero rows appended) and the output cut back."""
    m = a.shape[-2]
    if m >= MIN_ROWS:
        return op(a, *rest, **kwargs)
    return op(_grown(a), *rest, **kwargs)[..., :m, :].contiguous()


def _grown(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows (dim -2) appended up to MIN_ROWS."""
    pad = x.new_zeros(*x.shape[:-2], MIN_ROWS - x.shape[-2], x.shape[-1])
    return torch.cat((x, pad), dim=-2)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _rows(aten.mm.default, a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1) -> torch.Tensor:
    if bias.dim() == 2 and bias.shape[0] > 1:
        bias = _grown(bias) if bias.shape[0] < MIN_ROWS else bias
    return _rows(lambda a, b: aten.addmm.default(bias, a, b, beta=beta, alpha=alpha), a, b)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _rows(aten.bmm.default, a, b)


def _baddbmm(bias, a, b, *, beta=1, alpha=1) -> torch.Tensor:
    if bias.dim() == 3 and bias.shape[1] > 1:
        bias = _grown(bias) if bias.shape[1] < MIN_ROWS else bias
    return _rows(lambda a, b: aten.baddbmm.default(bias, a, b, beta=beta, alpha=alpha), a, b)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = _rows(aten.linear.default, x.reshape(-1, x.shape[-1]), w, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() < 2 or b.dim() < 2:  # products with a vector: decomposed
        return NotImplemented
    return _rows(aten.matmul.default, a, b)


def _in_fp32(fn):
    """fn computed in fp32 (once rounded back for 16-bit inputs, as torch's own kernels)."""

    def run(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return fn(x.float(), *args, **kwargs).to(x.dtype)

    return run


@_in_fp32
def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


@_in_fp32
def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


@_in_fp32
def _softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    bx = x * beta
    return torch.where(bx > threshold, x, torch.log1p(torch.exp(bx)) / beta)


def _in_place(fn):
    def run(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x.copy_(fn(x, *args, **kwargs))

    return run


_OPS = {
    aten.linear.default: _linear,
    aten.matmul.default: _matmul,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten.baddbmm.default: _baddbmm,
    aten.sigmoid.default: _sigmoid,
    aten.sigmoid_.default: _in_place(_sigmoid),
    aten.silu.default: _silu,
    aten.silu_.default: _in_place(_silu),
    aten.softplus.default: _softplus,
}


# composite ops with GEMMs inside, decomposed so that their GEMMs arrive here (linear and
# matmul, far more frequent, are padded whole)
_DECOMPOSED = {
    aten.einsum.default,
    aten.tensordot.default,
    aten.bilinear.default,
    aten.inner.default,
    aten.chain_matmul.default,
    aten.linalg_multi_dot.default,
    aten.matmul.default,
}


class BatchInvariantOps(TorchDispatchMode):
    """Within it, the ops of the module docstring take their batch-invariant form; every
    other op runs as it is. Enter it around a step: forward, LM head and sampling (under
    inference mode composite ops arrive whole: linear and matmul are padded as such, einsum
    and its kind decomposed here so that their GEMMs arrive too)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing compiles under it: no Dynamo guard on every op (~3 us each)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _OPS.get(func)
        out = NotImplemented if op is None else op(*args, **kwargs)
        if out is NotImplemented and func in _DECOMPOSED:
            with self:
                out = func.decompose(*args, **kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        return out
