"""Video preprocessing against the HF 5.17 video processors: the same encoded bytes through
HF's PyAV reader and processor and through `sparrow.multimodal.video` give bit-identical
pixel values, equal grids, equal frame indices and equal prompt placeholders; bad videos
are MediaErrors."""

import io

import numpy as np
import pytest

from sparrow.multimodal.media import MediaError, MediaLimits
from sparrow.multimodal.video import (
    MINIMAX_M3_VIDEO,
    QWEN3_5_MOE_VIDEO,
    decode_video,
    placeholder_text,
    preprocess_video,
    sample_indices,
)

av = pytest.importorskip("av")


def encode(
    frames: int,
    height: int,
    width: int,
    fps: int = 24,
    codec: str = "mpeg4",
    fmt: str = "mp4",
    pts_step=None,
    seed: int = 0,
) -> bytes:
    """A synthetic clip: moving gradients plus noise, so resizing has edges to keep."""
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        y, x = np.mgrid[:height, :width]
        pts = 0
        for i in range(frames):
            noise = rng.integers(0, 256, (height, width))
            img = np.stack([(x * 5 + i * 9) % 256, (y * 3 + i * 4) % 256, noise], -1)
            img = img.astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            if pts_step is not None:
                frame.pts, pts = pts, pts + pts_step(i)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


CLIPS = {  # (frames, height, width, fps)
    "odd-frames": (9, 48, 64, 24),
    "three-seconds": (61, 90, 160, 20),
    "tall": (14, 200, 36, 7),
}


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_qwen_video_equals_hf(hf_oracle_run, clip):
    data = encode(*CLIPS[clip])
    ref_pixels, ref_grid, ref_indices, ref_fps = hf_oracle_run.video("qwen", data)
    ours = preprocess_video(data, QWEN3_5_MOE_VIDEO)
    assert list(ours.frame_indices) == ref_indices and ours.source_fps == ref_fps
    assert list(ours.grid_thw) == ref_grid
    assert ours.pixel_values.dtype == ref_pixels.dtype
    assert ours.pixel_values.equal(ref_pixels)
    assert placeholder_text(ours, QWEN3_5_MOE_VIDEO) == hf_oracle_run.placeholder(
        "qwen", ref_grid, ref_indices, ref_fps
    )


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_m3_video_equals_hf(hf_oracle_run, clip):
    """M3's processor takes the frames it is given: ours choose them, HF decodes those."""
    data = encode(*CLIPS[clip])
    ours = preprocess_video(data, MINIMAX_M3_VIDEO)
    ref_pixels, ref_grid, ref_indices, ref_fps = hf_oracle_run.video(
        "m3", data, list(ours.frame_indices)
    )
    assert list(ours.grid_thw) == ref_grid and ours.source_fps == ref_fps
    assert ours.pixel_values.equal(ref_pixels)
    assert placeholder_text(ours, MINIMAX_M3_VIDEO) == hf_oracle_run.placeholder(
        "m3", ref_grid, ref_indices, ref_fps
    )


def test_sampling_rules():
    # Qwen: 2 fps, at least 4 frames, linspace; the reference's 60 frames at 24 fps example
    assert sample_indices(60, 24.0, QWEN3_5_MOE_VIDEO) == [0, 15, 30, 44, 59]
    assert sample_indices(3, 24.0, QWEN3_5_MOE_VIDEO) == [0, 1, 2]
    assert len(sample_indices(10**5, 30.0, QWEN3_5_MOE_VIDEO)) == 768
    # M3: 1 fps at arange(0, N, N / n), at least 2 frames
    assert sample_indices(90, 30.0, MINIMAX_M3_VIDEO) == [0, 30, 60]
    assert sample_indices(10, 30.0, MINIMAX_M3_VIDEO) == [0, 5]


def test_variable_frame_rate_and_webm():
    """Irregular timestamps still decode every sampled frame; a WebM stream, whose
    container gives no frame count, is counted from its packets."""
    vfr = encode(12, 32, 48, fps=24, pts_step=lambda i: 1 + i % 3)
    frames, indices, _ = decode_video(vfr, QWEN3_5_MOE_VIDEO)
    assert frames.shape[0] == len(indices) >= 4
    webm = encode(10, 32, 48, fps=10, codec="libvpx-vp9", fmt="webm")
    with av.open(io.BytesIO(webm)) as c:
        assert c.streams.video[0].frames == 0
    frames, indices, rate = decode_video(webm, QWEN3_5_MOE_VIDEO)
    assert rate == 10 and indices == [0, 3, 6, 9] and frames.shape == (4, 32, 48, 3)


def test_bad_videos_are_media_errors():
    with pytest.raises(MediaError, match="cannot decode video"):
        preprocess_video(b"\x00not a video" * 50, QWEN3_5_MOE_VIDEO)
    one_frame = encode(1, 32, 32)
    with pytest.raises(MediaError, match="at least 2"):
        preprocess_video(one_frame, QWEN3_5_MOE_VIDEO)
    clip = encode(9, 48, 64)
    with pytest.raises(MediaError, match="exceeds 1000 pixels"):
        preprocess_video(clip, QWEN3_5_MOE_VIDEO, MediaLimits(max_pixels=1000))
    with pytest.raises(MediaError, match="at most 5"):
        preprocess_video(clip, MINIMAX_M3_VIDEO, MediaLimits(max_video_frames=5))


def test_video_preprocessor_config_overrides():
    """The published Qwen3.6 file's values, and a file that asks for another resample mode."""
    spec = QWEN3_5_MOE_VIDEO.from_preprocessor_config(
        {
            "size": {"longest_edge": 1000000, "shortest_edge": 8192},
            "fps": 1,
            "max_frames": 64,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        }
    )
    assert (spec.min_pixels, spec.max_pixels, spec.fps, spec.max_frames) == (8192, 1000000, 1, 64)
    assert spec.image == QWEN3_5_MOE_VIDEO.image
    assert QWEN3_5_MOE_VIDEO.from_preprocessor_config({"max_pixels": 5000}).max_pixels == 5000
    with pytest.raises(ValueError, match="resample"):
        QWEN3_5_MOE_VIDEO.from_preprocessor_config({"resample": 2})
