"""`python -m sparrow.bench.tools`: every call of each format is parsed from the streamed
tokens, and the report gives a time per token for each splitter."""

from sparrow.bench.tools import main


def test_bench_parses_every_call(tmp_path):
    report = main(["--calls", "3", "--rounds", "1", "--out", str(tmp_path / "tools.json")])
    for fmt in ("qwen3", "minimax_m3"):
        row = report["rows"][fmt]
        assert row["tokens"] > 100 and row["both_us_per_token"] > 0
