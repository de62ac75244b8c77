"""Random weights for tests and benchmarks.

Each parameter is drawn as its architecture's `init` says (HF's `_init_weights` of the
family, so activations stay finite through 40-60 layers: matrices N(0, initializer_range),
norm weights 0 or 1 by the norm's kind, and the like).

Weights can be written as a checkpoint directory in the layout of the family's release
(`write_random_checkpoint`, what `sparrow checkpoint random` runs) or materialised directly
on a device with no file (`random_model`), which is how full-size benchmarks run on a GPU
whose disk is smaller than the bf16 checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from sparrow.config import QuantConfig
from sparrow.loader.weights import build_empty_model, load_tensors
from sparrow.loader.writer import release_config, release_tensors, write_checkpoint
from sparrow.models import PRESETS, get_architecture
from sparrow.models.interface import Init, ModelArgs

__all__ = ["PRESETS", "random_model", "random_tensors", "write_random_checkpoint"]

logger = logging.getLogger(__name__)


def _init(
    init: Init, shape: tuple[int, ...], std: float, gen: torch.Generator, **kw
) -> torch.Tensor:
    if init is Init.LOG_UNIFORM:
        return torch.empty(shape, **kw).uniform_(0.01, 16, generator=gen).log_()
    if init is Init.ONES:
        return torch.ones(shape, **kw)
    if init is Init.ZEROS:
        return torch.zeros(shape, **kw)
    return torch.empty(shape, **kw).normal_(0.0, std, generator=gen)


def random_tensors(
    cfg: ModelArgs,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (parameter name, tensor) one at a time, seeded and in a fixed order (the names of
    the model's parameters, which `load_tensors` takes as they are)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    init = get_architecture(cfg.architecture).init
    model = build_empty_model(cfg)
    for param, p in model.named_parameters():
        if param == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        # Generate in fp32 and round, so bf16 and fp32 checkpoints of one seed agree.
        t = _init(init(param), tuple(p.shape), cfg.initializer_range, gen, device=device)
        yield param, t.to(dtype)


def _split_experts(
    tensors: Iterable[tuple[str, torch.Tensor]], inter: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused expert tensors (`experts.gate_up_proj`, `experts.down_proj`) as HF's
    `save_pretrained` writes them: `experts.E.{gate,up,down}_proj.weight`."""
    for name, fused in tensors:
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            yield name, fused
            continue
        base = name.rsplit(".", 1)[0]
        for e, w in enumerate(fused):
            if name.endswith("gate_up_proj"):
                yield f"{base}.{e}.gate_proj.weight", w[:inter].clone()
                yield f"{base}.{e}.up_proj.weight", w[inter:].clone()
            else:
                yield f"{base}.{e}.down_proj.weight", w.clone()


def random_model(
    cfg: ModelArgs,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    quantize: QuantConfig | None = None,
) -> torch.nn.Module:
    """A model with random weights materialised directly on `device` (no checkpoint file),
    quantised tensor by tensor when `quantize` is given (the float model never exists)."""
    return load_tensors(
        cfg,
        random_tensors(cfg, seed, device, dtype),
        device,
        dtype,
        where="random weights",
        quantize=quantize,
    )


def write_random_checkpoint(
    out_dir: str | Path,
    cfg: ModelArgs,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = 4 << 30,
    per_expert: bool = False,
    tokenizer: bool = True,
    progress: bool = True,
) -> Path:
    """Write config.json, safetensors shard(s) (+ index when more than one) and tokenizer
    files to `out_dir`, in the layout of the family's release (`writer.release_tensors`).
    Tensors are generated and written shard by shard. The config keeps the family's
    `vision_config` (the tower is not written: loads leave it out, dummy loads draw it).
    `per_expert`: experts the release keeps fused (Qwen3.5/3.6) are written one tensor per
    expert, as HF's `save_pretrained` writes them."""
    tensors = release_tensors(cfg, random_tensors(cfg, seed, "cpu", dtype))
    if per_expert:
        tensors = _split_experts(tensors, cfg.moe_intermediate_size)
    config = release_config(cfg, dtype, vision=True)
    out = write_checkpoint(out_dir, config, tensors, shard_bytes, progress)
    if tokenizer:
        from sparrow.tokenizer import write_tokenizer_files

        write_tokenizer_files(out, get_architecture(cfg.architecture).SPEAKS.tokenizer)
    return out


TINY_PRESET = "qwen3.6-tiny"


def preset_dir(name: str) -> Path:
    """A new temporary directory holding only the config.json of preset `name`: loaded with
    `load_format="dummy"`, its weights are drawn where the model lives (no file)."""
    path = Path(tempfile.mkdtemp(prefix=f"sparrow-{name}-"))
    (path / "config.json").write_text(json.dumps(PRESETS[name].to_hf_config()))
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("SPARROW_CACHE", Path.home() / ".cache" / "sparrow"))


def tiny_random_checkpoint() -> Path:
    """A small random checkpoint with the full Qwen3.5/3.6 vocabulary (`TINY_PRESET`), made on
    first use in the cache directory: for tests and benchmarks of what the vocabulary decides
    (token-id ranges, grammar masks over 248,320 logits)."""
    path = cache_dir() / f"random-{TINY_PRESET}"
    if (path / "config.json").is_file():
        return path
    logger.info("creating a random checkpoint (%s) in %s", TINY_PRESET, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    try:
        write_random_checkpoint(tmp, PRESETS[TINY_PRESET], seed=0, progress=False)
        tmp.rename(path)
    except OSError:
        if not (path / "config.json").is_file():  # not a concurrent creator that won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
