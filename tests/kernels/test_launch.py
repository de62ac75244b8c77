"""Launches through the compiled kernel (`launch.fast`): the same results as the JIT's, one
compiled kernel per specialisation."""

import pytest
import torch
import triton
import triton.language as tl

from sparrow.kernels.launch import _spec, fast


@triton.jit
def _scaled_copy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, PLUS_ONE: tl.constexpr = False):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b_x = tl.load(x_ptr + o, mask=o < n, other=0.0) * scale
    if PLUS_ONE:
        b_x += 1.0
    tl.store(y_ptr + o, b_x, mask=o < n)


def _copy(x, y, n, scale=2.0, block=64, **kw):
    fast(_scaled_copy)[(triton.cdiv(n, block),)](x, y, n, scale, BLOCK=block, **kw)


def test_spec_separates_what_triton_specialises_on():
    buf = torch.zeros(64)
    assert _spec(buf) != _spec(buf[1:])  # 16-byte aligned or not
    assert _spec(buf) != _spec(buf.half())
    assert len({_spec(1), _spec(16), _spec(17), _spec(33)}) == 3  # 17 and 33 alike
    assert _spec(16) != _spec(2**32)  # beyond int32
    assert _spec(True) != _spec(1)
    k = fast(_scaled_copy)
    assert k._key((buf, buf, 8, 2.0), {"BLOCK": 64}) != k._key((buf, buf, 8, 2.0), {"BLOCK": 128})


def test_cpu_tensors_take_the_jit_path():
    """Under the interpreter (CPU tensors) nothing is cached; results as the JIT's."""
    x = torch.arange(100, dtype=torch.float32)
    y = torch.zeros(100)
    _copy(x, y, 100, PLUS_ONE=True)
    torch.testing.assert_close(y, 2 * x + 1)
    assert not fast(_scaled_copy)._compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cached_launches_match_the_jit():
    k = fast(_scaled_copy)
    k._compiled.clear()
    base = torch.randn(4096, device="cuda")
    for offset, n in [(0, 4096), (1, 4000), (0, 1), (0, 17), (4, 1000), (1, 4000), (0, 4096)]:
        x = base[offset:]
        for block, scale in [(64, 2.0), (256, -0.5)]:
            y = torch.full_like(base, 7.0)
            _copy(x, y, n, scale, block)  # twice: the second launch comes from the cache
            _copy(x, y, n, scale, block)
            expected = torch.full_like(base, 7.0)
            expected[:n] = x[:n] * scale
            torch.testing.assert_close(y, expected)
    # aligned/unaligned x, n = 1, divisible by 16 or not, two blocks: distinct kernels only
    assert 4 <= len(k._compiled) <= 12
    y = torch.zeros_like(base)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _copy(base, y, 4096, 3.0)
    graph.replay()
    torch.testing.assert_close(y, base * 3)
