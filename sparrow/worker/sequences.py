"""Drive the model for a fixed set of sequences with a private cache: the plain path for
tests, comparisons and single-prompt generation (the engine uses the scheduler instead)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparrow.core.cache_spec import required_block_size, with_index_dtype, with_state_dtype
from sparrow.worker.cache import ModelCache, build_metadata


class SequenceBatch:
    """Sequence b owns a contiguous run of blocks and recurrent-state slot b. Blocks are of
    `block_size` tokens (None: the model's MSA block if it has one, else 16); MSA index keys
    are kept as `index_dtype` (`CacheConfig.index_cache_dtype`), recurrent states as
    `state_dtype` (`CacheConfig.recurrent_state_dtype`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_seqs: int,
        max_len: int,
        block_size: int | None = None,
        index_dtype: str = "auto",
        state_dtype: str = "float32",
    ):
        self.model = model
        specs = with_state_dtype(with_index_dtype(model.cache_specs(), index_dtype), state_dtype)
        block_size = block_size or required_block_size(specs) or 16
        per_seq = -(-max_len // block_size)
        self.cache = ModelCache(
            specs, num_seqs * per_seq, block_size, num_seqs, model.device, model.dtype
        )
        self.tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(num_seqs)]
        self.computed = [0] * num_seqs
        self.max_len = max_len

    @torch.inference_mode()
    def forward(self, tokens: Sequence, seqs: Sequence[int] | None = None) -> torch.Tensor:
        """Append tokens[i] (ids, list or 1-D tensor) to sequence seqs[i] (default: i) and run
        them. Returns hidden states [sum of lengths, hidden] in that order."""
        seqs = list(range(len(tokens))) if seqs is None else list(seqs)
        tokens = [t.tolist() if isinstance(t, torch.Tensor) else list(t) for t in tokens]
        if any(self.computed[s] + len(t) > self.max_len for s, t in zip(seqs, tokens, strict=True)):
            raise ValueError(f"a sequence would exceed max_len={self.max_len}")
        meta = build_metadata(
            tokens,
            [self.computed[s] for s in seqs],
            [self.tables[s] for s in seqs],
            seqs,
            self.cache.block_size,
            self.model.device,
        )
        hidden = self.model(meta, self.cache)
        for s, t in zip(seqs, tokens, strict=True):
            self.computed[s] += len(t)
        return hidden
