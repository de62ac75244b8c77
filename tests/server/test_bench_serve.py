"""The serving benchmark runs end to end on the built-in model (a smoke test: numbers are
measured on the H200, not here)."""

import json

import pytest

pytest.importorskip("uvicorn")


def test_bench_serve_writes_its_report(tmp_path, monkeypatch):
    from sparrow.bench import serve

    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "serve.json"
    serve.main(
        [
            "--preset",
            "qwen3.6-tiny",
            "--concurrency",
            "1,2",
            "--requests",
            "1",
            "--prompt-len",
            "16",
            "--max-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["server"]] == [1, 2]
    assert all(r["output_tok_s"] > 0 for r in report["server"])
    assert report["offline"]["decode_tok_s"] > 0 and report["http_decode_overhead_c1"] is not None


def test_agent_workload_reports_both_servers(tmp_path, monkeypatch):
    from sparrow.bench import serve

    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "agent.json"
    serve.main(
        [
            "--workload",
            "agent",
            "--preset",
            "qwen3.6-tiny",
            "--concurrency",
            "1,2",
            "--prefix-len",
            "300",
            "--turn-len",
            "20",
            "--output-len",
            "3",
            "--turns",
            "2",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert (
        [r["concurrency"] for r in rows["cached"]]
        == [1, 2]
        == [r["concurrency"] for r in rows["uncached"]]
    )
    assert all(
        r["turns"] == 2 * r["concurrency"] and r["output_tok_s"] > 0
        for rs in rows.values()
        for r in rs
    )
    assert rows["cached"][-1]["prefix_hit_rate"] > 0.5
    assert rows["uncached"][-1]["prefix_hit_rate"] == 0
    assert set(report["speedup"]) == {"1", "2"}


def test_agent_workload_over_the_responses_api(tmp_path):
    """`--api responses` on the built-in model: turns chained by previous_response_id hit
    every full block of the turn before, and an identical request again hits every full
    block of the first."""
    from sparrow.bench import serve

    out = tmp_path / "agent.json"
    flags = ["--workload", "agent", "--api", "responses", "--concurrency", "1", "--turns", "3"]
    flags += ["--prefix-len", "300", "--turn-len", "20", "--output-len", "4", "--out", str(out)]
    serve.main(flags)
    report = json.loads(out.read_text())
    assert report["api"] == "responses"
    cached, uncached = report["rows"]["cached"][0], report["rows"]["uncached"][0]
    turns = cached["per_turn"]
    assert [t["turn"] for t in turns] == [1, 2, 3]  # turn 1 finds the shared instructions
    for before, turn in zip(turns, turns[1:], strict=False):
        # all of the turn before, prompt and output, but its last partial block
        assert turn["hit_tokens"] >= (before["prompt_tokens"] + 4) // 128 * 128 - 128
        assert turn["hit_tokens"] > 0
    assert all(t["hit_tokens"] == 0 for t in uncached["per_turn"])
    repeat = report["identical_repeat"]["cached"]
    assert repeat["first_hit_tokens"] == 0
    assert repeat["second_hit_tokens"] == (repeat["prompt_tokens"] - 1) // 128 * 128
