"""Images and videos: preprocessing time on the CPU and vision-tower time on the GPU, at the
sizes a chat request brings (a 1280x720 JPEG; a 10 s 720p clip at 30 fps, H.264).

Preprocessing (`sparrow.multimodal`: decode, sample, resize, normalise, patchify; the work the
server does per item in a worker thread) runs per model's specs, median of rounds. With a
CUDA device, each model's tower at its real size (random weights, bf16) encodes the same
patches: median time per item after a warm-up. Without one, the tower rows are skipped.

    python -m sparrow.bench.media --out bench-out/media.json
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
import torch
from PIL import Image

from sparrow.bench.report import write_report
from sparrow.multimodal import MINIMAX_M3, QWEN3_5_MOE, decode_image, preprocess_image
from sparrow.multimodal.video import MINIMAX_M3_VIDEO, QWEN3_5_MOE_VIDEO, preprocess_video

SPECS = {
    "qwen3_5_moe": (QWEN3_5_MOE, QWEN3_5_MOE_VIDEO),
    "minimax_m3": (MINIMAX_M3, MINIMAX_M3_VIDEO),
}


def sample_media(
    width: int = 1280, height: int = 720, seconds: int = 10, fps: int = 30
) -> tuple[bytes, bytes]:
    """(JPEG bytes, H.264 MP4 bytes) of a synthetic scene: gradients that move, plus noise."""
    import av

    rng = np.random.default_rng(0)
    y, x = np.mgrid[:height, :width]

    def frame(i: int) -> np.ndarray:
        noise = rng.integers(0, 8, (height, width), dtype=np.int64)  # camera-like grain
        return np.stack([(x + 4 * i) % 256, (y + 2 * i) % 256, (x + y + noise) % 256], -1).astype(
            np.uint8
        )

    jpeg = io.BytesIO()
    Image.fromarray(frame(0)).save(jpeg, format="JPEG", quality=90)
    clip = io.BytesIO()
    with av.open(clip, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame(i), format="rgb24")))
        container.mux(stream.encode())
    return jpeg.getvalue(), clip.getvalue()


def median_s(fn, rounds: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def tower(model_type: str) -> torch.nn.Module:
    """The model's vision tower at its real size, random weights, bf16 on the GPU."""
    from sparrow.models.vision import minimax_m3_vision, qwen3_5_vision

    module = qwen3_5_vision if model_type == "qwen3_5_moe" else minimax_m3_vision
    with torch.device("cuda"):
        model = module.VisionModel(module.VisionArgs()).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=10, help="clip length")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    jpeg, clip = sample_media(seconds=args.seconds)
    rows = {}
    for name, (image_spec, video_spec) in SPECS.items():
        t_img, image = median_s(
            lambda s=image_spec: preprocess_image(decode_image(jpeg), s), args.rounds
        )
        t_vid, video = median_s(lambda s=video_spec: preprocess_video(clip, s), args.rounds)
        row = {
            "image_preprocess_ms": t_img * 1e3,
            "image_grid": image.grid_thw,
            "image_tokens": image.num_tokens,
            "video_preprocess_ms": t_vid * 1e3,
            "video_grid": video.grid_thw,
            "video_frames": len(video.frame_indices),
            "video_tokens": video.num_tokens(video_spec),
        }
        if torch.cuda.is_available():
            model = tower(name)
            for key, item in (("image", image), ("video", video)):
                pixels = item.pixel_values.to("cuda", torch.bfloat16)
                grid = torch.tensor([item.grid_thw], device="cuda")
                with torch.inference_mode():
                    model(pixels, grid)  # warm-up
                    row[f"{key}_encode_ms"] = (
                        median_s(lambda m=model, px=pixels, g=grid: m(px, g), args.rounds)[0] * 1e3
                    )
            del model
            torch.cuda.empty_cache()
        rows[name] = row
        cells = (f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        print(f"[media] {name}: " + ", ".join(cells))
    report = {
        "image": "1280x720 JPEG",
        "video": f"{args.seconds} s 1280x720 H.264 at 30 fps",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "rows": rows,
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
