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
