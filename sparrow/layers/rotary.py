"""Partial rotary embedding with interleaved multimodal sections (mRoPE).

Only the first `rotary_dim` of each head's dims rotate (NeoX halves); the rest pass through.
Text tokens have equal temporal/height/width positions, which reduces mRoPE to plain RoPE.
The rotation by these tables is fused with the q/k norm (`kernels.rms_norm.naive.apply_rotary`
defines it).
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, rotary_dim: int, theta: float, mrope_section: tuple[int, ...]):
        self.rotary_dim = rotary_dim
        # Explicitly on the CPU: models are built under torch.device("meta").
        steps = torch.arange(0, rotary_dim, 2, device="cpu").float() / rotary_dim
        self.inv_freq = 1.0 / (theta**steps)
        # Frequency j takes its position from axis 1 (H) if j % 3 == 1 and j < 3 * sec[1],
        # from axis 2 (W) if j % 3 == 2 and j < 3 * sec[2], else from axis 0 (T).
        axis = torch.zeros(rotary_dim // 2, dtype=torch.long, device="cpu")
        for dim, offset in ((1, 1), (2, 2)):
            axis[offset : 3 * mrope_section[dim] : 3] = dim
        self.axis = axis
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions: [T] (text) or [3, T] (t/h/w). Returns cos, sin: [T, rotary_dim]."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        device = positions.device
        if device not in self._tables:  # copied once per device, from pinned memory on a
            # GPU: such a copy is legal while a CUDA graph is being captured
            self._tables[device] = tuple(t.pin_memory().to(device, non_blocking=True)
                                         if device.type == "cuda" else t.to(device)
                                         for t in (self.inv_freq, self.axis))  # fmt: skip
        inv_freq, axis = self._tables[device]
        freqs = positions.float()[:, :, None] * inv_freq  # [3, T, R/2]
        freqs = freqs.gather(0, axis.expand(1, freqs.shape[1], -1))[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

