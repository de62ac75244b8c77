"""Zero-centred RMSNorm kernels vs naive.py: plain, fused with the residual add, fused with
the q/k rotary embedding on a strided view of a projection."""

import pytest
import torch

from sparrow.kernels.rms_norm import naive
from sparrow.kernels.rms_norm import norm as kernels
from tests.conftest import rel_err

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _rand(*shape, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rows, dim, dtype", [(1, 64, torch.float32), (7, 48, torch.float32), (5, 2048, torch.float16)]
)
def test_add_rms_norm(device, rows, dim, dtype):
    x, r = (
        _rand(rows, dim, device=device, dtype=dtype),
        _rand(rows, dim, device=device, dtype=dtype, seed=1),
    )
    w = _rand(dim, device=device, dtype=dtype, seed=2) * 0.1
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert rel_err(kernels.rms_norm(x, w, 1e-6), naive.rms_norm(x, w, 1e-6)) < tol
    s, y = kernels.add_rms_norm(x, r, w, 1e-6)
    s_ref, y_ref = naive.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, s_ref) and rel_err(y, y_ref) < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "heads, dim, rot, dtype",
    [(3, 32, 16, torch.float32), (2, 16, 16, torch.float32), (4, 64, 16, torch.float16)],
)
def test_rms_norm_rope_on_a_strided_view(device, heads, dim, rot, dtype):
    t = 5
    proj = _rand(t, heads, 2 * dim, device=device, dtype=dtype)  # [q | gate] per head
    q = proj[..., :dim]
    w = _rand(dim, device=device, dtype=dtype, seed=3) * 0.1
    angles = _rand(t, rot // 2, device=device, dtype=torch.float32, seed=4)
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    out = kernels.rms_norm_rope(q, w, 1e-6, cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    assert out.is_contiguous() and rel_err(out, naive.rms_norm_rope(q, w, 1e-6, cos, sin)) < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_k_norm_rope_writes_k_and_v_to_the_cache(device, dtype):
    """The attention layer's K/V step: k normed and rotated, k and v stored at cache rows
    (out of order; v a strided view of the fused projection), other rows untouched."""
    t, heads, dim, rot = 4, 2, 32, 16
    proj = _rand(t, heads, 2 * dim, device=device, dtype=dtype)  # [k | v] per head
    k, v = proj[..., :dim], proj[..., dim:]
    w = _rand(dim, device=device, dtype=dtype, seed=3) * 0.1
    angles = _rand(t, rot // 2, device=device, dtype=torch.float32, seed=4)
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    rows = torch.tensor([9, 2, 5, 0], device=device)
    caches = [torch.full((12, heads, dim), 7.0, device=device, dtype=dtype) for _ in range(4)]
    out = kernels.rms_norm_rope(k, w, 1e-6, cos, sin, (v, caches[0], caches[1], rows))
    ref = naive.rms_norm_rope(k, w, 1e-6, cos, sin, (v, caches[2], caches[3], rows))
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    assert rel_err(out, ref) < tol and rel_err(caches[0], caches[2]) < tol
    assert torch.equal(caches[1], caches[3])
