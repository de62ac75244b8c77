"""Activations shared by the Triton kernels."""

import triton
import triton.language as tl


@triton.jit
def silu(x):
    """x * sigmoid(x), as x / (1 + e^-x): one division."""
    return x / (1.0 + tl.exp(-x))
