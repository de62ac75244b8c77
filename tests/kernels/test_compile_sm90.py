"""Every Triton kernel compiles for Hopper (sm_90) at the model's real shapes, without a GPU.

The interpreter (how CPU tests run kernels) accepts code the GPU compiler rejects (e.g. a
constexpr assigned in an unrolled loop), so CI also runs the real compiler down to machine
code (PTX, then a cubin from the ptxas bundled with Triton) for each kernel as the model
launches it (`sm90_cases.py`). Registers and spills are printed (`pytest -rP`), not asserted.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.sm90_cases import CASES

if torch.cuda.is_available():
    pytest.skip("a GPU runs the kernels themselves (pytest -m gpu)", allow_module_level=True)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_cases"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in rows}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiles_for_sm90(compiled, case):
    result = compiled[case]
    assert "error" not in result, result["error"]
    print(
        f"{case}: {result['registers']} registers, {result['spills']} bytes spilled, "
        f"{result['shared_bytes']} B shared"
    )
    assert result["cubin"]
