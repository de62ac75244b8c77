"""The checked-in modules are what `python -m sparrow.proto.generate` writes from
`worker.proto` (where grpcio-tools is installed), and carry no runtime version check."""

from pathlib import Path

import pytest

from sparrow.proto import generate


def test_generated_modules_carry_no_runtime_check():
    text = (generate.HERE / "worker_pb2.py").read_text()
    assert "runtime_version" not in text and "Protobuf Python Version: 4.25" in text
    assert "GRPC_GENERATED_VERSION" not in (generate.HERE / "worker_pb2_grpc.py").read_text()


def test_generated_modules_match_the_proto(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    assert generate.main(tmp_path) == 0
    for name in ("worker_pb2.py", "worker_pb2_grpc.py"):
        fresh = (tmp_path / "sparrow" / "proto" / name).read_text()
        assert fresh == (generate.HERE / name).read_text(), f"{name} is stale: regenerate it"
