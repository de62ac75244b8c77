"""`python -m sparrow.bench.agent` on the built-in model: later turns resume from the cache."""

from sparrow.bench.agent import main


def test_later_turns_resume_from_the_cached_conversation(tmp_path):
    report = main(
        [
            "--preset",
            "",
            "--quantize",
            "",
            "--prefix-len",
            "1500",
            "--turn-len",
            "100",
            "--output-len",
            "150",
            "--turns",
            "3",
            "--out",
            str(tmp_path / "a.json"),
        ]
    )
    later = report["turns"][1:]
    assert all(t["cached"] > t["prompt"] - 400 for t in later), report["turns"]
    assert len(report["ttft_later_s"]) == 2 and report["ttft_later_p50_s"] > 0
    assert "_first_token" in report["python_profile"]
    assert (tmp_path / "a.json").exists()
