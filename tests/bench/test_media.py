"""bench.media on the CPU (a smoke test: the timings come from the benchmark itself)."""

import pytest

from sparrow.bench import media

pytest.importorskip("av")


def test_media_bench_rows(tmp_path):
    report = media.main(["--rounds", "1", "--seconds", "1", "--out", str(tmp_path / "m.json")])
    qwen = report["rows"]["qwen3_5_moe"]
    assert qwen["image_grid"] == (1, 44, 80) and qwen["image_tokens"] == 880
    assert qwen["video_frames"] == 4 and qwen["video_preprocess_ms"] > 0
    assert report["rows"]["minimax_m3"]["image_tokens"] == 576
