"""The gated delta rule in plain PyTorch: the spec the Triton kernels are tested against.

For one sequence, with per-v-head decay g_t = log(alpha_t) <= 0 and write strength beta_t:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

State S is [Hv, Dk, Dv], computed in fp32; a pool may keep it in bf16 between calls (read
into fp32, rounded once when stored, as the kernels do). q/k have Hk heads; v-head h reads
q/k head h // (Hv / Hk). q and k are L2-normalised here (eps 1e-6 inside the rsqrt) and q
is scaled by Dk^-0.5.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """fp32 copies in [H, T, D] layout, q/k normalised, scaled and repeated to Hv heads."""
    hv, hk = v.shape[1], q.shape[1]
    q, k = (l2norm(x.float()).repeat_interleave(hv // hk, dim=1) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))
    return q, k, v, g.float().transpose(0, 1), beta.float().transpose(0, 1)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form. q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv];
    state: [Hv, Dk, Dv] (fp32 or bf16). Returns (o [T, Hv, Dv] fp32, new state fp32)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        k_t = k[:, t]
        delta = (v[:, t] - torch.einsum("hkv,hk->hv", s, k_t)) * beta[:, t, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", s, q[:, t])
    return out.transpose(0, 1), s


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
    states_at: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Chunked form, same arguments and result as `recurrent_gated_delta_rule`; with
    `states_at` (token counts in (0, T]) also the fp32 states after those many tokens, taken
    inside the scan, as a third item.

    Within a chunk, with G_t the cumulative log-decay from the chunk start and S_0 the
    incoming state, the delta-rule "new values" u solve a unit lower-triangular system
        (I + A) u = beta * (v - exp(G) k S_0),   A[t, s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)
    and then o_t = exp(G_t) S_0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) u_s,
             S_C = exp(G_C) S_0 + sum_s exp(G_C - G_s) k_s u_s^T,
    and the state after the chunk's first m tokens is that sum over s < m with G_m-1 for G_C
    (u_s depends on the tokens up to s only).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    h, t_len, _ = q.shape
    pad = (-t_len) % chunk_size
    if pad:
        # Padded steps have k = v = 0 and g = 0: they leave the state unchanged.
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (t_len + pad) // chunk_size
    q, k, v = (x.reshape(h, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(h, n, chunk_size) for x in (g, beta))

    cum = g.cumsum(-1)  # [H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = ((k @ k.transpose(-1, -2)) * decay * beta[..., :, None]).tril(-1)
    eye = torch.eye(chunk_size, dtype=a.dtype, device=a.device)
    system = eye + a
    u_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)
    u_state = torch.linalg.solve_triangular(system, k * (beta * cum.exp())[..., None], upper=False)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]

    s = state.float()
    out = torch.empty_like(v)
    inside: dict[int, torch.Tensor] = {}
    for i in range(n):
        u = u_values[:, i] - u_state[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + qk[:, i] @ u
        for at in states_at:
            m = at - i * chunk_size
            if 0 < m <= chunk_size:
                g_m = cum[:, i, m - 1]
                k_to_m = k[:, i, :m] * (g_m[:, None] - cum[:, i, :m]).exp()[..., None]
                inside[at] = s * g_m.exp()[:, None, None] + k_to_m.transpose(-1, -2) @ u[:, :m]
        s = s * cum[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.reshape(h, n * chunk_size, -1)[:, :t_len].transpose(0, 1)
    if states_at:
        return out, s, [inside[at] for at in states_at]
    return out, s


def recurrent_step_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One decode token for each of B sequences at once, with no host reads (it can be
    captured in a CUDA graph). q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv];
    state_pool: [S, Hv, Dk, Dv] fp32 or bf16, rows `slots` [B] read and updated in place (in
    fp32, rounded to the pool's dtype when stored). Returns o [B, Hv, Dv] fp32 (from the fp32
    state): `recurrent_gated_delta_rule` with T = 1 per sequence."""
    rows = slots.long()
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [Hv, B, D] and [Hv, B]
    s = state_pool[rows].float() * g.t().exp()[:, :, None, None]  # [B, Hv, Dk, Dv]
    k_b, q_b = k.transpose(0, 1), q.transpose(0, 1)  # [B, Hv, Dk]
    delta = (v.transpose(0, 1) - torch.einsum("bhkv,bhk->bhv", s, k_b)) * beta.t()[..., None]
    s = s + k_b[..., None] * delta[:, :, None, :]
    state_pool.index_copy_(0, rows, s.to(state_pool.dtype))
    return torch.einsum("bhkv,bhk->bhv", s, q_b)


def recurrent_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seq_lens: list[int],
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    saves: Sequence[Sequence[tuple[int, int]]] = (),
) -> torch.Tensor:
    """Token by token, B sequences back to back: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta
    [T, Hv]; seq_lens [B] (host). The sequences with a token left advance together: step i
    takes each one's i-th token, its state read from `state_pool` rows `slots` [B] and stored
    back in the pool's dtype, as a decode step does. saves[b]: (pool row, tokens) pairs, the
    state after that many of sequence b's tokens copied to the row. Each product is a matmul
    of one key (query) row by the state, [B, Hv, 1, Dk] @ [B, Hv, Dk, Dv]: under
    `kernels.batch_invariant` (GEMMs of at least 16 rows, whatever their batch) a state and a
    token's output are the same bits whichever sequences step beside it and however its
    tokens are split into steps. Returns o [T, Hv, Dv] fp32."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [Hv, T, D] and [Hv, T]
    decay = g.exp()
    starts = [0, *itertools.accumulate(seq_lens)]
    out = torch.empty_like(v)
    for i in range(max(seq_lens, default=0)):
        active = [b for b, n in enumerate(seq_lens) if n > i]
        t = torch.tensor([starts[b] + i for b in active], device=q.device)
        rows = slots[torch.tensor(active, device=q.device)].long()
        s = state_pool[rows].float() * decay[:, t].t()[:, :, None, None]  # [A, Hv, Dk, Dv]
        k_t, q_t = (x[:, t].transpose(0, 1)[:, :, None] for x in (k, q))  # [A, Hv, 1, Dk]
        delta = (v[:, t].transpose(0, 1) - (k_t @ s)[:, :, 0]) * beta[:, t].t()[..., None]
        s = s + k_t.transpose(-1, -2) * delta[:, :, None, :]
        state_pool.index_copy_(0, rows, s.to(state_pool.dtype))
        out[:, t] = (q_t @ s)[:, :, 0].transpose(0, 1)
        for b in active:
            for row, at in saves[b] if saves else ():
                if at == i + 1:
                    state_pool[row] = state_pool[slots[b]]
    return out.transpose(0, 1)
