"""Gated DeltaNet (linear attention) layer of Qwen3.5/3.6 and Qwen3-Next with per-sequence
recurrent state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.core.cache_spec import RecurrentStateSpec
from sparrow.kernels import fits_tiles, use_triton
from sparrow.kernels.causal_conv1d.conv import causal_conv1d_varlen
from sparrow.kernels.causal_conv1d.naive import (
    causal_conv1d,
    causal_conv1d_step,
    causal_conv1d_tokens,
    conv_state_after,
)
from sparrow.kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_varlen
from sparrow.kernels.gated_delta_rule.fused_recurrent import (
    fused_recurrent_step,
    gated_rms_norm,
    gdn_gates,
)
from sparrow.kernels.gated_delta_rule.naive import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_varlen,
    recurrent_step_batched,
)
from sparrow.kernels.quant_gemv.gdn import quant_gemv_conv, quant_gemv_rms_scaled
from sparrow.layers.linear import Projections, is_quantized
from sparrow.layers.metadata import StepMetadata
from sparrow.layers.norms import GatedRMSNorm


class GatedDeltaNet(Projections, nn.Module):
    FUSED = {"in": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}

    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        fused_qkvz: bool = False,
    ):
        """fused_qkvz: the in-projections as Qwen3-Next stores them, `in_proj_qkvz` with rows
        [q, k, v, z] per key head (v and z of its Hv / Hk value heads) and `in_proj_ba` with
        rows [b, a] per key head; a tensor-parallel rank's block of key heads is one
        contiguous block of rows. Else Qwen3.5's `in_proj_qkv` ([q | k | v]), `in_proj_z`,
        `in_proj_b` and `in_proj_a`."""
        super().__init__()
        d = hidden
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim, self.kernel = 2 * self.key_dim + self.value_dim, conv_kernel  # [q | k | v]
        self.fused_qkvz = fused_qkvz
        if fused_qkvz:
            self.FUSED = {"in": ("in_proj_qkvz", "in_proj_ba")}
            self.in_proj_qkvz = nn.Linear(d, self.conv_dim + self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(d, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(d, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)
        self.kernels_fit = fits_tiles(self.head_k_dim, self.head_v_dim)

    def cache_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(
            self.conv_dim, self.kernel, (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        )

    def forward(
        self, x: torch.Tensor, meta: StepMetadata, cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """x: [T, hidden] (the step's new tokens); cache: this layer's conv pool
        [slots, C, K - 1] and recurrent pool [slots, Hv, Dk, Dv] (fp32 or bf16: updated in
        fp32, rounded when stored), indexed by meta.state_slots and updated in place; the
        states meta.save_rows names are stored on the way (prefix-cache snapshots)."""
        conv_pool, state_pool = cache
        fused = self._gemv_fusions(x, meta, conv_pool)
        if fused is not None:
            return self._decode_one_token(x, fused, meta, conv_pool, state_pool)
        mixed_qkv, z, b, a = self._in_projections(x)
        if use_triton(x) and self.kernels_fit:
            o = self._mix_kernels(mixed_qkv, a, b, z, meta, conv_pool, state_pool)
        else:
            o = self.norm(
                self._mix_reference(mixed_qkv, a, b, meta, conv_pool, state_pool).to(x.dtype), z
            )
        return self.out_proj(o.flatten(1))

    def _in_projections(self, x: torch.Tensor):
        """x [T, hidden] -> the conv input [T, C] ([q | k | v]), z [T, Hv, Dv], b and a
        [T, Hv]."""
        if not self.fused_qkvz:
            mixed_qkv, z, b, a = self.project("in", x)
            return mixed_qkv, z.unflatten(-1, (self.num_v_heads, self.head_v_dim)), b, a
        qkvz, ba = self.project("in", x)
        t, hk, r = x.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, group_v = self.head_k_dim, r * self.head_v_dim
        q, k, v, z = qkvz.unflatten(-1, (hk, -1)).split((dk, dk, group_v, group_v), dim=-1)
        b, a = ba.unflatten(-1, (hk, 2 * r)).split((r, r), dim=-1)
        # one copy into the conv's [q | k | v] layout (heads in order, value heads by group)
        mixed_qkv = qkvz.new_empty(t, self.conv_dim)
        for part, grouped in zip(
            mixed_qkv.split((self.key_dim, self.key_dim, self.value_dim), dim=-1),
            (q, k, v),
            strict=True,
        ):
            part.view(grouped.shape).copy_(grouped)
        z = z.reshape(t, self.num_v_heads, self.head_v_dim)
        return mixed_qkv, z, b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads)

    def _gemv_fusions(self, x: torch.Tensor, meta: StepMetadata, conv_pool):
        """The fused in-projection if this step is one decode token whose projections are
        4-bit GEMVs that can take the conv and the norm (`_decode_one_token`), else None.
        Not with `fused_qkvz`: the GEMV's conv epilogue reads its first C output rows as
        [q | k | v], which the per-key-head groups are not."""
        fused = self.fused("in")
        fits = (
            not self.fused_qkvz
            and use_triton(x)
            and self.kernels_fit
            and x.shape[0] == 1
            and meta.max_q_len == 1
            and fused is not None
            and is_quantized(fused.whole)
            and is_quantized(self.out_proj)
            and self.head_v_dim % self.out_proj.spec.group_size == 0
            and conv_pool.stride(1) == 1
        )
        return fused if fits else None

    def _decode_one_token(self, x, fused, meta, conv_pool, state_pool) -> torch.Tensor:
        """Batch-1 decode with 4-bit projections in three kernels: the in-projection GEMV
        with the conv step in its epilogue, the recurrent step over column blocks (8x the
        programs of a head per program) that leaves the gated norm's 1 / rms per head to the
        out-projection GEMV, which scales each head by it. Against the projections with the
        conv kernel and the step with the norm between them: see `bench.gdn`. Measured and
        not kept: the residual add and the input norm before the layer in the in-projection
        GEMV's prologue too (one kernel fewer per layer; the GEMV reads x and the residual,
        sums the row's squares, scales its sums by 1 / rms at the end): end to end at batch 1
        538.7 / 559.4 tok/s at 4K / 512 context against 542.0 / 557.4 without it, one run."""
        w = fused.whole
        y = quant_gemv_conv(
            x,
            w.weight,
            w.scales,
            w.biases,
            w.spec,
            self.conv1d.weight[:, 0],
            conv_pool,
            meta.state_slots,
        )
        qkv, z, b, a = fused.split(y)
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        gated, sq_sums = fused_recurrent_step(
            qkv,
            a,
            b,
            z,
            self.A_log,
            self.dt_bias,
            self.norm.weight,
            self.norm.eps,
            state_pool,
            meta.state_slots,
            self.num_k_heads,
            normed=False,
        )
        out = self.out_proj
        return quant_gemv_rms_scaled(
            gated, sq_sums, self.norm.eps, out.weight, out.scales, out.biases, out.spec, x.dtype
        )

    def _split_heads(self, qkv: torch.Tensor):
        q, k, v = qkv.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        return (
            q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            v.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
        )

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def _mix_reference(self, mixed_qkv, a, b, meta, conv_pool, state_pool) -> torch.Tensor:
        """naive.py's ops: [T, Hv, Dv] fp32. A decode step (one token per sequence) runs all
        sequences at once without host reads, so it can be captured in a CUDA graph; other
        steps run one sequence at a time, the states it saves inside a sequence taken inside
        its scan."""
        weight = self.conv1d.weight[:, 0]
        g, beta = self._decay(a), b.sigmoid()
        if meta.batch_invariant:
            return self._mix_token_by_token(mixed_qkv, g, beta, meta, conv_pool, state_pool)
        if meta.max_q_len == 1:
            slots = meta.state_slots
            qkv = causal_conv1d_step(mixed_qkv, conv_pool, slots, weight)
            return recurrent_step_batched(*self._split_heads(qkv), g, beta, state_pool, slots)
        outs = []
        pieces = zip(
            mixed_qkv.split(meta.seq_lens),
            g.split(meta.seq_lens),
            beta.split(meta.seq_lens),
            meta.state_slots.tolist(),
            _saves(meta),
            strict=True,
        )
        for qkv_s, g_s, beta_s, slot, saves in pieces:
            for row, at in saves:
                conv_pool[row] = conv_state_after(qkv_s, conv_pool[slot], at)
            qkv_s, conv_pool[slot] = causal_conv1d(qkv_s, conv_pool[slot], weight)
            heads = self._split_heads(qkv_s)
            if len(qkv_s) == 1:
                o, state_pool[slot] = recurrent_gated_delta_rule(
                    *heads, g_s, beta_s, state_pool[slot]
                )
            elif saves:
                o, state_pool[slot], inside = chunk_gated_delta_rule(
                    *heads, g_s, beta_s, state_pool[slot], states_at=[at for _, at in saves]
                )
                for (row, _), state in zip(saves, inside, strict=True):
                    state_pool[row] = state
            else:
                o, state_pool[slot] = chunk_gated_delta_rule(*heads, g_s, beta_s, state_pool[slot])
            outs.append(o)
        return torch.cat(outs)

    def _mix_token_by_token(self, mixed_qkv, g, beta, meta, conv_pool, state_pool):
        """Batch-invariant mode (`kernels.batch_invariant`): the conv and the recurrence in
        a decode step's arithmetic for every token, the step's sequences advancing a token at
        a time together, so a state after n tokens is the same bits however they came (one
        prompt, chunks, decode steps, beside any other sequences), and so is each token's
        output. Returns [T, Hv, Dv] fp32."""
        weight, saves = self.conv1d.weight[:, 0], _saves(meta)
        slots = meta.state_slots.tolist()
        for x_b, slot, saves_b in zip(mixed_qkv.split(meta.seq_lens), slots, saves, strict=True):
            for row, at in saves_b:
                conv_pool[row] = conv_state_after(x_b, conv_pool[slot], at)
        qkv = causal_conv1d_tokens(mixed_qkv, meta.seq_lens, conv_pool, meta.state_slots, weight)
        return recurrent_gated_delta_rule_varlen(
            *self._split_heads(qkv), g, beta, meta.seq_lens, state_pool, meta.state_slots, saves
        )

    def _mix_kernels(self, mixed_qkv, a, b, z, meta, conv_pool, state_pool) -> torch.Tensor:
        """Conv, then the fused recurrent step with the gated norm when every sequence brings
        one token (decode), else the chunked scan and the norm kernel. Returns the normed
        output [T, Hv, Dv] in the activation dtype."""
        slots = meta.state_slots
        weight = self.conv1d.weight[:, 0]
        saves = {"save_rows": meta.save_rows, "save_at": meta.save_at}
        qkv = causal_conv1d_varlen(
            mixed_qkv, meta.cu_seqlens, conv_pool, slots, weight, max_len=meta.max_q_len, **saves
        )
        if meta.max_q_len == 1:
            return fused_recurrent_step(
                qkv,
                a,
                b,
                z,
                self.A_log,
                self.dt_bias,
                self.norm.weight,
                self.norm.eps,
                state_pool,
                slots,
                self.num_k_heads,
            )
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        o = chunk_gated_delta_rule_varlen(
            *self._split_heads(qkv),
            g,
            beta,
            meta.cu_seqlens,
            state_pool,
            slots,
            max_len=meta.max_q_len,
            **saves,
        )
        return gated_rms_norm(o, z, self.norm.weight, self.norm.eps)


def _saves(meta: StepMetadata) -> list[list[tuple[int, int]]]:
    """Per sequence, the (pool row, tokens) of the states it saves inside the step (host)."""
    if meta.save_rows is None:
        return [[] for _ in meta.seq_lens]
    return [
        [(row, at) for row, at in zip(rows, ats, strict=True) if row >= 0]
        for rows, ats in zip(meta.save_rows.tolist(), meta.save_at.tolist(), strict=True)
    ]
