"""Tiny models of every family written in their release layouts, shared by the tests of what
Sparrow writes (`test_release_layouts.py`) and of mlx-lm reading it (`test_mlx_lm.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sparrow.config import QuantConfig
from sparrow.loader.mlx_writer import save_mlx_checkpoint
from sparrow.loader.random_checkpoint import random_model
from sparrow.loader.weights import load_checkpoint
from sparrow.loader.writer import save_checkpoint
from sparrow.models import PRESETS
from sparrow.worker.sequences import SequenceBatch

TOL = 1e-4  # fp32 logits, relative to the largest
# Every input dim a whole number of 64-wide groups: every matrix but M3's routers is 4-bit.
TINY = {
    name: PRESETS[preset].replace(vocab_size=320, initializer_range=0.1)
    for name, preset in (
        ("qwen3_5_moe", "qwen3.6-tiny"),
        ("qwen3_next", "qwen3-next-tiny"),
        ("qwen3_moe", "qwen3-moe-tiny"),
        ("minimax_m3", "minimax-m3-tiny"),  # MSA blocks of 16, top 2: IDS spans 5 blocks
    )
}
IDS = [(7 * i + 3) % 320 for i in range(70)]


@dataclass(frozen=True)
class Written:
    """A family's tiny model as float and 4-bit checkpoints Sparrow wrote."""

    name: str
    model: torch.nn.Module  # float
    path: Path  # its release checkpoint
    quantized: torch.nn.Module  # 4-bit, quantised on load from `path`
    mlx: Path  # its MLX checkpoint


def write(name: str, root: Path) -> Written:
    model = randomised(TINY[name])
    path = save_checkpoint(model, root / "float")
    quantized = load_checkpoint(path, quantize=QuantConfig.mlx_default(), progress=False)
    return Written(name, model, path, quantized, save_mlx_checkpoint(quantized, root / "4bit"))


def randomised(cfg, seed: int = 1) -> torch.nn.Module:
    """A random fp32 model with its 1-D weights (norms, decays, biases) off their init, so a
    norm read with the wrong offset shows."""
    model = random_model(cfg, seed=seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def names(path: Path) -> set[str]:
    out = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out |= set(f.keys())
    return out


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model.logits(SequenceBatch(model, 1, len(ids)).forward([ids]))


def assert_same(a: torch.nn.Module, b: torch.nn.Module, atol: float = 0.0) -> None:
    """The same parameters; within `atol` where given (MLX stores Qwen's zero-centred norm
    weights w as 1 + w, so w comes back rounded)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=atol, msg=k)
