import importlib.metadata
import os
import platform
import time

import pytest
import torch

from sparrow.eval.measure import rel_err  # noqa: F401 (tests import it from here)
from sparrow.eval.report import write_report


def pytest_addoption(parser):
    parser.addoption(
        "--record",
        metavar="PATH",
        help="write the run's summary as JSON (commit, device, versions, outcomes, failures)",
    )


def pytest_configure(config):
    if config.getoption("record"):
        config.pluginmanager.register(_Record(config.getoption("record")), "sparrow-record")


class _Record:
    """`--record PATH`: what a GPU test record under docs/bench/ holds (`write_report` adds
    the commit and the SPARROW_* settings)."""

    def __init__(self, path: str):
        self.path, self.start = path, time.time()
        self.outcomes: dict[str, int] = {}
        self.failures: list[dict] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            outcome = report.outcome
        elif report.failed or report.skipped:
            outcome = "error" if report.failed else "skipped"
        else:
            return
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if report.failed:
            message = str(report.longrepr).strip().splitlines() or [""]
            self.failures.append({"test": report.nodeid, "message": message[-1][:500]})

    def pytest_sessionfinish(self, session, exitstatus):
        versions = {"python": platform.python_version()}
        for name in ("torch", "triton", "transformers"):
            versions[name] = importlib.metadata.version(name)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        summary = {
            "command": "python -m pytest " + " ".join(session.config.invocation_params.args),
            "device": device,
            "versions": versions,
            "exit_status": int(exitstatus),
            "seconds": round(time.time() - self.start, 1),
            "outcomes": self.outcomes,
            "failures": self.failures,
        }
        write_report(self.path, summary)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: matrices N(0, 1 / fan_in), norm weights 1 + N(0, 0.2^2), biases
    N(0, 0.2^2); HF's init (LayerNorm 1 / 0, zero biases, std 0.02) would hide a wrong bias,
    norm or near-uniform attention."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise / p[0].numel() ** 0.5)
            elif name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)


# Without a GPU, Triton kernels run on CPU tensors under the interpreter (how CI tests them).
# Triton reads the variable when a kernel is defined, so it is set before tests import them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def hf_gdn_in_pytorch():
    """HF's GDN functions as written in PyTorch: where flash-linear-attention is importable
    HF runs its Triton kernels instead (TF32 dots on fp32 inputs), no longer an fp32 oracle
    (rel. errors of 2e-2..2e-1 on the H200 with fla 0.6.0 installed). Use it with
    `pytestmark = pytest.mark.usefixtures("hf_gdn_in_pytorch")`."""
    import inspect

    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    names = (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    )
    with pytest.MonkeyPatch.context() as mp:
        for name in names:
            mp.setattr(
                modeling_qwen3_5_moe, name, inspect.unwrap(getattr(modeling_qwen3_5_moe, name))
            )
        yield
