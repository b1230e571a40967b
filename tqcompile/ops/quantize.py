"""quantize / dequantize / amax as custom ops with fake kernels.

The quantizer travels as a value opaque object (`Quantizer`), so one op serves every family and
Dynamo guards on the quantizer's `__eq__`. None of these ops is differentiable: autograd lives in
the GEMM ops that call them.
"""

from __future__ import annotations

import torch

from tqcompile.kernels import reference
from tqcompile.ops.inductor import register_inductor_decompositions
from tqcompile.quantizers import Quantizer


@torch.library.custom_op("tqcompile::amax", mutates_args=())
def amax(x: torch.Tensor, quantizer: Quantizer) -> torch.Tensor:
    """Tensor-level amax (fp32, 0-dim) over finite values, after the quantizer's transform."""
    return reference.tensor_amax(x, quantizer)


@amax.register_fake
def _amax_fake(x: torch.Tensor, quantizer: Quantizer) -> torch.Tensor:
    register_inductor_decompositions()
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("tqcompile::quantize", mutates_args=())
def quantize(
    x: torch.Tensor, quantizer: Quantizer, amax: torch.Tensor | None, seed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scale_inv) of `x`; `amax` is the (group-reduced) tensor amax where the quantizer uses one.

    For a ROWWISE Float8/Int quantizer, `amax` may instead hold the per-row amaxes (in the scale's
    shape): tensor parallelism passes the amaxes of rows split over ranks, reduced over the group."""
    return reference.quantize(x, quantizer, amax, seed)


@quantize.register_fake
def _quantize_fake(x, quantizer, amax, seed):
    register_inductor_decompositions()
    payload = x.new_empty(quantizer.payload_shape(x.shape), dtype=quantizer.element_format().storage_dtype)
    scale_inv = x.new_empty(quantizer.scale_shape(x.shape), dtype=quantizer.scale_dtype())
    return payload, scale_inv


@torch.library.custom_op("tqcompile::dequantize", mutates_args=())
def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor | None, quantizer: Quantizer, dtype: torch.dtype
) -> torch.Tensor:
    """Payload and scales back to `dtype`."""
    return reference.dequantize(data, scale_inv, amax, quantizer, dtype)


@dequantize.register_fake
def _dequantize_fake(data, scale_inv, amax, quantizer, dtype):
    register_inductor_decompositions()
    return data.new_empty(quantizer.logical_shape(data.shape), dtype=dtype)


# --- CUDA kernels: Triton (tqcompile.kernels.triton), bit-exact with the reference -------------
@quantize.register_kernel("cuda")
def _quantize_cuda(x, quantizer, amax, seed):
    try:
        # Imported on the first CUDA call only: CPU-only use never imports Triton.
        from tqcompile.kernels.triton import quantize as triton_quantize
    except ImportError:  # no Triton on this platform
        return reference.quantize(x, quantizer, amax, seed)
    if triton_quantize.supports(x, quantizer, amax, seed):
        return triton_quantize.quantize(x, quantizer, amax, seed)
    return reference.quantize(x, quantizer, amax, seed)


# --- end of the CUDA kernels -------------------------------------------------------------------
