"""Launching a Triton kernel without the JIT's per-call dispatch.

`kernel[grid](...)` binds the arguments, works out their specialisation, looks the compiled
kernel up and reads the current device and stream on every call. On the H200's host that is
17 us for a three-argument kernel and 31 us for the grouped GEMM's 35 arguments, against
about 5 us for the compiled kernel's own launcher. An eager prefill makes hundreds of
launches, and the GPU waits for them.

`fast(kernel)[grid](...)` takes the same arguments. It keeps, per call signature, the
compiled kernel the JIT chose on the first call and launches that one directly afterwards.
The signature covers what Triton specialises on:
- each tensor's dtype, device and 16-byte alignment;
- each integer's divisibility by 16, whether it is 1, and whether it fits in 32 bits;
- the constexprs and launch options, by value.
So a call that would compile differently never reuses a kernel.

An integer that counts tokens (a step's rows, rows times top-k, blocks of rows) is marked
`do_not_specialize` where a kernel takes it: otherwise a step whose count falls in a new
class (odd, a multiple of 16) compiles the kernel again in the middle of serving, 0.4-1 s
on the H200 for the grouped GEMM (a chat turn after a cached prefix: 1,081 ms with such a
compile, 80 without). Such a count only bounds masks and loops, where specialising buys
nothing.

The JIT path is used instead when the kernel does not run on a GPU (CPU tensors under the
interpreter) and when Triton's launch hooks are set (profilers).
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton

_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg")
_INT32 = (-(2**31), 2**31)


def _spec(value):
    """What Triton specialises a runtime argument on."""
    kind = type(value)
    if kind is int:
        return value == 1, value % 16 == 0, _INT32[0] <= value < _INT32[1]
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return value.dtype, value.device, value.data_ptr() % 16 == 0
    if kind is bool:
        return "bool", value
    if kind is float:
        return "float"
    return value  # None, or a constexpr passed by position


def _raw_stream(index: int) -> int:
    """The current CUDA stream's handle, as Triton reads it (`torch.cuda.current_stream` costs
    4 us on the H200's host)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(index) if get is not None else torch.cuda.current_stream(index).cuda_stream


def _hooks_set() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return True  # an older Triton: keep to the JIT path
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class FastKernel:
    """A @triton.jit kernel launched through its compiled form (module docstring)."""

    def __init__(self, kernel):
        self.kernel = kernel
        # the Python function's parameters (the interpreter's kernels have no `params`)
        params = inspect.signature(kernel.fn).parameters.values()
        self._names = [p.name for p in params]
        self._constexpr = {p.name for p in params if "constexpr" in str(p.annotation)}
        self._defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _key(self, args, kwargs):
        kw = tuple(
            (name, value if name in self._constexpr or name in _OPTIONS else _spec(value))
            for name, value in kwargs.items()
        )
        return tuple(map(_spec, args)), kw

    def _launch(self, grid, *args, **kwargs):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None or device.type != "cuda" or callable(grid) or _hooks_set():
            return self.kernel[grid](*args, **kwargs)
        key = self._key(args, kwargs)
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if compiled is not None and self._all_constexprs_named(len(args), kwargs):
                self._compiled[key] = compiled
            return compiled
        rest = self._names[len(args) :]
        values = [*args, *(kwargs[n] if n in kwargs else self._defaults[n] for n in rest)]
        g = tuple(grid) + (1, 1)
        stream = _raw_stream(device.index)
        entry.run(
            g[0],
            g[1],
            g[2],
            stream,
            entry.function,
            entry.packed_metadata,
            None,
            None,
            None,
            *values,
        )
        return entry

    def _all_constexprs_named(self, num_args: int, kwargs: dict) -> bool:
        """Constexprs passed by position would enter the key through `_spec` (an integer
        BLOCK as its divisibility), so such calls are never cached."""
        positional = set(self._names[:num_args])
        return not (positional & self._constexpr) and all(
            n in kwargs or n in self._defaults or n in positional for n in self._names
        )


@functools.cache
def fast(kernel) -> FastKernel:
    """The FastKernel of a @triton.jit kernel (one per kernel, so its cache is shared)."""
    return FastKernel(kernel)
