"""Programmatic dependent launch: off on CPU tensors, and a kernel launched with it computes
what it computes without (GPU)."""

import pytest
import torch

from sparrow.kernels import pdl
from sparrow.kernels.rms_norm.norm import add_rms_norm
from tests.conftest import rel_err


def test_never_on_cpu():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_args(torch.zeros(1), (1,)) == {"USE_PDL": False}


def test_only_small_grids(monkeypatch):
    """Where PDL is available, launches of up to MAX_PROGRAMS programs take it."""
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    t = torch.zeros(1)
    assert pdl.launch_args(t, (16, 8, 1)) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_args(t, (pdl.MAX_PROGRAMS,))["USE_PDL"]
    assert pdl.launch_args(t, (pdl.MAX_PROGRAMS + 1,)) == {"USE_PDL": False}
    assert pdl.launch_args(t, (4096, 32)) == {"USE_PDL": False}  # a prefill norm


@pytest.mark.gpu
def test_chain_of_pdl_kernels_gpu(monkeypatch):
    """Twenty dependent residual-add + norm kernels launched with PDL, eagerly and from a
    CUDA graph, give the same result as without."""
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16)

    def chain():
        s, y = x, x
        for _ in range(20):
            s, y = add_rms_norm(y, s, w, 1e-6)
        return y

    assert pdl.enabled(x.device) == (torch.cuda.get_device_capability()[0] >= 9)
    with monkeypatch.context() as m:
        m.setattr(pdl, "enabled", lambda device: False)
        expected = chain()
    assert rel_err(chain(), expected) == 0
    graph = torch.cuda.CUDAGraph()
    chain()  # compile outside the capture
    with torch.cuda.graph(graph):
        out = chain()
    graph.replay()
    assert rel_err(out, expected) == 0
