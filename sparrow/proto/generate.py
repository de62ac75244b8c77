"""Regenerate `worker_pb2.py` and `worker_pb2_grpc.py` from `worker.proto`.

    pip install grpcio-tools==1.62.3 && python -m sparrow.proto.generate

grpcio-tools 1.62 bundles protoc 25 (protobuf 4.25), whose modules carry no runtime version
check: they import under protobuf 4.25 through 6.x, and the stubs under any grpcio >= 1.62.
Later grpcio-tools releases write modules that refuse older runtimes.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # imports in the stubs read `from sparrow.proto import worker_pb2`


def main(out: Path = ROOT) -> int:
    """Write the modules under `out` (the repository root: in place); protoc's status."""
    from grpc_tools import protoc

    proto = HERE / "worker.proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        str(proto.relative_to(ROOT)),
    ]
    return protoc.main(args)


if __name__ == "__main__":
    sys.exit(main())
