"""The group-affine dequantisation the kernel must match: `sparrow.quant.affine.dequantize`
(w = scale * q + bias per group of the input dim, computed in fp32, cast to the output dtype).
"""

from sparrow.quant.affine import dequantize

__all__ = ["dequantize"]
