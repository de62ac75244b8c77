"""The HF 5.17 image processors as the oracle for sparrow.multimodal tests.

They run on torchvision, which is not a Sparrow dependency: PyPI's torchvision does not import
beside the CPU torch ('operator torchvision::nms does not exist'), so it lives outside the
venv (`pip install --no-deps --target .oracle-site torchvision==0.29.1`, or the directory in
$SPARROW_ORACLE_SITE). The processors run in one spawned process that defines the
`torchvision::nms` / `qnms` schemas before importing torchvision and transformers, so the test
process itself never sees torchvision (transformers caches whether it is available at import).
Without the directory, the oracle tests skip.
"""

import io
import multiprocessing
import os
import sys
from pathlib import Path

SITE = Path(
    os.environ.get("SPARROW_ORACLE_SITE", Path(__file__).resolve().parents[2] / ".oracle-site")
)

QWEN_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True,
    "rescale_factor": 0.00392156862745098,
    "resample": 3,
}
M3_PREPROCESSOR_CONFIG = {"size": [672, 672], "patch_size": 14, "resample": 3}

_PROCESSORS = {}


def _init_worker(site: str) -> None:
    import torch

    sys.path.insert(0, site)
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _PROCESSORS["lib"] = lib  # keeps the registration alive
    import torchvision  # noqa: F401
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import (
        MiniMaxM3VLImageProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    qwen_config = {**QWEN_PREPROCESSOR_CONFIG, "size": dict(QWEN_PREPROCESSOR_CONFIG["size"])}
    _PROCESSORS["qwen"] = Qwen2VLImageProcessor(**qwen_config)
    _PROCESSORS["m3"] = MiniMaxM3VLImageProcessor(**{**M3_PREPROCESSOR_CONFIG, "size": [672, 672]})


def _run(name: str, image) -> tuple:
    from PIL import Image
    from transformers.image_utils import load_image

    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    image = load_image(image)  # EXIF orientation, then convert("RGB")
    out = _PROCESSORS[name](images=[image], return_tensors="pt")
    patches = _PROCESSORS[name].get_number_of_image_patches(image.height, image.width)
    return out["pixel_values"], out["image_grid_thw"][0].tolist(), patches


def _smart_resize(name: str, sizes: list) -> list:
    from transformers.models.minimax_m3_vl import image_processing_minimax_m3_vl as m3
    from transformers.models.qwen2_vl import image_processing_qwen2_vl as qwen

    fn, args = {
        "qwen": (qwen.smart_resize, (32, 65536, 16777216)),
        "m3": (m3.smart_resize, (28, 3136, 451584)),
    }[name]
    return [fn(h, w, *args) for h, w in sizes]


QWEN_VIDEO_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "cap_pixels_per_frame": False,
}


def _video_processor(name: str):
    if name not in _PROCESSORS:
        if name == "qwen_video":
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
                Qwen3VLVideoProcessor,
            )

            config = {**QWEN_VIDEO_CONFIG, "size": dict(QWEN_VIDEO_CONFIG["size"])}
            _PROCESSORS[name] = Qwen3VLVideoProcessor(**config)
        else:
            from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import (
                MiniMaxM3VLVideoProcessor,
            )

            _PROCESSORS[name] = MiniMaxM3VLVideoProcessor()
    return _PROCESSORS[name]


def _run_video(name: str, data: bytes, indices: list | None) -> tuple:
    """HF's pyav reader and video processor on an encoded video: (pixel_values_videos,
    grid_thw, frame indices, fps). Qwen samples with its own `sample_frames`; M3's processor
    takes the frames it is given, so `indices` (ours) choose them."""
    import tempfile

    from transformers.video_utils import load_video

    processor = _video_processor(f"{name}_video")
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        pick = (
            (lambda metadata, **_: processor.sample_frames(metadata))
            if indices is None
            else (lambda metadata, **_: indices)
        )
        frames, metadata = load_video(f.name, backend="pyav", sample_indices_fn=pick)
    out = processor(
        videos=[frames], video_metadata=[metadata], do_sample_frames=False, return_tensors="pt"
    )
    return (
        out["pixel_values_videos"],
        out["video_grid_thw"][0].tolist(),
        [int(i) for i in metadata.frames_indices],
        float(metadata.fps),
    )


def _placeholder(name: str, grid: list, indices: list, fps: float) -> str:
    """HF's `replace_video_token` for one video (the processors' own method, on a stand-in
    for the processor object: it reads only these attributes)."""
    from types import SimpleNamespace

    import torch
    from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    cls = Qwen3VLProcessor if name == "qwen" else MiniMaxM3VLProcessor
    video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    this = SimpleNamespace(
        video_processor=video_processor,
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        VISION_START_TOKEN=cls.__dict__.get("VISION_START_TOKEN"),
        VISION_END_TOKEN=cls.__dict__.get("VISION_END_TOKEN"),
        VIDEO_TOKEN=cls.__dict__.get("VIDEO_TOKEN"),
    )
    this._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(this, *a)
    metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=indices)
    inputs = {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}
    return cls.replace_video_token(this, inputs, 0)


class Oracle:
    """`oracle(name, image)` -> (pixel_values, grid_thw, num_patches) from HF's processor;
    `image` is a PIL image or encoded bytes (decoded the way HF `load_image` does)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pool = ctx.Pool(1, initializer=_init_worker, initargs=(str(SITE),))

    def __call__(self, name: str, image) -> tuple:
        return self._pool.apply(_run, (name, image))

    def smart_resize(self, name: str, sizes: list) -> list:
        """HF `smart_resize` with the checkpoint budget, for each (height, width)."""
        return self._pool.apply(_smart_resize, (name, sizes))

    def video(self, name: str, data: bytes, indices: list | None = None) -> tuple:
        """(pixel_values_videos, grid_thw, frame indices, fps) from HF for encoded bytes."""
        return self._pool.apply(_run_video, (name, data, indices))

    def placeholder(self, name: str, grid: list, indices: list, fps: float) -> str:
        return self._pool.apply(_placeholder, (name, grid, indices, fps))

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
