"""`python -m sparrow.eval.consistency` on the built-in model, on CPU: Sparrow's reference
path and HF transformers agree in fp32 on the original and on the 4-bit weights."""

import json

import pytest

pytest.importorskip("transformers")

from sparrow.eval.consistency import main  # noqa: E402


def test_consistency_on_the_builtin_model(tmp_path):
    out = tmp_path / "consistency.json"
    main(["--quantize", "4bit", "--positions", "48", "--context", "16", "--out", str(out)])
    report = json.loads(out.read_text())
    for pair in ("sparrow_vs_hf", "sparrow_4bit_vs_hf_dequantised"):
        row = report[pair]
        assert row["top1_agreement"] == 1.0, pair
        assert abs(row["perplexity_ratio"] - 1) < 1e-4 and row["kl_p99"] < 1e-5, pair
        assert 1 < row["perplexity"] < 4096  # a trained model, far below the vocabulary
    cost = report["sparrow_4bit_vs_hf_original"]  # what quantising costs: stated, not zero
    assert cost["kl_mean"] > 0 and cost["perplexity_ratio"] > 1


def test_bf16_against_fp32_reports_hfs_own_rounding(tmp_path):
    """Sparrow in bf16 against HF in fp32: one more pair, HF itself in bf16 against fp32."""
    out = tmp_path / "consistency.json"
    main(
        [
            "--dtype",
            "bfloat16",
            "--hf-dtype",
            "float32",
            "--positions",
            "24",
            "--context",
            "8",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert report["dtype"] == "torch.bfloat16" and report["hf_dtype"] == "torch.float32"
    for pair in ("sparrow_vs_hf", "hf_bfloat16_vs_hf"):
        assert 0.5 < report[pair]["top1_agreement"] <= 1.0
        assert abs(report[pair]["perplexity_ratio"] - 1) < 0.05


def test_bf16_recurrent_state_reports_its_cost(tmp_path):
    """`--recurrent-state-dtype bfloat16`: Sparrow keeps its Gated DeltaNet state in bf16, and
    one more pair states what that costs against Sparrow with fp32 state: not zero, small."""
    out = tmp_path / "consistency.json"
    main(
        [
            "--recurrent-state-dtype",
            "bfloat16",
            "--positions",
            "24",
            "--context",
            "8",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert report["recurrent_state_dtype"] == "bfloat16"
    cost = report["sparrow_bfloat16_state_vs_float32_state"]
    assert 0 < cost["kl_mean"] < 1e-3 and cost["top1_agreement"] >= 0.9
    assert abs(cost["perplexity_ratio"] - 1) < 0.01
    assert report["sparrow_vs_hf"]["top1_agreement"] >= 0.9


def test_hf_class_for_m3_without_a_vision_config(tmp_path):
    """A MiniMax M3 checkpoint written from a model has no vision_config; HF has no causal
    LM for the family, so its image-text-to-text class reads it."""
    import torch

    from sparrow.eval.consistency import load_hf
    from sparrow.loader.random_checkpoint import write_random_checkpoint
    from sparrow.models import PRESETS

    cfg = PRESETS["minimax-m3-tiny"].replace(vocab_size=512)
    write_random_checkpoint(tmp_path, cfg, dtype=torch.float32, tokenizer=False, progress=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("vision_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert type(load_hf(tmp_path, torch.float32, "cpu")).__name__.endswith("ConditionalGeneration")
