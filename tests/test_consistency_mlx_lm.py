"""`python -m sparrow.eval.consistency --reference mlx-lm` on the built-in model, on CPU:
Sparrow and mlx-lm read the same 4-bit bytes (written by either engine) and agree in
float32."""

import json
import sys

import pytest
import torch

from sparrow.assets import default_checkpoint
from sparrow.eval.consistency import main
from sparrow.eval.mlx_reference import write_mlx_checkpoint


def _needs_mlx_lm() -> None:
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")


def _run(tmp_path, *flags: str) -> dict:
    out = tmp_path / "consistency.json"
    main(["--reference", "mlx-lm", *flags, "--out", str(out)])
    return json.loads(out.read_text())


def _assert_identical(report: dict) -> None:
    row = report["sparrow_vs_mlx_lm"]
    assert row["top1_agreement"] == 1.0
    assert round(row["perplexity_ratio"], 4) == 1.0
    assert row["kl_mean"] < 1e-6 and row["kl_p99"] < 1e-5
    assert 1 < row["perplexity"] < 4096  # a trained model, far below the vocabulary


def test_sparrow_written_4bit_matches_mlx_lm_in_float32(tmp_path):
    """The built-in model quantised by Sparrow's MLX writer into a temporary directory; both
    engines read those bytes."""
    _needs_mlx_lm()
    report = _run(tmp_path)
    assert report["quantized_by"] == "sparrow" and report["positions"] == 192
    assert report["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert report["dtype"] == "torch.float32" and report["mlx_dtype"] == "float32"
    assert "mlx_device" in report and "note" not in report
    _assert_identical(report)


def test_mlx_lm_written_4bit_matches_mlx_lm_in_float32(tmp_path):
    """The same with the built-in model quantised by mlx_lm.convert (which reads the release
    layout: model_type qwen3_5_moe, fused experts)."""
    _needs_mlx_lm()
    report = _run(tmp_path, "--writer", "mlx-lm")
    assert report["quantized_by"] == "mlx-lm"
    _assert_identical(report)


def test_an_mlx_checkpoint_is_read_as_given(tmp_path):
    """A checkpoint with MLX's quantization block is compared as stored (here 8-bit)."""
    _needs_mlx_lm()
    ckpt = write_mlx_checkpoint(
        default_checkpoint(), tmp_path / "q8", "sparrow", "8bit", "cpu", torch.float32
    )
    report = _run(tmp_path, "--model", str(ckpt), "--positions", "24", "--context", "8")
    assert report["quantized_by"] == "as given" and report["quantization"]["bits"] == 8
    _assert_identical(report)


def test_an_unknown_reference_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--reference", "vllm"])
    assert e.value.code == 2
    assert "invalid choice: 'vllm'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--writer applies to --reference mlx-lm only"):
        main(["--writer", "mlx-lm"])
    with pytest.raises(SystemExit, match="--hf-dtype applies to --reference hf only"):
        main(["--reference", "mlx-lm", "--hf-dtype", "float32"])


def test_without_mlx_lm_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # import mlx_lm raises ImportError
    with pytest.raises(SystemExit, match=r"--reference mlx-lm needs mlx and mlx-lm"):
        _run(tmp_path, "--positions", "2", "--context", "1")
