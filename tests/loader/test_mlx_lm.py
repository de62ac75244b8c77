"""mlx-lm (0.32, on the CPU in float32) reads what Sparrow writes, unchanged: every family's
float release and MLX 4-bit checkpoints load with `load_model(strict=True)` and give Sparrow's
logits; what mlx-lm saves of them loads in Sparrow bit for bit; the built-in model loads;
MiniMax M3 with block selection that matters (320 tokens, blocks of 16, top 4) selects as
Sparrow does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sparrow.assets import default_checkpoint
from sparrow.loader.weights import load_checkpoint, load_tensors
from sparrow.loader.writer import save_checkpoint
from sparrow.models import get_architecture
from tests.conftest import rel_err
from tests.loader.layouts import IDS, TINY, TOL, assert_same, logits, randomised

mx = pytest.importorskip("mlx.core")
mlx_utils = pytest.importorskip("mlx_lm.utils")


def mlx_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """mlx-lm's fp32 logits [T, V] for one prompt, from the checkpoint at `path`."""
    model, _ = mlx_utils.load_model(Path(path), strict=True)
    model.set_dtype(mx.float32)  # float experts run only in fp32 on the CPU (GatherMM)
    out = model(mx.array([ids])).astype(mx.float32)
    return torch.from_numpy(np.array(out))[0]


def assert_agree(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    err = rel_err(actual, expected)
    assert err < tol, f"rel err {err:.2e}"
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_mlx_lm_reads_what_sparrow_writes(written, kind):
    model, path = (
        (written.model, written.path) if kind == "float" else (written.quantized, written.mlx)
    )
    assert_agree(mlx_logits(path, IDS), logits(model, IDS))


@pytest.mark.parametrize("family", ["qwen", "m3"])
def test_mlx_lm_saves_what_sparrow_reads_bit_for_bit(request, family, tmp_path):
    """Sparrow's MLX checkpoint -> mlx-lm `load_model` -> `save_model` + `save_config` ->
    Sparrow: the same tensors as from Sparrow's own file."""
    written = request.getfixturevalue(family)
    model, config = mlx_utils.load_model(written.mlx, strict=True)
    mlx_utils.save_model(tmp_path, model)
    mlx_utils.save_config(config, tmp_path / "config.json")
    assert_same(load_checkpoint(tmp_path, progress=False), load_checkpoint(written.mlx))


def test_builtin_model_loads_in_mlx_lm():
    """The built-in model (bf16) as mlx-lm loads it: its `sanitize` shifts the zero-centred
    norm weights to 1 + w in bf16, rounding them (HF and Sparrow take 1 + w in fp32), so
    Sparrow's model with the same rounding is the reference."""
    path = default_checkpoint()
    ours = load_checkpoint(path, progress=False)  # bf16 weights in an fp32 model
    arch = get_architecture(ours.config.architecture)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(arch.from_mlx(name, arch.to_mlx(name, p.bfloat16())))
    ids = [(37 * i + 5) % ours.config.vocab_size for i in range(48)]
    assert_agree(mlx_logits(path, ids), logits(ours, ids))


def test_m3_block_selection_agrees(tmp_path):
    """320 tokens in MSA blocks of 16 (20 blocks), the top 4 selected per query and KV group:
    mlx-lm and Sparrow agree on every position's top-1 and the logits."""
    cfg = TINY["minimax_m3"].replace(index_topk_blocks=4)
    model = randomised(cfg, seed=5)
    save_checkpoint(model, tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (320,), generator=torch.Generator().manual_seed(6))
    ours = logits(model, ids.tolist())
    every_block = load_tensors(cfg.replace(index_topk_blocks=20), model.state_dict())
    assert rel_err(logits(every_block, ids.tolist()), ours) > 1e-2  # the selection matters
    assert_agree(mlx_logits(tmp_path, ids.tolist()), ours)
