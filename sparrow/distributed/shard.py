"""Each rank's share of a Qwen3.5/3.6 MoE or MiniMax M3 model under tensor parallelism of
size S: the attention heads (and M3's index heads, one per KV group), the Gated DeltaNet
key and value heads (with their conv channels, gates and decay), and the intermediate
dimension of every expert, of the shared expert and of M3's dense MLPs, and the vocabulary
rows of the embedding and lm_head are split in S contiguous blocks; the rest (norms,
router, M3's index key) is replicated.
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
from sparrow.models import minimax_m3, qwen3_5_moe


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    experts: bool = False  # expert parallelism: whole experts per rank


Cut = tuple[int, list[tuple[int, int]]]  # (dimension, [start, stop) ranges concatenated)


def _sizes(cfg, experts: bool) -> tuple[list[str], dict[str, int]]:
    """The config fields split across ranks, and the input dims of the split projections
    (each rank's part must be whole quantisation groups)."""
    heads = ["num_attention_heads", "num_kv_heads"]
    attention = cfg.num_attention_heads * cfg.head_dim
    if isinstance(cfg, qwen3_5_moe.ModelArgs):
        fields = heads + [
            "linear_num_key_heads",
            "linear_num_value_heads",
            "shared_expert_intermediate_size",
        ]
        inputs = {
            "attention heads x head_dim": attention,
            "value heads x linear_value_head_dim": cfg.linear_num_value_heads
            * cfg.linear_value_head_dim,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        }
    elif isinstance(cfg, minimax_m3.ModelArgs):
        fields = heads + ["index_n_heads", "shared_intermediate_size", "dense_intermediate_size"]
        inputs = {
            "attention heads x head_dim": attention,
            "shared_intermediate_size": cfg.shared_intermediate_size,
            "dense_intermediate_size": cfg.dense_intermediate_size,
        }
    else:
        raise ConfigError(
            f"tensor parallelism runs Qwen3.5/3.6 and MiniMax M3, not {type(cfg).__module__}"
        )
    if not experts:  # the experts' columns split too
        fields.append("moe_intermediate_size")
        inputs["moe_intermediate_size"] = cfg.moe_intermediate_size
    return fields, inputs


def shard_args(cfg, shard: Shard):
    """The config of one rank's model: the split sizes divided by the group's size, and
    with expert parallelism the rank's range of experts."""
    size = shard.size
    if size == 1:
        return cfg
    fields, inputs = _sizes(cfg, shard.experts)
    for name in fields + (["num_experts"] if shard.experts else []) + ["vocab_size"]:
        if getattr(cfg, name) % size:
            raise ConfigError(
                f"{name} {getattr(cfg, name)} is not divisible by tensor_parallel_size {size}"
            )
    quant = cfg.quantization
    for what, k in inputs.items() if quant is not None else ():
        if (k // size) % quant.group_size:
            raise ConfigError(
                f"{what} {k} over tensor_parallel_size {size} is not a "
                f"multiple of the quantisation group {quant.group_size}"
            )
    rows, held = cfg.vocab_size // size, cfg.num_experts // size
    experts = {"expert_range": (shard.rank * held, held)} if shard.experts else {}
    return cfg.replace(
        **{name: getattr(cfg, name) // size for name in fields},
        **experts,
        vocab_range=(shard.rank * rows, rows),
    )


def pieces(param: str, cfg, shard: Shard) -> Cut | None:
    """What rank `shard.rank` reads of the checkpoint tensor that maps to `param` (our name,
    before experts are fused), for the full model `cfg`; None: the whole tensor
    (replicated)."""
    r, s = shard.rank, shard.size

    def block(total: int, offset: int = 0) -> tuple[int, int]:
        n = total // s
        return offset + r * n, offset + (r + 1) * n

    def mlp(proj: str, inter: int) -> Cut | None:
        """A gated MLP's projections: [gate | up] rows (fused or apart), down's columns."""
        if proj == "gate_up_proj":
            return 0, [block(inter), block(inter, inter)]
        if proj in ("gate_proj", "up_proj"):
            return 0, [block(inter)]
        return (1, [block(inter)]) if proj == "down_proj" else None

    parts = param.split(".")
    module = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
    if param in ("embed_tokens.weight", "lm_head.weight"):  # a block of the vocabulary
        return 0, [block(cfg.vocab_size)]
    qwen = isinstance(cfg, qwen3_5_moe.ModelArgs)
    if ".self_attn.indexer." in param:  # M3: one index head per KV group
        return (0, [block(cfg.index_n_heads * cfg.index_head_dim)]) if module == "q_proj" else None
    if ".self_attn." in param:
        d = cfg.head_dim
        rows = {
            "q_proj": (2 if qwen else 1) * cfg.num_attention_heads * d,  # Qwen: q | gate
            "k_proj": cfg.num_kv_heads * d,
            "v_proj": cfg.num_kv_heads * d,
        }
        if module in rows:
            return 0, [block(rows[module])]
        return (1, [block(cfg.num_attention_heads * d)]) if module == "o_proj" else None
    if ".linear_attn." in param:
        kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        if module in ("in_proj_qkv", "conv1d"):
            return 0, [block(kd), block(kd, kd), block(vd, 2 * kd)]
        if module == "in_proj_z":
            return 0, [block(vd)]
        if module in ("in_proj_b", "in_proj_a", "dt_bias", "A_log"):
            return 0, [block(cfg.linear_num_value_heads)]
        return (1, [block(vd)]) if module == "out_proj" else None
    if ".mlp.experts." in param and shard.experts:  # fused: this rank's experts; one: whole
        fused = param.endswith(("gate_up_proj", "experts.down_proj"))
        return (0, [block(cfg.num_experts)]) if fused else None
    if ".mlp.experts." in param:
        inter = cfg.moe_intermediate_size
        if param.endswith("gate_up_proj"):  # fused [E, 2I, hidden]
            return 1, [block(inter), block(inter, inter)]
        if param.endswith("experts.down_proj"):  # fused [E, hidden, I]
            return 2, [block(inter)]
        return mlp(module, inter)  # one expert's [I, hidden] or [hidden, I]
    if ".mlp.shared_expert." in param or ".mlp.shared_experts." in param:
        return mlp(
            module, cfg.shared_expert_intermediate_size if qwen else cfg.shared_intermediate_size
        )
    if ".mlp." in param and not qwen:  # M3's dense layers (the router stays whole)
        return mlp(module, cfg.dense_intermediate_size)
    return None


def cut_shape(shape: tuple[int, ...], cut: Cut | None) -> tuple[int, ...]:
    if cut is None:
        return shape
    dim, ranges = cut
    return (*shape[:dim], sum(b - a for a, b in ranges), *shape[dim + 1 :])


def take(source, ndim: int, cut: Cut | None) -> torch.Tensor:
    """The ranges of `cut` from `source`, anything indexable like a tensor (a tensor, or a
    safetensors slice, which then reads only those ranges), concatenated."""
    if cut is None:
        return source[tuple(slice(None) for _ in range(ndim))]
    dim, ranges = cut
    parts = [
        source[tuple(slice(a, b) if d == dim else slice(None) for d in range(ndim))]
        for a, b in ranges
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
