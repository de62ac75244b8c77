"""A model as an `EngineConfig` names it: a checkpoint directory or Hub id (or the built-in
default) loaded onto a device, or, with `load_format="dummy"`, random weights drawn there."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from sparrow.config import EngineConfig
from sparrow.distributed.shard import Shard
from sparrow.loader.formats import describe, summary_line
from sparrow.loader.hub import resolve_model
from sparrow.loader.random_checkpoint import random_model
from sparrow.loader.vision import attach_vision, names_vision, random_vision
from sparrow.loader.weights import load_checkpoint, rank_args
from sparrow.models import load_model_args, read_config

logger = logging.getLogger(__name__)


def checkpoint_dir(config: EngineConfig) -> Path:
    """The checkpoint directory `config` names: `config.model` (a directory, or a Hub id
    resolved through the Hub's cache, `loader.hub`), or the built-in default. Random weights
    (`load_format` "dummy") take the config and tokenizer files of a Hub snapshot only."""
    weights = config.load_format != "dummy"
    return resolve_model(config.model, config.revision, config.download_dir, weights=weights)


def resolve_checkpoint(config: EngineConfig) -> EngineConfig:
    """`config` with its model named by directory: a Hub id is resolved once, here, so that
    every rank and every later `checkpoint_dir` reads the same snapshot."""
    if config.model is None:
        return config
    return replace(config, model=str(checkpoint_dir(config)))


def load_model(
    config: EngineConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    progress: bool = False,
    shard: Shard | None = None,
) -> torch.nn.Module:
    """The model `config` names, on `device` with activations in `dtype`; with `shard`, one
    rank's share of it under tensor parallelism (dummy weights: each rank draws its own
    share). The vision tower comes too where the checkpoint has one. What the weights are
    (`model.weight_format`, `formats.describe`) is logged once."""
    model_dir = checkpoint_dir(config)
    if config.load_format == "dummy":
        args, seed = load_model_args(model_dir), config.seed
        if shard is not None:
            quant = config.quantization or args.quantization
            args = rank_args(args.replace(quantization=quant), shard)
            seed += shard.rank
        model = random_model(args, seed, device, dtype, config.quantization)
        model.weight_format = describe(model, "dummy", config.quantization is not None)
        hf_config = read_config(model_dir)
        if names_vision(hf_config):  # the tower too, as vLLM draws every weight
            model.visual = random_vision(hf_config, seed, device, dtype)
    else:
        model = load_checkpoint(
            model_dir, device, dtype, quantize=config.quantization, progress=progress, shard=shard
        )
        attach_vision(model, model_dir)  # images and videos, where the checkpoint sees
    if shard is None or shard.rank == 0:
        logger.info("weights: %s", summary_line(model.weight_format))
    return model
