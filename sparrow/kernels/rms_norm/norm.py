"""Zero-centred RMSNorm kernels: one row per program, the whole row in registers.

`add_rms_norm` fuses the residual add with the next norm (one read of each input, one write
of the sum and one of the normed row); `rms_norm_rope` fuses the per-head q/k norm of the
attention layer with its partial rotary embedding (NeoX halves on the first R dims), reading
the head straight out of the projection's output (any row and head stride).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.launch import fast
from sparrow.kernels.pdl import launch_args, wait_for_previous


@triton.jit
def _inv_rms(b_x, eps, D: tl.constexpr):
    """1 / rms of a whole row b_x (fp32; masked entries 0)."""
    return tl.rsqrt(tl.sum(b_x * b_x) / D + eps)


@triton.jit
def _scaled(b_x, inv_rms, w_ptr, o_d, m_d):
    """Values b_x at dims o_d, normalised: b_x / rms * (1 + w[o_d])."""
    return b_x * inv_rms * (1.0 + tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32))


@triton.jit
def _add_norm_kernel(
    x_ptr,
    r_ptr,
    s_ptr,
    y_ptr,
    w_ptr,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64) * D
    o_d = tl.arange(0, BLOCK)
    m_d = o_d < D
    b_x = tl.load(x_ptr + row + o_d, mask=m_d, other=0.0)
    if HAS_RESIDUAL:
        b_x = b_x + tl.load(r_ptr + row + o_d, mask=m_d, other=0.0)  # rounded like torch
        tl.store(s_ptr + row + o_d, b_x, mask=m_d)
    b_x = b_x.to(tl.float32)
    b_y = _scaled(b_x, _inv_rms(b_x, eps, D), w_ptr, o_d, m_d)
    tl.store(y_ptr + row + o_d, b_y.to(y_ptr.dtype.element_ty), mask=m_d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `naive.rms_norm` for contiguous x [..., D]."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Same contract as `naive.add_rms_norm`: returns (residual + x, its norm)."""
    return _launch(x, residual, weight, eps)


def _launch(x, residual, weight, eps):
    d = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else x
    r = residual.contiguous() if residual is not None else x
    fast(_add_norm_kernel)[(x.numel() // d,)](
        x,
        r,
        s,
        y,
        weight,
        eps,
        HAS_RESIDUAL=residual is not None,
        D=d,
        BLOCK=triton.next_power_of_2(d),
        num_warps=4 if d >= 1024 else 1,
        **launch_args(y, (x.numel() // d,)),
    )
    return s, y


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    y_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    eps,
    stride_xt,
    stride_xh,
    stride_ct,
    v_ptr,
    kc_ptr,
    vc_ptr,
    rows_ptr,
    stride_vt,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    TO_CACHE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One (token, head) row. TO_CACHE: also store it at cache row rows[token] and copy the
    token's v row there (the K/V cache write of an attention layer)."""
    wait_for_previous(USE_PDL)
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = tl.arange(0, D)
    b_x = tl.load(x_ptr + i_t * stride_xt + i_h * stride_xh + o_d).to(tl.float32)
    inv_rms = _inv_rms(b_x, eps, D)
    b_n = _scaled(b_x, inv_rms, w_ptr, o_d, o_d < D).to(y_ptr.dtype.element_ty).to(tl.float32)
    # the rotation partner of dim d < R: d + R/2 (first half, negated) or d - R/2
    half: tl.constexpr = R // 2
    partner = tl.where(o_d < half, o_d + half, o_d - half)
    m_r = o_d < R
    b_p = tl.load(x_ptr + i_t * stride_xt + i_h * stride_xh + partner, mask=m_r, other=0.0)
    b_p = _scaled(b_p.to(tl.float32), inv_rms, w_ptr, partner, m_r)
    b_p = b_p.to(y_ptr.dtype.element_ty).to(tl.float32)
    b_cos = tl.load(cos_ptr + i_t * stride_ct + o_d, mask=m_r, other=1.0).to(tl.float32)
    b_sin = tl.load(sin_ptr + i_t * stride_ct + o_d, mask=m_r, other=0.0).to(tl.float32)
    rotated = tl.where(o_d < half, -b_p, b_p)
    b_y = tl.where(m_r, b_n * b_cos + rotated * b_sin, b_n)
    tl.store(y_ptr + (i_t * H + i_h) * D + o_d, b_y.to(y_ptr.dtype.element_ty))
    if TO_CACHE:
        row = tl.load(rows_ptr + i_t).to(tl.int64)
        tl.store(kc_ptr + (row * H + i_h) * D + o_d, b_y.to(kc_ptr.dtype.element_ty))
        b_v = tl.load(v_ptr + i_t * stride_vt + i_h * D + o_d)
        tl.store(vc_ptr + (row * H + i_h) * D + o_d, b_v.to(vc_ptr.dtype.element_ty))


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Same contract as `naive.rms_norm_rope`; x [T, H, D] and v may be strided views (unit
    stride on D, D a power of two); the caches are contiguous. Returns a contiguous
    [T, H, D]."""
    t, h, d = x.shape
    r = cos.shape[-1]
    if x.stride(-1) != 1 or d & (d - 1) or r > d or r % 2 or cos.shape != sin.shape:
        raise ValueError(f"x {list(x.shape)} (unit stride, D a power of two), cos/sin [T, R<=D]")
    y = torch.empty(t, h, d, device=x.device, dtype=x.dtype)
    cos, sin = cos.contiguous(), sin.contiguous()
    v, k_cache, v_cache, rows = cache if cache is not None else (y, y, y, y)
    if v.shape != x.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"v {list(v.shape)} must be shaped like x; the caches contiguous")
    if v.stride(2) != 1 or v.stride(1) != d:
        v = v.contiguous()  # the kernel takes a token stride only
    fast(_norm_rope_kernel)[(t, h)](
        x,
        y,
        weight,
        cos,
        sin,
        eps,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        v,
        k_cache,
        v_cache,
        rows,
        v.stride(0),
        H=h,
        D=d,
        R=r,
        TO_CACHE=cache is not None,
        num_warps=1 if d <= 256 else 4,
        **launch_args(y, (t, h)),
    )
    return y
