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

SITE = Path(os.environ.get("SPARROW_ORACLE_SITE",
                           Path(__file__).resolve().parents[2] / ".oracle-site"))

QWEN_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True, "rescale_factor": 0.00392156862745098, "resample": 3,
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

    fn, args = {"qwen": (qwen.smart_resize, (32, 65536, 16777216)),
                "m3": (m3.smart_resize, (28, 3136, 451584))}[name]
    return [fn(h, w, *args) for h, w in sizes]


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

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
