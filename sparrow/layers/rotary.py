"""Partial rotary embedding with interleaved multimodal sections (mRoPE), optionally YaRN-scaled.

Only the first `rotary_dim` of each head's dims rotate (NeoX halves); the rest pass through.
Text tokens have equal temporal/height/width positions, which reduces mRoPE to plain RoPE.
The rotation by these tables is fused with the q/k norm (`kernels.rms_norm.naive.apply_rotary`
defines it). cos and sin are computed per step from the step's positions (no table over the
whole context: a 1M-token context costs nothing until its positions are used).

YaRN (`rope_type: "yarn"`) follows HF 5.17's `modeling_rope_utils._compute_yarn_parameters`:
frequencies between the correction dims blend interpolation (divided by `factor`) with
extrapolation, and cos and sin are multiplied by the attention factor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sparrow.config import ConfigError

ROPE_TYPES = ("default", "yarn")


def _ramp(low: float, high: float, n: int) -> torch.Tensor:
    """[n] fp32: 0 up to index `low`, rising linearly to 1 at `high`."""
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    steps = torch.arange(n, dtype=torch.float32, device="cpu")  # models are built on "meta"
    return torch.clamp((steps - low) / (high - low), 0, 1)


def _correction_dim(rotations: float, dim: int, theta: float, max_positions: int) -> float:
    """The (fractional) dim index whose frequency turns `rotations` times in `max_positions`."""
    return (dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters as HF's `rope_parameters` names them; `beta_fast` and `beta_slow` hold
    the values HF uses (32 and 1 when a config leaves them out, or gives 0 or null)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor (and the mscales)
    truncate: bool = True  # round the correction range outwards to whole dims

    def __post_init__(self) -> None:
        if not self.factor > 0 or self.original_max_position_embeddings < 1:
            raise ConfigError(
                f"yarn needs factor > 0 and original_max_position_embeddings "
                f">= 1, got {self.factor} and "
                f"{self.original_max_position_embeddings}"
            )

    @classmethod
    def from_hf(
        cls, rope: dict[str, Any], max_position_embeddings: int, original: int | None = None
    ) -> YarnScaling:
        """From a `rope_parameters` dict of rope_type "yarn". `original`: a text config's own
        `original_max_position_embeddings` key, which HF puts before the one in `rope`; with
        neither, HF takes max_position_embeddings. A null `factor` is max_position_embeddings
        over the original length; a missing one is an error, as in HF."""
        if "factor" not in rope:
            raise ConfigError("rope_parameters of rope_type 'yarn' need a 'factor'")
        if original is None:
            original = rope.get("original_max_position_embeddings", max_position_embeddings)
        original = int(original)
        factor = rope["factor"]
        factor = max_position_embeddings / original if factor is None else float(factor)

        def optional(key: str) -> float | None:
            return None if rope.get(key) is None else float(rope[key])

        return cls(
            factor,
            original,
            float(rope.get("beta_fast") or 32),
            float(rope.get("beta_slow") or 1),
            optional("mscale"),
            optional("mscale_all_dim"),
            optional("attention_factor"),
            bool(rope.get("truncate", True)),
        )

    def to_hf(self) -> dict[str, Any]:
        """The keys this adds to a `rope_parameters` dict (None values left out)."""
        return {"rope_type": "yarn"} | {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def max_positions(self) -> int:
        """The context the scaling reaches: original length x factor (what vLLM allows)."""
        return int(self.original_max_position_embeddings * self.factor)

    def attention_scaling(self) -> float:
        """The factor on cos and sin."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return float(
                _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
            )
        return _mscale(self.factor)

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """[dim / 2] fp32 inverse frequencies of a rotary width `dim`."""
        pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        original = self.original_max_position_embeddings
        low = _correction_dim(self.beta_fast, dim, theta, original)
        high = _correction_dim(self.beta_slow, dim, theta, original)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        extrapolated = 1 - _ramp(max(low, 0), min(high, dim - 1), dim // 2)
        return interpolation * (1 - extrapolated) + extrapolation * extrapolated


class RotaryEmbedding:
    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        mrope_section: tuple[int, ...],
        scaling: YarnScaling | None = None,
    ):
        self.rotary_dim = rotary_dim
        if scaling is None:
            # Explicitly on the CPU: models are built under torch.device("meta").
            steps = torch.arange(0, rotary_dim, 2, device="cpu").float() / rotary_dim
            self.inv_freq = 1.0 / (theta**steps)
            self.attention_scaling = 1.0
        else:
            self.inv_freq = scaling.inv_freq(rotary_dim, theta)
            self.attention_scaling = scaling.attention_scaling()
        # Frequency j takes its position from axis 1 (H) if j % 3 == 1 and j < 3 * sec[1],
        # from axis 2 (W) if j % 3 == 2 and j < 3 * sec[2], else from axis 0 (T).
        axis = torch.zeros(rotary_dim // 2, dtype=torch.long, device="cpu")
        for dim, offset in ((1, 1), (2, 2)):
            axis[offset : 3 * mrope_section[dim] : 3] = dim
        self.axis = axis
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions: [T] (text) or [3, T] (t/h/w). Returns cos, sin: [T, rotary_dim], each
        times the attention scaling (in fp32, then cast to `dtype`, as HF does)."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        device = positions.device
        if device not in self._tables:  # copied once per device, from pinned memory on a
            # GPU: such a copy is legal while a CUDA graph is being captured
            self._tables[device] = tuple(
                t.pin_memory().to(device, non_blocking=True)
                if device.type == "cuda"
                else t.to(device)
                for t in (self.inv_freq, self.axis)
            )
        inv_freq, axis = self._tables[device]
        freqs = positions.float()[:, :, None] * inv_freq  # [3, T, R/2]
        freqs = freqs.gather(0, axis.expand(1, freqs.shape[1], -1))[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def mrope_positions(
    num_tokens: int, media: list[tuple[int, tuple[int, int, int]]], merge: int
) -> tuple[torch.Tensor, int]:
    """Qwen3.5/3.6's (t, h, w) positions of a prompt of `num_tokens` whose media placeholder
    runs start at the given offsets with the given grids (patches, before the merge), as HF
    5.17 `get_rope_index` lays them out: text counts on from the last position on all three
    axes; a run of t x (h/merge) x (w/merge) tokens takes t, h and w offsets from where it
    starts, and the text after it resumes max(h, w) / merge later. A video's grid arrives
    split into its frames (t = 1 each: its frames are separated by timestamps), so pass each
    frame's run apart. Returns (positions [3, num_tokens] int64, delta): tokens after the
    prompt take position index + delta on every axis."""
    out = torch.empty(3, num_tokens, dtype=torch.long)
    pos = cursor = 0
    for start, (t, h, w) in sorted(media):
        gh, gw = h // merge, w // merge
        if start < cursor or start + t * gh * gw > num_tokens:
            raise ValueError(
                f"media run at {start} ({t * gh * gw} tokens) overlaps another "
                f"or passes the prompt's {num_tokens} tokens"
            )
        out[:, cursor:start] = torch.arange(pos, pos + start - cursor)
        pos += start - cursor
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        ).reshape(3, -1)
        cursor = start + grid.shape[1]
        out[:, start:cursor] = grid + pos
        pos += max(gh, gw)
    out[:, cursor:] = torch.arange(pos, pos + num_tokens - cursor)
    return out, int(out.max()) + 1 - num_tokens if num_tokens else 0
