"""bench.m3 on the CPU with the tiny M3 config (a smoke test: the numbers come from the
H200): the parity rows against HF and the engine speed rows are all produced."""

from sparrow.bench import m3


def test_m3_bench_runs_on_the_tiny_config(tmp_path):
    report = m3.main(
        [
            "--preset",
            "minimax-m3-tiny",
            "--lengths",
            "40",
            "--layers",
            "4",
            "--decode",
            "2",
            "--rounds",
            "1",
            "--chunk",
            "32",
            "--parity-len",
            "48",
            "--out",
            str(tmp_path / "m3.json"),
        ]
    )
    parity = report["parity"]
    for name in ("hf_bf16", "ours_reference_bfloat16", "ours_kernels_bfloat16"):
        assert 0 <= parity[f"{name}_vs_fp32"]["top1_agree"] <= 1
    assert parity["ours_reference_bfloat16_vs_fp32"]["rel_err"] < 1  # bf16 on random weights
    row = report["speed"]["rows"][40]
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    assert (tmp_path / "m3.json").exists()
