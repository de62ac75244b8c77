"""A preprocessed image or video as the engine takes it with a request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a prompt: its placeholder runs (a start per temporal group for a
    video, whose groups the prompt separates by timestamps; one run for an image), and the
    preprocessed patches the tower takes."""

    runs: tuple[int, ...]  # prompt offset of each run's first placeholder token
    pixel_values: torch.Tensor  # [patches, patch_dim] float32, on the host
    grid_thw: tuple[int, int, int]  # in patches, before the merge
    digest: str  # `sparrow.multimodal.media_digest` of the source: the prefix cache's key
    video: bool = False

    def span(self, merge: int) -> tuple[int, int]:
        """(start, length) of the prompt range from the first run's start to the last
        run's end."""
        end = self.runs[-1] + self.tokens_per_run(merge)
        return self.runs[0], end - self.runs[0]

    def tokens_per_run(self, merge: int) -> int:
        t, h, w = self.grid_thw
        return (1 if self.video else t) * h * w // merge**2

    def run_grids(self) -> list[tuple[int, tuple[int, int, int]]]:
        """(start, grid) of each run: a video's frames as grids of t = 1."""
        t, h, w = self.grid_thw
        return [(s, (1, h, w) if self.video else (t, h, w)) for s in self.runs]
