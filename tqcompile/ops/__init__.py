"""Custom ops in the `tqcompile` namespace. Each has a fake kernel, so fullgraph compile traces
them without running them, and a reference kernel (`tqcompile.kernels.reference`) that defines
the numerics."""

from tqcompile.ops.errors import raise_error, static_shape
from tqcompile.ops.gemm import amax_history_update, gemm_tn
from tqcompile.ops.quantize import amax, dequantize, quantize

__all__ = ["amax", "quantize", "dequantize", "gemm_tn", "amax_history_update", "raise_error", "static_shape"]
