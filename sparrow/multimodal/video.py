"""Video -> (pixel patches, grid_thw, frame timestamps, placeholder text), bit-identical to the
HF 5.17 video processors on CPU (`Qwen3VLVideoProcessor`, `MiniMaxM3VLVideoProcessor`).

Decoding is PyAV's, the way HF's `read_video_pyav` reads a file: the frame count is the
stream's (counted from its packets when the container does not say), the rate its average
rate, and frames are decoded from the start up to the last sampled one, only the sampled
ones converted to RGB. Sampling, per model:
- Qwen3.5/3.6: `n = clamp(int(N / rate * fps), min_frames, min(max_frames, N))` frames at
  `linspace(0, N - 1, n).round()`; the pixel budget covers all frames together
  (`smart_resize` over t x h x w, sides below one merged patch scaled up first).
- MiniMax M3: HF's processor takes the frames it is given; a served video is sampled with
  HF's base rule at the spec's fps (`n = int(N / rate * fps)` frames at `arange(0, N, N / n)`),
  here with at least 2 and at most `max_frames` of them. Each frame has its own pixel budget.
Then the image path's uint8 antialiased bicubic resize and normalisation, the last frame
repeated up to a multiple of the temporal patch, and the same patch layout.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from sparrow.multimodal.image import normalize, resize_uint8, smart_resize
from sparrow.multimodal.media import MediaError, MediaLimits
from sparrow.multimodal.specs import MINIMAX_M3, QWEN3_5_MOE, ImageSpec

LIMITS = MediaLimits()


@dataclass(frozen=True)
class VideoSpec:
    """How one architecture samples, resizes and tokenises a video. `image` holds the patch
    geometry, normalisation and the start/end tokens that wrap each temporal group."""

    image: ImageSpec
    video_token: str
    start_token: str
    end_token: str
    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    total_budget: bool  # True: min/max pixels bound all frames together (Qwen)
    timestamp: str  # "<{t:.1f} seconds>" style template of each group's time
    mean_timestamp: bool  # a group's time: the mean of its frames' (Qwen) or its first's

    def from_preprocessor_config(self, config: dict) -> VideoSpec:
        """This spec with a checkpoint's `video_preprocessor_config.json` applied: `size`
        ({shortest_edge, longest_edge}) or `min_pixels` / `max_pixels` (which win), `fps`,
        `min_frames`, `max_frames`; patch sizes and normalisation as the image spec reads
        them (`ImageSpec.from_preprocessor_config`, which also refuses what this pipeline
        does not implement)."""
        pixels = {k: config[k] for k in ("min_pixels", "max_pixels") if config.get(k)}
        size = config.get("size")
        if isinstance(size, dict):
            pixels.setdefault("min_pixels", size.get("shortest_edge") or self.min_pixels)
            pixels.setdefault("max_pixels", size.get("longest_edge") or self.max_pixels)
        image_keys = {
            k: v for k, v in config.items() if k not in ("size", "min_pixels", "max_pixels")
        }
        changes = {
            k: type(getattr(self, k))(config[k])
            for k in ("fps", "min_frames", "max_frames")
            if config.get(k) is not None
        }
        return replace(
            self,
            image=self.image.from_preprocessor_config(image_keys),
            **{k: int(v) for k, v in pixels.items()},
            **changes,
        )


QWEN3_5_MOE_VIDEO = VideoSpec(
    image=QWEN3_5_MOE,
    video_token="<|video_pad|>",
    start_token="<|vision_start|>",
    end_token="<|vision_end|>",
    fps=2.0,
    min_frames=4,
    max_frames=768,
    min_pixels=4096,
    max_pixels=25_165_824,
    total_budget=True,
    timestamp="<{:.1f} seconds>",
    mean_timestamp=True,
)
MINIMAX_M3_VIDEO = VideoSpec(
    image=MINIMAX_M3,
    video_token="]<]video[>[",
    start_token="]<]start of image[>[",
    end_token="]<]end of image[>[",
    fps=1.0,
    min_frames=2,
    max_frames=768,
    min_pixels=4 * 28 * 28,
    max_pixels=768 * 28 * 28,
    total_budget=False,
    timestamp="]<]{:.1f} seconds[>[",
    mean_timestamp=False,
)


@dataclass(frozen=True)
class ProcessedVideo:
    """One video ready for a vision tower: pixel_values [grid_t * grid_h * grid_w, C * T * p *
    p] float32 (the image layout), grid_thw in patches, the sampled frame indices and the
    source frame rate (the timestamps' base)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    frame_indices: tuple[int, ...]
    source_fps: float

    def num_tokens(self, spec: VideoSpec) -> int:
        t, h, w = self.grid_thw
        return t * h * w // spec.image.merge_size**2


def sample_indices(total: int, source_fps: float, spec: VideoSpec) -> list[int]:
    """Indices of the frames to keep out of `total` at `source_fps` (module docstring)."""
    if total < 1:
        raise MediaError("video has no frames")
    n = min(max(int(total / source_fps * spec.fps), spec.min_frames), spec.max_frames, total)
    if spec.total_budget:  # Qwen3VLVideoProcessor.sample_frames
        return np.linspace(0, total - 1, n).round().astype(int).tolist()
    return torch.arange(0, total, total / n).int().tolist()  # BaseVideoProcessor.sample_frames


def video_size(frames: int, height: int, width: int, spec: VideoSpec) -> tuple[int, int]:
    """Target (height, width) of every frame (HF's video `smart_resize` for a total budget,
    the image one per frame otherwise)."""
    if frames < spec.image.temporal_patch_size:
        raise MediaError(
            f"video has {frames} frame(s); at least {spec.image.temporal_patch_size} are needed"
        )
    frame_spec = replace(spec.image, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    if not spec.total_budget:
        return smart_resize(height, width, frame_spec)
    factor, t = spec.image.factor, spec.image.temporal_patch_size
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > spec.image.max_aspect_ratio:
        raise MediaError(f"video aspect ratio {ratio:.1f} exceeds {spec.image.max_aspect_ratio:g}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / t) * t
    if t_bar * h_bar * w_bar > spec.max_pixels:
        beta = math.sqrt(frames * height * width / spec.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify_video(frames: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    """[F, C, H, W] float -> [grid_t * grid_h * grid_w, C * T * p * p], the last frame
    repeated up to a multiple of T."""
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    if pad := -frames.shape[0] % t:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    f, c, height, width = frames.shape
    gt, gh, gw = f // t, height // p, width // p
    patches = frames.reshape(gt, t, c, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * t * p * p)


def preprocess_frames(
    frames: np.ndarray, indices: list[int], source_fps: float, spec: VideoSpec
) -> ProcessedVideo:
    """Sampled RGB frames [F, H, W, 3] uint8 -> patches for `spec`'s tower."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise MediaError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    count, height, width = frames.shape[:3]
    target_h, target_w = video_size(count, height, width, spec)
    pixels = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    pixels = normalize(resize_uint8(pixels, target_h, target_w), spec.image)
    patches = patchify_video(pixels, spec.image)
    t = spec.image.temporal_patch_size
    p = spec.image.patch_size
    grid = (-(-count // t), target_h // p, target_w // p)
    return ProcessedVideo(patches, grid, tuple(indices), source_fps)


def group_timestamps(video: ProcessedVideo, spec: VideoSpec) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame's time (Qwen,
    HF's `_calculate_timestamps`) or its first frame's (M3)."""
    t = spec.image.temporal_patch_size
    idx = list(video.frame_indices)
    idx += [idx[-1]] * (-len(idx) % t)
    times = [i / video.source_fps for i in idx]
    if spec.mean_timestamp:
        return [(times[g] + times[g + t - 1]) / 2 for g in range(0, len(times), t)]
    return times[::t]


def placeholder_text(video: ProcessedVideo, spec: VideoSpec) -> str:
    """What one video placeholder token of the prompt becomes: per temporal group its time,
    the start token, one video token per merged patch, the end token (HF's
    `replace_video_token`)."""
    grid_t, h, w = video.grid_thw
    per_group = spec.video_token * (h * w // spec.image.merge_size**2)
    return "".join(
        spec.timestamp.format(ts) + spec.start_token + per_group + spec.end_token
        for ts in group_timestamps(video, spec)[:grid_t]
    )


def decode_video(
    data: bytes, spec: VideoSpec, limits: MediaLimits = LIMITS
) -> tuple[np.ndarray, list[int], float]:
    """Encoded video bytes -> (sampled RGB frames [F, H, W, 3] uint8, their indices, the
    stream's frame rate). MediaError for anything PyAV cannot read, no video stream, a frame
    over `limits.max_pixels` or a stream over `limits.max_video_frames`."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = _video_stream(container, limits)
            total = stream.frames or sum(1 for pkt in container.demux(stream) if pkt.size)
            rate = float(stream.average_rate or stream.guessed_rate or 0)
        if total > limits.max_video_frames:
            raise MediaError(f"video has {total} frames; at most {limits.max_video_frames}")
        if rate <= 0:
            raise MediaError("video stream has no frame rate")
        indices = sample_indices(total, rate, spec)
        with av.open(io.BytesIO(data)) as container:
            frames = _decode_at(container, set(indices), indices[-1])
    except av.FFmpegError as e:
        raise MediaError(f"cannot decode video: {e}") from e
    if len(frames) < len(indices):  # the stream ended early: keep what it holds
        indices = indices[: len(frames)]
    if not frames:
        raise MediaError("video has no decodable frames")
    return np.stack(frames), indices, rate


def _video_stream(container, limits: MediaLimits):
    if not container.streams.video:
        raise MediaError("media has no video stream")
    stream = container.streams.video[0]
    if stream.width * stream.height > limits.max_pixels:
        raise MediaError(
            f"video frame {stream.width}x{stream.height} exceeds {limits.max_pixels} pixels"
        )
    if min(stream.width, stream.height) < limits.min_side:
        raise MediaError(f"video frame {stream.width}x{stream.height} is too small")
    return stream


def _decode_at(container, wanted: set[int], last: int) -> list[np.ndarray]:
    frames = []
    container.streams.video[0].thread_type = "AUTO"  # frame and slice threads: every core
    for i, frame in enumerate(container.decode(video=0)):
        if i > last:
            break
        if i in wanted:
            frames.append(frame.to_ndarray(format="rgb24"))
    return frames


def preprocess_video(data: bytes, spec: VideoSpec, limits: MediaLimits = LIMITS) -> ProcessedVideo:
    """Decode, sample, resize, normalise and patchify one encoded video."""
    frames, indices, rate = decode_video(data, spec, limits)
    return preprocess_frames(frames, indices, rate, spec)
