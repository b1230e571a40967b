"""The arithmetic the families' scale rules share, in fp32 and plain torch (see
`tqcompile.kernels.reference` for the conventions every kernel follows)."""

from __future__ import annotations

import torch

from tqcompile.quantizers import geometry

__all__ = ["FP32_MAX", "finite_abs", "pow2_floor", "div_scalar", "scale_from_amax", "amax_scaled", "saturate"]

# Largest fp32 value; `max_value / amax_epsilon` must stay below it so scales are finite.
FP32_MAX = torch.finfo(torch.float32).max
FP32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with ±Inf and NaN as 0: amaxes ignore non-finite values, so scales stay finite."""
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))


def pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """Round positive normal fp32 values down to a power of two by clearing the mantissa bits."""
    return (x.view(torch.int32) & 0x7F800000).view(torch.float32)


def div_scalar(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` rounded once on every device. (CUDA torch divides by a Python scalar as a
    multiply by its rounded reciprocal, which can be an ulp off; a same-device tensor divisor is a
    true division there and on the CPU.)"""
    return torch.div(t, t.new_full((), divisor))


def scale_from_amax(amax: torch.Tensor, fmt_max: float, eps: float, power_of_two: bool) -> torch.Tensor:
    """``fmt_max / max(amax, eps)`` in fp32, rounded down to a power of two where asked."""
    # torch.div, not `fmt_max / tensor`: Python's reflected division runs as reciprocal-then-multiply,
    # which rounds twice and is one ulp off the fp32 quotient (TE's __fdiv_rn) for about 1 amax in 4.
    scale = torch.div(fmt_max, amax.clamp(min=eps))
    # A subnormal scale is raised to the smallest normal fp32: INT2/INT3's top (1 to 3.5) over a
    # finite amax near fp32's max is subnormal, and 1 / a subnormal scale overflows to Inf. FP8,
    # INT4 and INT8 never get there from a finite amax (448 / FP32_MAX, 7 / FP32_MAX are normal);
    # an infinite amax keeps its zero scale (what the Triton kernels give too).
    scale = torch.where(scale > 0, scale.clamp(min=FP32_TINY), scale)
    return pow2_floor(scale) if power_of_two else scale


def amax_scaled(
    xf: torch.Tensor, layout: geometry.Layout, amax: torch.Tensor | None, fmt_max: float, eps: float, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The amax scale rule of FP8 and INT: ``(xf * scale, 1 / scale)`` per scaling unit, the scale
    ``fmt_max / max(amax, eps)`` from the given amax (tensor-level or per unit) or, if None, from
    each unit's amax of `xf`."""
    if amax is None:
        amax = geometry.unit_amax(finite_abs(xf), layout)
    scale = scale_from_amax(amax, fmt_max, eps, power_of_two)
    return xf * geometry.expand(scale, xf.shape, layout), 1.0 / scale


def saturate(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `out` cast to `dtype`, values beyond its finite range clamped to ±its max (NaN kept).

    Clamping before the cast, not after: fp32 -> bf16/fp16 rounds a value just above the target's
    max up to Inf. Values within range are untouched, so this changes only results that were ±Inf.
    """
    # The product is computed in fp32, so a wider dtype (float64) saturates at fp32's max too.
    big = min(torch.finfo(dtype).max, FP32_MAX)
    return out.clamp(-big, big).to(dtype)
