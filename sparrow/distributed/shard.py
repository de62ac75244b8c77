"""Each rank's share of a Qwen3.5/3.6 MoE model under tensor parallelism of size S: the
attention heads, the Gated DeltaNet key and value heads (with their conv channels, gates
and decay), and the intermediate dimension of every expert and of the shared expert are
split in S contiguous blocks; the rest (embedding, norms, router, lm_head) is replicated.
With expert parallelism the routed experts are split instead (rank r holds experts r E / S
to (r + 1) E / S whole; the router still scores all of them, and assignments to experts
held elsewhere contribute nothing on this rank). Each split block's output is a partial sum
that the layer all-reduces (`group.all_reduce` after the token mixer and after the MoE);
the routing itself is the same on every rank.

`pieces` names, for one checkpoint tensor, the dimension and the ranges of it that a rank
reads (one range, or three for the [q | k | v] rows of the Gated DeltaNet's projection and
conv, two for the [gate | up] rows of fused experts), so a rank reads its share only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.config import ConfigError
from sparrow.models.qwen3_5_moe import ModelArgs

SPLIT = ("num_attention_heads", "num_kv_heads", "linear_num_key_heads",
         "linear_num_value_heads", "moe_intermediate_size", "shared_expert_intermediate_size")


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    experts: bool = False  # expert parallelism: whole experts per rank


Cut = tuple[int, list[tuple[int, int]]]  # (dimension, [start, stop) ranges concatenated)


def shard_args(cfg, shard: Shard):
    """The config of one rank's model: the split sizes divided by the group's size, and
    with expert parallelism the rank's range of experts."""
    size = shard.size
    if size == 1:
        return cfg
    if not isinstance(cfg, ModelArgs):
        raise ConfigError(f"tensor parallelism runs Qwen3.5/3.6 MoE models, not "
                          f"{type(cfg).__module__.rsplit('.', 1)[-1]}")  # fmt: skip
    split = [n for n in SPLIT if not (shard.experts and n == "moe_intermediate_size")]
    for name in split + (["num_experts"] if shard.experts else []):
        if getattr(cfg, name) % size:
            raise ConfigError(f"{name} {getattr(cfg, name)} is not divisible by "
                              f"tensor_parallel_size {size}")  # fmt: skip
    quant = cfg.quantization
    if quant is not None:  # the split input dims: each rank's quantisation groups are whole
        inputs = {"attention heads x head_dim": cfg.num_attention_heads * cfg.head_dim,
                  "value heads x linear_value_head_dim":
                      cfg.linear_num_value_heads * cfg.linear_value_head_dim,
                  "moe_intermediate_size": cfg.moe_intermediate_size,
                  "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}
        if shard.experts:  # whole experts: their input dims are not split
            del inputs["moe_intermediate_size"]
        for what, k in inputs.items():
            if (k // size) % quant.group_size:
                raise ConfigError(f"{what} {k} over tensor_parallel_size {size} is not a "
                                  f"multiple of the quantisation group {quant.group_size}")
    held = cfg.num_experts // size
    experts = {"expert_range": (shard.rank * held, held)} if shard.experts else {}
    return cfg.replace(**{name: getattr(cfg, name) // size for name in split}, **experts)


def pieces(param: str, ndim: int, cfg: ModelArgs, shard: Shard) -> Cut | None:
    """What rank `shard.rank` reads of the checkpoint tensor that maps to `param` (our name,
    before experts are fused) with `ndim` dimensions, for the full model `cfg`; None: the
    whole tensor (replicated)."""
    r, s = shard.rank, shard.size

    def block(total: int, offset: int = 0) -> tuple[int, int]:
        n = total // s
        return offset + r * n, offset + (r + 1) * n

    head, tail = param.rsplit(".", 1)[0], param.rsplit(".", 1)[-1]
    if ".self_attn." in param:
        d = cfg.head_dim
        rows = {"q_proj": 2 * cfg.num_attention_heads * d, "k_proj": cfg.num_kv_heads * d,
                "v_proj": cfg.num_kv_heads * d}  # fmt: skip
        name = head.rsplit(".", 1)[-1]
        if name in rows:
            return 0, [block(rows[name])]
        if name == "o_proj":
            return 1, [block(cfg.num_attention_heads * d)]
        return None
    if ".linear_attn." in param:
        kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        heads = cfg.linear_num_value_heads
        name = head.rsplit(".", 1)[-1] if tail in ("weight",) else tail
        if name in ("in_proj_qkv", "conv1d"):
            return 0, [block(kd), block(kd, kd), block(vd, 2 * kd)]
        if name == "in_proj_z":
            return 0, [block(vd)]
        if name in ("in_proj_b", "in_proj_a", "dt_bias", "A_log"):
            return 0, [block(heads)]
        if name == "out_proj":
            return 1, [block(vd)]
        return None
    if ".mlp.experts." in param and shard.experts:  # fused: this rank's experts; one: whole
        fused = param.endswith(("gate_up_proj", "experts.down_proj"))
        return (0, [block(cfg.num_experts)]) if fused else None
    if ".mlp.experts." in param:
        inter = cfg.moe_intermediate_size
        if param.endswith("gate_up_proj"):  # fused [E, 2I, hidden]
            return 1, [block(inter), block(inter, inter)]
        if param.endswith("experts.down_proj"):  # fused [E, hidden, I]
            return 2, [block(inter)]
        proj = head.rsplit(".", 1)[-1]  # per expert: [I, hidden] or [hidden, I]
        return (0, [block(inter)]) if proj in ("gate_proj", "up_proj") else (1, [block(inter)])
    if ".mlp.shared_expert." in param:
        proj = head.rsplit(".", 1)[-1]
        inter = cfg.shared_expert_intermediate_size
        return (0, [block(inter)]) if proj in ("gate_proj", "up_proj") else (1, [block(inter)])
    return None


def cut_shape(shape: tuple[int, ...], cut: Cut | None) -> tuple[int, ...]:
    if cut is None:
        return shape
    dim, ranges = cut
    return (*shape[:dim], sum(b - a for a, b in ranges), *shape[dim + 1:])


def take(source, ndim: int, cut: Cut | None) -> torch.Tensor:
    """The ranges of `cut` from `source`, anything indexable like a tensor (a tensor, or a
    safetensors slice, which then reads only those ranges), concatenated."""
    if cut is None:
        return source[tuple(slice(None) for _ in range(ndim))]
    dim, ranges = cut
    parts = [source[tuple(slice(a, b) if d == dim else slice(None) for d in range(ndim))]
             for a, b in ranges]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
