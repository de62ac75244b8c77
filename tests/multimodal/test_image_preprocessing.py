"""sparrow.multimodal image preprocessing against the HF 5.17 processors on CPU: pixel values
bit for bit, grid_thw and token counts, for Qwen3.5-MoE and MiniMax M3, on awkward sizes and
colour modes; plus the spec overrides and the placeholder span."""

import io

import numpy as np
import pytest
import torch
from hf_oracle import M3_PREPROCESSOR_CONFIG, QWEN_PREPROCESSOR_CONFIG
from PIL import Image

from sparrow.models import get_architecture
from sparrow.multimodal import (
    MINIMAX_M3,
    QWEN3_5_MOE,
    MediaError,
    decode_image,
    preprocess_image,
)
from sparrow.multimodal.image import placeholder_token_ids, smart_resize

SPECS = {
    "qwen": QWEN3_5_MOE.from_preprocessor_config(QWEN_PREPROCESSOR_CONFIG),
    "m3": MINIMAX_M3.from_preprocessor_config(M3_PREPROCESSOR_CONFIG),
}


def _noise(height, width, channels=3, seed=0):
    rng = np.random.default_rng(seed)
    shape = (height, width) if channels == 1 else (height, width, channels)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _encoded(image, fmt, **kwargs):
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _assert_matches_hf(oracle, name, image, source=None):
    """Our output for decoded `image` equals HF's for `source` (default: the image itself)."""
    ours = preprocess_image(image, SPECS[name])
    ref_pixels, ref_grid, ref_patches = oracle(name, image if source is None else source)
    assert ours.pixel_values.dtype == ref_pixels.dtype == torch.float32
    assert ours.pixel_values.shape == ref_pixels.shape
    assert torch.equal(ours.pixel_values, ref_pixels)
    assert list(ours.grid_thw) == ref_grid
    assert ours.num_tokens == ref_patches // SPECS[name].merge_size ** 2
    return ours


@pytest.mark.parametrize("name", ["qwen", "m3"])
@pytest.mark.parametrize("size", [(17, 900), (900, 17), (33, 47), (999, 1001), (2, 2)])
def test_rgb_bit_identical(hf_oracle_run, name, size):
    image = Image.fromarray(_noise(*size, seed=size[0] * 7 + size[1]))
    _assert_matches_hf(hf_oracle_run, name, image)


@pytest.mark.parametrize("name", ["qwen", "m3"])
def test_large_photo_bit_identical(hf_oracle_run, name):
    # 4000x3000 landscape: Qwen keeps ~all pixels (under 16.7M), M3 downsizes 26x.
    image = Image.fromarray(_noise(3000, 4000, seed=4))
    ours = _assert_matches_hf(hf_oracle_run, name, image)
    assert ours.pixel_values.shape[1] == SPECS[name].patch_dim


@pytest.mark.parametrize("name", ["qwen", "m3"])
@pytest.mark.parametrize(
    "mode,fmt", [("RGBA", "PNG"), ("CMYK", "JPEG"), ("L", "PNG"), ("P", "PNG"), ("LA", "PNG")]
)
def test_colour_modes_bit_identical(hf_oracle_run, name, mode, fmt):
    channels = {"RGBA": 4, "CMYK": 4, "L": 1, "P": 1, "LA": 2}[mode]
    array = _noise(61, 83, channels, seed=channels)
    image = Image.fromarray(array, mode={"P": "L"}.get(mode, mode))
    if mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=37)
    data = _encoded(image, fmt)
    decoded = decode_image(data)
    assert decoded.mode == "RGB" and decoded.size == (83, 61)
    _assert_matches_hf(hf_oracle_run, name, decoded, source=data)


@pytest.mark.parametrize("name", ["qwen", "m3"])
def test_exif_rotation_applied_like_hf(hf_oracle_run, name):
    image = Image.fromarray(_noise(40, 120, seed=9))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW on display
    data = _encoded(image, "JPEG", exif=exif.tobytes(), quality=95)
    decoded = decode_image(data)
    assert decoded.size == (40, 120)
    _assert_matches_hf(hf_oracle_run, name, decoded, source=data)


def test_degenerate_images_rejected():
    with pytest.raises(MediaError, match="each side"):
        decode_image(_encoded(Image.new("RGB", (1, 1)), "PNG"))
    with pytest.raises(MediaError, match="each side"):
        decode_image(_encoded(Image.new("RGB", (1, 500)), "PNG"))
    with pytest.raises(MediaError, match="cannot decode"):
        decode_image(b"not an image at all")
    with pytest.raises(MediaError, match="cannot decode"):
        decode_image(_encoded(Image.new("RGB", (50, 50)), "PNG")[:60])
    with pytest.raises(MediaError, match="pixels"):
        from sparrow.multimodal import MediaLimits

        decode_image(_encoded(Image.new("RGB", (300, 300)), "PNG"), MediaLimits(max_pixels=10**4))
    with pytest.raises(MediaError, match="aspect ratio"):
        smart_resize(2, 500, QWEN3_5_MOE)


def test_smart_resize_matches_hf_over_many_sizes(hf_oracle_run):
    rng = np.random.default_rng(3)
    sizes = [
        (int(h), int(w))
        for h, w in rng.integers(2, 6000, size=(400, 2))
        if max(h, w) / min(h, w) <= 200
    ]
    for name in ("qwen", "m3"):
        ours = [smart_resize(h, w, SPECS[name]) for h, w in sizes]
        assert ours == [tuple(hw) for hw in hf_oracle_run.smart_resize(name, sizes)]


def test_specs_and_overrides():
    assert SPECS["qwen"] == QWEN3_5_MOE and QWEN3_5_MOE.patch_dim == 1536
    assert SPECS["m3"] == MINIMAX_M3 and MINIMAX_M3.patch_dim == 1176
    assert get_architecture("qwen3_5_moe").SPEAKS.media.image is QWEN3_5_MOE
    assert get_architecture("minimax_m3").SPEAKS.media.image is MINIMAX_M3
    custom = QWEN3_5_MOE.from_preprocessor_config(
        {"size": {"shortest_edge": 4096, "longest_edge": 10**6}, "max_pixels": 2 * 10**6}
    )
    assert (custom.min_pixels, custom.max_pixels) == (4096, 2 * 10**6)
    with pytest.raises(ValueError, match="resample"):
        QWEN3_5_MOE.from_preprocessor_config({"resample": 2})
    with pytest.raises(ValueError, match="do_normalize"):
        MINIMAX_M3.from_preprocessor_config({"do_normalize": False})


def test_placeholder_span():
    image = Image.fromarray(_noise(448, 448, seed=1))
    m3 = preprocess_image(image, MINIMAX_M3)
    assert m3.grid_thw == (1, 32, 32) and m3.num_tokens == 256
    ids = placeholder_token_ids(m3.num_tokens, MINIMAX_M3)
    assert ids[0] == 200029 and ids[-1] == 200030 and ids[1:-1] == [200025] * 256
    qwen = preprocess_image(image, QWEN3_5_MOE)
    assert qwen.grid_thw == (1, 28, 28) and qwen.num_tokens == 196
    ids = placeholder_token_ids(qwen.num_tokens, QWEN3_5_MOE)
    assert ids[0] == 248053 and ids[-1] == 248054 and ids.count(248056) == 196
