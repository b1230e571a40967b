"""Custom ops in the `tqcompile` namespace. Each has a fake kernel, so fullgraph compile traces
them without running them, and a reference kernel (`tqcompile.kernels.reference`) that defines
the numerics."""

from tqcompile.ops.codec import amax, dequantize, quantize, quantize_columnwise
from tqcompile.ops.errors import raise_error, shape_str, static_shape
from tqcompile.ops.gemm import amax_history_update, gemm_tn, int8_weight_only_mm
from tqcompile.ops.grouped_gemm import (
    grouped_amax,
    grouped_dequantize,
    grouped_gemm_tn,
    grouped_mm,
    grouped_mm_wgrad,
    grouped_quantize,
)

__all__ = [
    "amax",
    "quantize",
    "dequantize",
    "gemm_tn",
]
