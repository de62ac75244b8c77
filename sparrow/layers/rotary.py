"""Partial rotary embedding with interleaved multimodal sections (mRoPE).

Only the first `rotary_dim` of each head's dims rotate (NeoX halves); the rest pass through.
Text tokens have equal temporal/height/width positions, which reduces mRoPE to plain RoPE.
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
        if device not in self._tables:  # copied once per device (no copies in a graph)
            self._tables[device] = (self.inv_freq.to(device), self.axis.to(device))
        inv_freq, axis = self._tables[device]
        freqs = positions.float()[:, :, None] * inv_freq  # [3, T, R/2]
        freqs = freqs.gather(0, axis.expand(1, freqs.shape[1], -1))[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, R] with R <= D. Rotates the first R dims of every head."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    x_rot = x_rot * cos[:, None] + rotated * sin[:, None]
    return torch.cat((x_rot, x_pass), dim=-1)
