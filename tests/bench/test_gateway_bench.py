"""`python -m sparrow.bench.gateway --overhead` on the built-in model (CPU): `sparrow serve`
and a worker behind a gateway, up at once, take the same load in alternating rounds; the
report compares them."""

import pytest

pytest.importorskip("uvicorn")

from sparrow.bench.gateway import main  # noqa: E402


def test_overhead_compares_the_gateway_with_serve(tmp_path):
    report = main(
        [
            "--overhead",
            "--concurrency",
            "1",
            "2",
            "--requests",
            "1",
            "--prefix",
            "16",
            "--rounds",
            "2",
            "--max-tokens",
            "4",
            "--out",
            str(tmp_path / "gateway.json"),
        ]
    )
    for side in ("serve", "gateway"):
        assert [row["concurrency"] for row in report[side]] == [1, 1, 2, 2]
        assert [row["round"] for row in report[side]] == [0, 1, 0, 1]
        assert all(row["output_tok_s"] > 0 and row["requests"] >= 1 for row in report[side])
    assert [r["concurrency"] for r in report["gateway_vs_serve"]] == [1, 2]
