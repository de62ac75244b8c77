"""The HF 5.17 image processors as the oracle for sparrow.multimodal tests.

They run on torchvision, which is not a Sparrow dependency: PyPI's torchvision does not import
beside the CPU torch ('operator torchvision::nms does not exist'), so it lives outside the
venv (`pip install --no-deps --target .oracle-site torchvision==0.29.1`, or the directory in
$SPARROW_ORACLE_SITE), and the fixture defines the `torchvision::nms` / `qnms` schemas before
importing it. Without it, the oracle tests skip.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

_SITE = Path(os.environ.get("SPARROW_ORACLE_SITE",
                            Path(__file__).resolve().parents[2] / ".oracle-site"))

QWEN_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True, "rescale_factor": 0.00392156862745098, "resample": 3,
}
M3_PREPROCESSOR_CONFIG = {"size": [672, 672], "patch_size": 14, "resample": 3}


def _import_torchvision():
    if "torchvision" not in sys.modules:
        if not (_SITE / "torchvision").is_dir():
            pytest.skip(f"oracle torchvision not found under {_SITE}")
        sys.path.insert(0, str(_SITE))
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            try:
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:  # already defined
                pass
        _import_torchvision.lib = lib  # keep the registration alive
    import torchvision  # noqa: F401


def hf_processors():
    """{"qwen": Qwen2VLImageProcessor, "m3": MiniMaxM3VLImageProcessor} from the configs."""
    _import_torchvision()
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import (
        MiniMaxM3VLImageProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return {
        "qwen": Qwen2VLImageProcessor(**{**QWEN_PREPROCESSOR_CONFIG,
                                         "size": dict(QWEN_PREPROCESSOR_CONFIG["size"])}),
        "m3": MiniMaxM3VLImageProcessor(**{**M3_PREPROCESSOR_CONFIG, "size": [672, 672]}),
    }
