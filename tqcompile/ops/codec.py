"""quantize / dequantize / amax as custom ops with fake kernels.

The quantizer travels as a value opaque object (`Quantizer`), so one op serves every family and
Dynamo guards on the quantizer's `__eq__`. None of these ops is differentiable: autograd lives in
the GEMM ops that call them.
"""

from __future__ import annotations

import math
import warnings

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
    x: torch.Tensor, quantizer: Quantizer, amax: torch.Tensor | None, seed: torch.Tensor | None, flat_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scale_inv) of `x`; `amax` is the (group-reduced) tensor amax where the quantizer uses one.

    For a ROWWISE Float8/Int quantizer, `amax` may instead hold the per-row amaxes (in the scale's
    shape): tensor parallelism passes the amaxes of rows split over ranks, reduced over the group.
    `flat_scale` returns the scales flattened (row-major): a columnwise usage's layout where
    `quantizer.flat_columnwise_scale()`. The op itself must return it flat: a (K, T // block) tensor
    anywhere in the graph would guard on T // block == 1 (see `Quantizer.flat_columnwise_scale`)."""
    return _flat(reference.quantize(x, quantizer, amax, seed), flat_scale)


def _flat(out: tuple[torch.Tensor, torch.Tensor], flat_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (out[0], out[1].reshape(-1)) if flat_scale else out


def quantize_columnwise(
    x_t: torch.Tensor, quantizer: Quantizer, amax: torch.Tensor | None, seed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` of `x_t`, the 2-D transpose a columnwise usage quantizes, with its scales in that
    usage's layout (`Quantizer.columnwise_scale_shape`)."""
    if quantizer.flat_columnwise_scale():
        return quantize(x_t, quantizer, amax, seed, True)
    return quantize(x_t, quantizer, amax, seed)  # the graphs of other quantizers keep their call


@quantize.register_fake
def _quantize_fake(x, quantizer, amax, seed, flat_scale=False):
    register_inductor_decompositions()
    payload = x.new_empty(quantizer.payload_shape(x.shape), dtype=quantizer.element_format().storage_dtype)
    shape = quantizer.scale_shape(x.shape)
    scale_inv = x.new_empty((math.prod(shape),) if flat_scale else shape, dtype=quantizer.scale_dtype())
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
# Triton is the `cuda` extra, not a dependency (CPU-only installs skip its ~1 GB): without it a
# CUDA quantize falls back to the reference kernel, whose numerics are the same, and says so.
_TRITON_MISSING = (
    "tqcompile: Triton cannot be imported ({error}), so quantize on CUDA runs the plain-torch reference "
    'kernels (same numerics, slower). Install the CUDA extra for the Triton kernels: pip install "tqcompile[cuda]"'
)


@quantize.register_kernel("cuda")
def _quantize_cuda(x, quantizer, amax, seed, flat_scale=False):
    try:
        # Imported on the first CUDA call only: CPU-only use never imports Triton.
        from tqcompile.kernels.triton import quantize as triton_quantize
    except ImportError as e:
        # stacklevel=1: the warning's location is this line, so Python's default filter shows it once
        # per process, not once per call.
        warnings.warn(_TRITON_MISSING.format(error=f"{type(e).__name__}: {e}"), UserWarning, stacklevel=1)
        return _flat(reference.quantize(x, quantizer, amax, seed), flat_scale)
    if triton_quantize.supports(x, quantizer, amax, seed):
        return _flat(triton_quantize.quantize(x, quantizer, amax, seed), flat_scale)
    return _flat(reference.quantize(x, quantizer, amax, seed), flat_scale)


# --- end of the CUDA kernels -------------------------------------------------------------------
