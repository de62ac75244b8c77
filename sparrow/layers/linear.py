"""Several projections of one input as one matmul (one GEMV launch in decode).

`FusedLinears` concatenates the modules' weights along the output dim and turns each
module's parameters into views of its rows: parameter names and the state dict are
unchanged (checkpoints save as before), the memory is the same once the originals are
released, and the fused call returns each projection's output as a view of one result.
If the modules' parameters are replaced later (`.to()`, `load_state_dict`, a deep copy), the
views no longer match and the group runs one module at a time again.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedLinears:
    def __init__(self, whole: nn.Module, sizes: list[int], modules: list[nn.Module]):
        self.whole, self.sizes = whole, sizes
        self.pad = whole.out_features - sum(sizes)  # zero rows up to a multiple of 8
        self.views = [
            (m, name, p.data_ptr())
            for m in modules
            for name, p in m.named_parameters(recurse=False)
        ]

    def intact(self) -> bool:
        """Whether every module still holds its view of the fused weights (host-side check)."""
        return all(getattr(m, name).data_ptr() == ptr for m, name, ptr in self.views)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.split(self.whole(x))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each module's output (a view) from an output y of the whole."""
        return y.split([*self.sizes, self.pad], dim=-1)[: len(self.sizes)]


def is_quantized(m: nn.Module) -> bool:  # a QuantizedLinear (not imported: no cycle)
    return hasattr(m, "spec") and getattr(m, "logical_shapes", {}).keys() == {"weight"}


def _signature(m: nn.Module):
    if is_quantized(m):
        return (type(m), m.in_features, m.spec, m.scales.dtype, m.weight.device)
    if type(m) is nn.Linear and m.bias is None:
        return (nn.Linear, m.in_features, m.weight.dtype, m.weight.device)
    return None


def fuse_linears(modules: list[nn.Module]) -> FusedLinears | None:
    """Fuse bias-free linear layers of one input and one format; None if they differ."""
    sig = _signature(modules[0])
    if sig is None or any(_signature(m) != sig for m in modules[1:]):
        return None
    first, sizes = modules[0], [m.out_features for m in modules]
    # Zero rows up to a multiple of 8 outputs: cuBLAS runs an unvectorised kernel on odd
    # widths (the 257-wide router + shared gate unpadded: 82 us per layer at 4K tokens on the H200,
    # `cutlass_75 ... align1` in the e2e prefill profile); the split drops them.
    pad = -sum(sizes) % 8
    with torch.device("meta"):
        if is_quantized(first):
            whole = type(first)(first.in_features, sum(sizes) + pad, first.spec, first.scales.dtype)
        else:
            whole = nn.Linear(first.in_features, sum(sizes) + pad, bias=False)
    for name, _ in first.named_parameters(recurse=False):
        parts = [getattr(m, name) for m in modules]
        cat = torch.cat([*parts, parts[0].new_zeros(pad, *parts[0].shape[1:])])
        setattr(whole, name, nn.Parameter(cat, requires_grad=False))
        for m, rows in zip(modules, cat.split([*sizes, pad])[: len(sizes)], strict=True):
            setattr(m, name, nn.Parameter(rows, requires_grad=False))
    return FusedLinears(whole, sizes, modules)


def fuse_all(model: nn.Module) -> None:
    """Fuse the projection groups of every layer of a loaded model (or of one layer)."""
    for module in model.modules():
        if isinstance(module, Projections):
            module.fuse_projections()


class Projections:
    """Mixin for a layer with projections of one input: `fuse_projections` (called once the
    weights are loaded) fuses the groups listed in `FUSED`; `project` runs a group, fused
    if it could be, else one module at a time."""

    FUSED: dict[str, tuple[str, ...]] = {}

    def fuse_projections(self) -> None:
        for group, names in self.FUSED.items():
            fused = fuse_linears([self.get_submodule(n) for n in names])
            self.__dict__[f"_fused_{group}"] = fused

    def fused(self, group: str) -> FusedLinears | None:
        """The group's fused projection, if it was fused and its weights are still in place."""
        fused = self.__dict__.get(f"_fused_{group}")
        return fused if fused is not None and fused.intact() else None

    def project(self, group: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fused = self.fused(group)
        if fused is not None:
            return fused(x)
        return tuple(self.get_submodule(n)(x) for n in self.FUSED[group])
