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

import numpy as np
import torch
from PIL import Image

from sparrow.eval.measure import median_s
from sparrow.eval.report import write_report
from sparrow.models import ARCHITECTURES
from sparrow.models.vision import vision_architecture
from sparrow.multimodal import decode_image, preprocess_image
from sparrow.multimodal.video import preprocess_video

# architecture -> (its media format, the HF config of its first preset: the real model's)
SEEING = {
    name: (arch.SPEAKS.media, next(iter(arch.PRESETS.values())).to_hf_config())
    for name, arch in ARCHITECTURES.items()
    if arch.SPEAKS.media is not None
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


def tower(hf_config: dict) -> torch.nn.Module:
    """The vision tower of the model an HF config describes, at its real size, random
    weights, bf16 on the GPU."""
    module = vision_architecture(hf_config)
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
    for name, (media, hf_config) in SEEING.items():
        image_spec, video_spec = media.image, media.video
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
            model = tower(hf_config)
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
