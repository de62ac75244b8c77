"""Each rank's share of a model under tensor parallelism of size S, by the plan its model
file gives (`shard_plan(cfg, expert_parallel)`, as vLLM's parallel layers say how they
split): the config fields divided by S (heads, intermediate sizes) and, for each checkpoint
tensor, the dimension and the segments of it that split into S contiguous blocks. A tensor
no rule matches (norms, routers) is replicated. Each split block's output is a partial sum
that the layer all-reduces (`group.all_reduce` after the token mixer and after the MLP).
With expert parallelism the routed experts are split whole instead (rank r holds experts
r E / S to (r + 1) E / S; the router still scores all of them, and assignments to experts
held elsewhere contribute nothing on this rank).

`pieces` names, for one checkpoint tensor, the ranges a rank reads (one range, or one per
segment: three for a Gated DeltaNet's [q | k | v] rows, two for fused [gate | up] rows), so
a rank reads its share only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from sparrow.config import ConfigError


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    experts: bool = False  # expert parallelism: whole experts per rank


Cut = tuple[int, list[tuple[int, int]]]  # (dimension, [start, stop) ranges concatenated)


@dataclass(frozen=True)
class Split:
    """A tensor split along `dim`, whose segments `sizes` (concatenated) each split in S."""

    dim: int
    sizes: tuple[int, ...]


def rows(*sizes: int) -> Split:
    """Output rows (a column-parallel projection), in segments."""
    return Split(0, sizes)


def cols(size: int) -> Split:
    """Input columns (a row-parallel projection, whose outputs are partial sums)."""
    return Split(1, (size,))


Rule = tuple[str, Split | None]  # (regex searched in the parameter name, its split)


@dataclass(frozen=True)
class ShardPlan:
    """fields: ModelArgs fields divided by S; inputs: the input widths of row-parallel
    projections (each rank's part must be whole quantisation groups); rules: the first whose
    regex is found in a parameter name gives its split (None, or no rule: replicated)."""

    fields: tuple[str, ...]
    inputs: dict[str, int]
    rules: tuple[Rule, ...] = field(default=())

    def split(self, param: str) -> Split | None:
        for pattern, split in self.rules:
            if re.search(pattern, param):
                return split
        return None


def vocab_rules(vocab_size: int) -> list[Rule]:
    """A block of the vocabulary's embedding and lm_head rows per rank."""
    return [(r"^(embed_tokens|lm_head)\.weight$", rows(vocab_size))]


def gated_mlp_rules(prefix: str, intermediate: int) -> list[Rule]:
    """A SwiGLU MLP at `prefix` (a regex): its [gate | up] rows, fused or apart, and the
    columns of its down projection."""
    return [
        (rf"{prefix}\.gate_up_proj\.", rows(intermediate, intermediate)),
        (rf"{prefix}\.(gate_proj|up_proj)\.", rows(intermediate)),
        (rf"{prefix}\.down_proj\.", cols(intermediate)),
    ]


def expert_rules(num_experts: int, intermediate: int, expert_parallel: bool) -> list[Rule]:
    """Routed experts under `.mlp.experts.`: fused [E, 2I, hidden] / [E, hidden, I] tensors
    or one expert's projections (HF, or MiniMax's w1 / w3 / w2). Tensor parallel: every
    expert's intermediate columns; expert parallel: whole experts (a fused tensor's block of
    experts; one expert's tensors whole, the loader skipping experts held elsewhere)."""
    if expert_parallel:
        return [
            (r"\.mlp\.experts\.(gate_up_proj|down_proj)$", rows(num_experts)),
            (r"\.mlp\.experts\.", None),
        ]
    i = intermediate
    return [
        (r"\.mlp\.experts\.gate_up_proj$", Split(1, (i, i))),
        (r"\.mlp\.experts\.down_proj$", Split(2, (i,))),
        (r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.", rows(i)),
        (r"\.mlp\.experts\.\d+\.(down_proj|w2)\.", cols(i)),
    ]


def shard_args(cfg: Any, plan: ShardPlan, shard: Shard) -> Any:
    """The config of one rank's model: the plan's fields divided by the group's size, the
    rank's block of the vocabulary and, with expert parallelism, its range of experts."""
    size = shard.size
    if size == 1:
        return cfg
    names = list(plan.fields) + (["num_experts"] if shard.experts else []) + ["vocab_size"]
    for name in names:
        if getattr(cfg, name) % size:
            raise ConfigError(
                f"{name} {getattr(cfg, name)} is not divisible by tensor_parallel_size {size}"
            )
    quant = cfg.quantization
    for what, k in plan.inputs.items() if quant is not None else ():
        if (k // size) % quant.group_size:
            raise ConfigError(
                f"{what} {k} over tensor_parallel_size {size} is not a "
                f"multiple of the quantisation group {quant.group_size}"
            )
    rows_held, held = cfg.vocab_size // size, cfg.num_experts // size
    experts = {"expert_range": (shard.rank * held, held)} if shard.experts else {}
    return cfg.replace(
        **{name: getattr(cfg, name) // size for name in plan.fields},
        **experts,
        vocab_range=(shard.rank * rows_held, rows_held),
    )


def pieces(param: str, plan: ShardPlan, shard: Shard) -> Cut | None:
    """What rank `shard.rank` reads of the checkpoint tensor that maps to `param` (our name,
    before experts are fused), by the full model's `plan`; None: the whole tensor."""
    split = plan.split(param)
    if split is None:
        return None
    r, s = shard.rank, shard.size
    ranges, offset = [], 0
    for total in split.sizes:
        n = total // s
        ranges.append((offset + r * n, offset + (r + 1) * n))
        offset += total
    return split.dim, ranges


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
