"""From a chat request's media parts to what the engine takes: fetch, decode and preprocess
each image and video (`load`, blocking and picklable: servers run it off their event loop,
in threads or a process pool; then `finish` tokenises a video's timestamps), then expand
the one placeholder token per item that the chat template renders into the item's full
placeholder (`expand`), as the HF 5.17 processors replace theirs:
- an image token becomes one token per merged patch (Qwen: the template wraps it in
  vision start/end already; M3: the replacement carries its own start/end);
- a video token becomes, per temporal group, its timestamp text, start, one token per merged
  patch and end (HF's `replace_video_token`; with Qwen's template this nests inside the
  template's own vision start/end, as HF 5.17 writes it).
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.multimodal.fetch import fetch_bytes
from sparrow.multimodal.image import preprocess_image
from sparrow.multimodal.items import MediaItem
from sparrow.multimodal.media import MediaError, MediaLimits, decode_image, media_digest
from sparrow.multimodal.specs import ImageSpec
from sparrow.multimodal.video import (
    VideoSpec,
    placeholder_text,
    preprocess_video,
)


@dataclass(frozen=True)
class Loaded:
    """One preprocessed media item and what replaces its placeholder token: token ids, or
    (videos) text to tokenise with the timestamps."""

    video: bool
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    digest: str
    nbytes: int  # encoded bytes fetched
    placeholder: list[int] | str


@dataclass(frozen=True)
class Prepared:
    """One preprocessed media item and the token ids that replace its placeholder token."""

    video: bool
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    digest: str
    replacement: list[int]


class MediaPipeline:
    """Images and videos for one model: its specs, the byte and size limits."""

    def __init__(
        self, image: ImageSpec, video: VideoSpec, limits: MediaLimits, wrap_images: bool = False
    ):
        self.image, self.video, self.limits, self.wrap_images = image, video, limits, wrap_images

    @classmethod
    def for_checkpoint(
        cls,
        model_dir: str | Path,
        image: ImageSpec,
        video: VideoSpec,
        limits: MediaLimits,
        wrap_images: bool = False,
    ) -> MediaPipeline:
        """The pipeline of a checkpoint whose family preprocesses with `image` and `video`
        (its `models.interface.MediaFormat`), the checkpoint's `preprocessor_config.json`
        applied to the image spec and `video_preprocessor_config.json` to the video one."""
        model_dir = Path(model_dir)
        pre = model_dir / "preprocessor_config.json"
        if pre.is_file():
            image = image.from_preprocessor_config(json.loads(pre.read_text()))
        pre = model_dir / "video_preprocessor_config.json"
        if pre.is_file():
            video = video.from_preprocessor_config(json.loads(pre.read_text()))
        return cls(image, video, limits, wrap_images)

    def load(self, video: bool, source: str) -> Loaded:
        """Fetch, decode and preprocess one item (MediaError for anything wrong with it):
        the heavy part, which a process pool can run (the pipeline and the result pickle)."""
        data = fetch_bytes(source, self.limits)
        if video:
            out = preprocess_video(data, self.video, self.limits)
            return Loaded(
                True,
                out.pixel_values,
                out.grid_thw,
                media_digest(data, self.video),
                len(data),
                placeholder_text(out, self.video),
            )
        out = preprocess_image(decode_image(data, self.limits), self.image)
        pads = [self.image.image_token_id] * out.num_tokens
        if self.wrap_images:
            pads = [self.image.start_token_id, *pads, self.image.end_token_id]
        return Loaded(
            False, out.pixel_values, out.grid_thw, media_digest(data, self.image), len(data), pads
        )

    @staticmethod
    def finish(loaded: Loaded, encode: Callable[[str], list[int]]) -> Prepared:
        """The item with its replacement token ids (`encode` tokenises a video's placeholder
        text, special tokens included)."""
        replacement = loaded.placeholder
        if isinstance(replacement, str):
            replacement = encode(replacement)
        return Prepared(
            loaded.video, loaded.pixel_values, loaded.grid_thw, loaded.digest, replacement
        )

    def expand(
        self, ids: list[int], prepared: list[Prepared], video_token_id: int
    ) -> tuple[list[int], list[MediaItem]]:
        """Replace the template's placeholder tokens (one per item, in order: the image
        token id or `video_token_id`) by the items' replacements. Returns the prompt and
        each item's MediaItem (its runs: where its placeholder tokens start)."""
        out, items, queue = [], [], list(prepared)
        for token in ids:
            is_image, is_video = token == self.image.image_token_id, token == video_token_id
            if not (is_image or is_video):
                out.append(token)
                continue
            if not queue or queue[0].video != is_video:
                raise MediaError(
                    "the prompt's image and video placeholders do not match the "
                    "request's media parts"
                )
            item = queue.pop(0)
            pad = video_token_id if item.video else self.image.image_token_id
            runs = [
                len(out) + i
                for i, t in enumerate(item.replacement)
                if t == pad and (i == 0 or item.replacement[i - 1] != pad)
            ]
            out.extend(item.replacement)
            items.append(
                MediaItem(tuple(runs), item.pixel_values, item.grid_thw, item.digest, item.video)
            )
        if queue:
            raise MediaError(
                f"{len(queue)} media part(s) have no placeholder in the prompt "
                "(does the chat template render images and videos?)"
            )
        return out, items


def media_pool(processes: int) -> ProcessPoolExecutor:
    """A pool for `MediaPipeline.load`: spawned processes (a fork would copy the parent's
    gRPC and server threads, which do not survive it), each decoding on one thread, so that
    the processes, not torch's intra-op threads, share the cores."""
    return ProcessPoolExecutor(
        processes,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=torch.set_num_threads,
        initargs=(1,),
    )
