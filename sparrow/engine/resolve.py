"""EngineConfig's "auto" and None settings turned into values for one model on one device.

The device and dtype ("auto": CUDA in bfloat16 if present, else the CPU in float32), the
context limit (the model's own unless set lower; longer is an error, as in vLLM), the
per-request slots (one per sequence the scheduler may run), the block size (the model's MSA
block where it has one, which is then the only size allowed, else 128) and the number of KV
blocks: what fits in `gpu_memory_utilization` of the GPU's memory after the weights and the
per-slot states (on a CPU: 8K tokens' worth), a block's bytes counting MSA index keys in the
index cache dtype and a slot's the recurrent state in its dtype.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sparrow.config import CacheConfig, ConfigError, DeviceConfig, EngineConfig, SchedulerConfig
from sparrow.core.cache_spec import (
    CacheSpec,
    paged_bytes_per_block,
    required_block_size,
    slot_bytes,
    with_index_dtype,
    with_state_dtype,
)

if TYPE_CHECKING:
    from sparrow.models.interface import ModelArgs

CPU_CACHE_TOKENS = 8192
DEFAULT_BLOCK_SIZE = 128

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

logger = logging.getLogger(__name__)


def resolve_device(device: DeviceConfig) -> tuple[str, torch.dtype]:
    """(device name, activation dtype) for the device settings."""
    name = device.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but no CUDA device is available")
    if name.startswith("cuda") and device.batch_invariant:
        raise ConfigError("batch_invariant runs on the CPU: set device='cpu'")
    if device.dtype == "auto":
        return name, torch.bfloat16 if name.startswith("cuda") else torch.float32
    return name, TORCH_DTYPES[device.dtype]


def resolve(config: EngineConfig, model: torch.nn.Module) -> tuple[SchedulerConfig, CacheConfig]:
    """The scheduler and cache settings with every None filled in for `model` (loaded: its
    weights already take their memory). Prints the KV cache budget. ConfigError for an index
    cache dtype on a model without MSA layers, or a recurrent state dtype other than fp32 on
    a model without recurrent layers."""
    args, sched, cache = model.config, config.scheduler, config.cache
    try:
        specs = with_index_dtype(model.cache_specs(), cache.index_cache_dtype)
        specs = with_state_dtype(specs, cache.recurrent_state_dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    limit = args.max_context
    if sched.max_model_len is not None and sched.max_model_len > limit:
        raise ConfigError(
            f"max_model_len {sched.max_model_len} exceeds the model's context "
            f"of {limit} tokens ({_context_source(args)})"
        )
    sched = dataclasses.replace(sched, max_model_len=sched.max_model_len or limit)
    slots = cache.num_state_slots or sched.max_num_seqs
    block_size = _block_size(cache.block_size, model)
    recurrent = slot_bytes(specs, 1) > 0
    snapshots = cache.num_state_snapshots if cache.num_state_snapshots is not None else slots
    snapshots = snapshots if cache.enable_prefix_caching and recurrent else 0
    cache = dataclasses.replace(
        cache, num_state_slots=slots, block_size=block_size, num_state_snapshots=snapshots
    )
    if cache.num_blocks is None:
        blocks = _blocks_for_memory(cache, model, specs, sched.max_model_len * slots)
        cache = dataclasses.replace(cache, num_blocks=blocks)
    if snapshots:
        size = snapshots * slot_bytes(specs, model.dtype.itemsize)
        logger.info(
            "prefix caching: %d recurrent-state snapshots (%.2f GiB)", snapshots, size / 2**30
        )
    return sched, cache


def _context_source(args: ModelArgs) -> str:
    if args.max_context > args.max_position_embeddings:
        native = args.max_position_embeddings
        return f"max_position_embeddings {native} x {args.max_context / native:g} by rope scaling"
    return "max_position_embeddings; rope scaling in config.json extends it where supported"


def _block_size(asked: int | None, model: torch.nn.Module) -> int:
    """The cache page size: the model's MSA block if it has one (ConfigError for another)."""
    needed = required_block_size(model.cache_specs())
    if needed is not None and asked is not None and asked != needed:
        raise ConfigError(
            f"block_size {asked} does not match the model's MSA block of "
            f"{needed} tokens (index_block_size): a cache page must be one MSA "
            f"block"
        )
    return asked or needed or DEFAULT_BLOCK_SIZE


def _blocks_for_memory(
    cache: CacheConfig, model: torch.nn.Module, specs: Sequence[CacheSpec | None], most_tokens: int
) -> int:
    itemsize = model.dtype.itemsize
    per_block = paged_bytes_per_block(specs, cache.block_size, itemsize)
    if per_block == 0:  # no paged layer: blocks hold nothing, they only count tokens
        return -(-most_tokens // cache.block_size)
    if model.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(model.device)
        states = slot_bytes(specs, itemsize) * (
            cache.num_state_slots + 1 + cache.num_state_snapshots
        )
        # the share is this engine's own (as vLLM's): what other processes on the device hold
        # counts only where it leaves less free than the share would take
        own = torch.cuda.memory_reserved(model.device)
        usable = min(int(total * cache.gpu_memory_utilization) - own, free) - states
        blocks = max(0, usable // per_block)
    else:
        blocks = -(-CPU_CACHE_TOKENS // cache.block_size)
    if blocks < 1:
        raise ConfigError(
            "no memory left for the KV cache after loading the weights; raise "
            "gpu_memory_utilization or lower max_num_seqs"
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB)",
        blocks,
        cache.block_size,
        blocks * per_block / 2**30,
    )
    return blocks
