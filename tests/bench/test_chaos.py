"""`python -m sparrow.bench.chaos` for half a minute on the built-in model (CPU): a gateway
over two batch-invariant workers, four clients, a worker killed or frozen every 4 s. No
client sees an error and every compared stream, resumed or not, carries its reference's
tokens."""

import json

import pytest

pytest.importorskip("uvicorn")

from sparrow.bench.chaos import main  # noqa: E402


def test_chaos_run_without_client_visible_errors(tmp_path):
    out = tmp_path / "chaos.json"
    args = ["--workers", "2", "--minutes", "0.5", "--concurrency", "4", "--fault-every", "4"]
    code = main([*args, "--bodies", "16", "--seed", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {"commit", "command", "outcomes", "compared", "faults", "time_lost", "rss"} <= set(
        report
    )
    assert report["unexpected_total"] == 0, report["unexpected_examples"]
    assert report["outcomes"]["ok"]["compared_stream"] == report["compared"]["streams"] > 0
    assert report["outcomes"]["expected_4xx"]
    compared = report["compared"]
    assert compared["differs"] == 0, compared["mismatches"]
    assert compared["identical"] == compared["streams"], compared["mismatches"]
    faults = report["faults"]
    assert sum(faults["by_kind"].values()) >= 1 and faults["unrecovered"] == 0
    assert report["gateway_resumed_total"] >= report["time_lost"]["resumed_compared"]
    assert report["health_after"] == 200 and report["rss"]["after_warmup_mb"] > 0
    assert code == 0
