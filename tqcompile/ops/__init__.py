"""Custom ops in the `tqcompile` namespace. Each has a fake kernel, so fullgraph compile traces
them without running them, and a reference kernel (`tqcompile.kernels.reference`) that defines
the numerics."""

from tqcompile.ops.quantize import amax, dequantize, quantize

__all__ = ["amax", "quantize", "dequantize"]
