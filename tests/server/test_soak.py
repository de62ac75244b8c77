"""The soak command end to end at CI size: it spawns the server on the built-in model, drives
a few seconds of mixed traffic (good, cancelled, hung-up and bad requests) and finds nothing
unexpected."""

import json

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")


def test_short_soak_has_no_unexpected_outcomes(tmp_path, monkeypatch):
    from sparrow.bench import soak

    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "soak.json"
    code = soak.main(
        [
            "--spawn",
            "--minutes",
            "0.1",
            "--concurrency",
            "4",
            "--seed",
            "1",
            "--sample-s",
            "1",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert report["unexpected_total"] == 0, report["unexpected_examples"]
    assert code == 0 and report["health_after"] == 200
    outcomes = report["outcomes"]
    assert sum(outcomes["ok"].values()) > 0 and sum(outcomes["expected_4xx"].values()) > 0
    assert report["requests"] == sum(sum(c.values()) for c in outcomes.values())
    rss = report["rss"]
    assert rss["series"] and rss["after_warmup_mb"] > 0 and rss["max_mb"] >= rss["last_mb"]
