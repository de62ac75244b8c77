"""The images and videos of running requests on the worker: each item's tower embeddings,
computed when a step first reaches its placeholder tokens and dropped once the prompt has
passed them, and, for models with mRoPE (Qwen3.5/3.6), every prompt token's (t, h, w)
position and the offset the tokens after the prompt take.

A model sees media when it has a `visual` tower (`DecoderStack.embed_media`: patches ->
placeholder embeddings; `media_merge`: the tower's spatial merge; `uses_mrope`: (t, h, w)
positions); the step's metadata then carries the rows to overwrite and their embeddings
(`StepMetadata.media_rows`, `media_embeds`) and, for mRoPE, `rope_positions` [3, T].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparrow.layers.metadata import StepMetadata, to_device
from sparrow.layers.rotary import mrope_positions
from sparrow.multimodal.items import MediaItem


@dataclass
class _RequestMedia:
    items: list[MediaItem]
    prompt_len: int
    positions: torch.Tensor | None = None  # [3, prompt_len] (mRoPE)
    delta: int = 0
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # item -> [tokens, hidden]


class MediaInputs:
    """Per-request media of one runner's model."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.merge = model.media_merge
        self.requests: dict[str, _RequestMedia] = {}

    def add(self, request_id: str, items: list[MediaItem], prompt_len: int) -> None:
        """Register a request's media (`LLM.make_request` checked that the model sees;
        ValueError if runs overlap)."""
        entry = _RequestMedia(list(items), prompt_len)
        if self.model.uses_mrope:
            runs = [r for item in items for r in item.run_grids()]
            entry.positions, entry.delta = mrope_positions(prompt_len, runs, self.merge)
        self.requests[request_id] = entry

    def free(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def rope_offset(self, request_id: str) -> int:
        """What a token after the prompt adds to its index to get its rotary position."""
        entry = self.requests.get(request_id)
        return entry.delta if entry is not None else 0

    def apply(self, meta: StepMetadata, rids: list[str], computed: list[int]) -> None:
        """Set the step's media rows, embeddings and mRoPE positions for the requests that
        have media (`computed[b]`: tokens cached before request b's new ones)."""
        rows, embeds, positions, start = [], [], [], 0
        for rid, c, n in zip(rids, computed, meta.seq_lens, strict=True):
            entry = self.requests.get(rid)
            if entry is not None:
                for offset, value in self._embeddings(entry, c, c + n):
                    rows.extend(range(start + offset, start + offset + value.shape[0]))
                    embeds.append(value)
            positions.append(self._positions(entry, c, n))
            start += n
        device = meta.input_ids.device
        if rows:
            meta.media_rows = to_device(rows, torch.long, device)
            meta.media_embeds = torch.cat(embeds)
        if any(p.shape[0] == 3 for p in positions):
            meta.rope_positions = to_device(
                torch.cat([p.expand(3, -1) for p in positions], 1), torch.long, device
            )

    def _positions(self, entry: _RequestMedia | None, c: int, n: int) -> torch.Tensor:
        """Rotary positions of tokens c..c+n: [3, n] with mRoPE media, else [1, n]."""
        index = torch.arange(c, c + n)
        if entry is None or entry.positions is None:
            return index[None]
        inside = entry.positions[:, c : min(c + n, entry.prompt_len)]
        after = index[inside.shape[1] :] + entry.delta
        return torch.cat([inside, after.expand(3, -1)], dim=1)

    def _encode(self, entry: _RequestMedia, i: int) -> None:
        """Item i's embeddings; for a model whose tower attends across a prompt's media
        (`joint_media`), every item's, in one call."""
        which = range(len(entry.items)) if self.model.joint_media else [i]
        items = [entry.items[j] for j in which]
        pixels = torch.cat([item.pixel_values for item in items]).to(self.model.device)
        out = self.model.embed_media(pixels, [item.grid_thw for item in items])
        sizes = [item.tokens_per_run(self.merge) * len(item.runs) for item in items]
        entry.embeds.update(zip(which, out.split(sizes), strict=True))

    def _embeddings(self, entry: _RequestMedia, start: int, stop: int):
        """(offset from `start`, embedding rows) of the placeholder tokens in [start, stop);
        encodes an item the first time a step reaches it, drops it once passed."""
        for i, item in enumerate(entry.items):
            per_run = item.tokens_per_run(self.merge)
            for r, run in enumerate(item.runs):
                lo, hi = max(start, run), min(stop, run + per_run)
                if lo >= hi:
                    continue
                if i not in entry.embeds:
                    self._encode(entry, i)
                yield lo - start, entry.embeds[i][r * per_run + lo - run : r * per_run + hi - run]
            if i in entry.embeds and stop >= item.runs[-1] + per_run:
                del entry.embeds[i]
