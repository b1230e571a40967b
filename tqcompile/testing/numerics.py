"""Numerics assertions for quantized tensors: SQNR, bit-exact payload comparison, and the
per-element round-trip error bound each format guarantees.

The bound (`error_bound`) is derived from the format and the scale rule, not measured. For an
element ``x`` of a scaling unit with multiplier ``s`` (``v = x * s`` is what gets rounded into the
element format):

- the element format rounds ``v`` to nearest (ties to even), so ``|q - v|`` is at most half the
  gap between the two grid points around ``v``: for FP8 with ``m`` mantissa bits that is
  ``2**(max(floor(log2|v|), emin) - m - 1)`` (the ``emin`` clamp is the subnormal floor), for E2M1
  0.25 / 0.5 / 1 below 2 / 4 / 6, for INT 0.5. Stochastic rounding picks one of the two
  neighbours, so its bound is the whole gap;
- a ``|v|`` above the format max saturates: its error is exactly ``|v| - max`` (this is how ±Inf
  and values beyond an amax-derived range behave; an amax-derived scale keeps finite values in
  range except where the scale itself is rounded: MX FLOOR, power-of-two and NVFP4 block scales);
- dividing by ``s`` gives the bound in units of ``x``. The fp32 arithmetic of the scale and of
  dequantization adds ``k`` roundings of relative size ``u = 2**-24`` each (``k`` = 3 for FP8 and
  INT: ``x * s``, ``1 / s``, ``q * scale_inv``; 3 for NVFP4: ``x * s_enc``, ``/ s_blk``,
  ``/ s_enc``; 0 for MX, whose scales are powers of two), bounded together with their second-order
  terms by ``(k + 1) * u * (|x| + H)``, plus ``2**-149`` for a result that lands among fp32's
  subnormals, where rounding is absolute rather than relative.

NVFP4's Hadamard transform mixes the 16 elements of a block, so its bound is the transformed-domain
bound carried back through the (orthogonal, entries ±1/4) inverse plus the fp32 error of the two
16-term matrix products.

Example:
    >>> x = torch.randn(64, 128)
    >>> q = tq.Float8Quantizer()
    >>> assert_error_within(q, x, tq.quantize(x, q).dequantize(torch.float32))
    >>> assert_sqnr(x, tq.quantize(x, q).dequantize(), min_db=25.0)
"""

from __future__ import annotations

import functools
import math

import torch

from tqcompile.formats import Format
from tqcompile.kernels.reference import hadamard_matrix
from tqcompile.quantizers import (
    Float8Quantizer,
    Granularity,
    IntGrid,
    IntQuantizer,
    MXQuantizer,
    NVFP4Quantizer,
    Quantizer,
    ScaleRounding,
)
from tqcompile.tensor import QuantizedTensor

__all__ = [
    "sqnr",
    "assert_sqnr",
    "assert_payload_equal",
    "bits_of",
    "element_error_bound",
    "expected_scale_inv",
    "scaled_values",
    "payload_values",
    "expected_payload_values",
    "saturation_values",
    "error_bound",
    "assert_error_within",
]

_U = 2.0**-24  # fp32 unit roundoff
_FP32_SUBNORMAL = 2.0**-149  # smallest fp32 subnormal; absolute rounding error there is at most half of it
_NVFP4_ENC = Format.E4M3.max_value * Format.E2M1.max_value  # 448 * 6
_E4M3_HALF_SUBNORMAL = 2.0**-10  # e4m3 rounds to 0 at or below this (half its smallest subnormal)
_INNER = ("_data", "_scale_inv", "_amax", "_data_t", "_scale_inv_t", "_amax_t")


# ---------------------------------------------------------------------------------------------
# SQNR
# ---------------------------------------------------------------------------------------------
def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum(ref²) / sum((ref - actual)²))``,
    computed in float64. ``inf`` when the two are equal; ``-inf`` for a zero `ref` with a nonzero
    difference."""
    if ref.shape != actual.shape:
        raise ValueError(f"sqnr: shapes differ, ref {tuple(ref.shape)} vs actual {tuple(actual.shape)}")
    r = ref.detach().double()
    noise = (r - actual.detach().double()).square().sum().item()
    signal = r.square().sum().item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def assert_sqnr(ref: torch.Tensor, actual: torch.Tensor, min_db: float, msg: str = "") -> None:
    """Assert ``sqnr(ref, actual) >= min_db``."""
    got = sqnr(ref, actual)
    if not got >= min_db:  # `not >=` so a NaN SQNR fails too
        raise AssertionError(f"SQNR {got:.2f} dB is below the required {min_db:.2f} dB{': ' + msg if msg else ''}")


# ---------------------------------------------------------------------------------------------
# Bit-exact comparison
# ---------------------------------------------------------------------------------------------
def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` as a flat uint8 tensor (NaNs compare equal bit for bit)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_bits_equal(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{name}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
    ba, bb = bits_of(a), bits_of(b)
    diff = (ba != bb).nonzero()
    if diff.numel():
        i = diff[0, 0].item() // a.element_size()
        fa, fb = a.detach().contiguous().reshape(-1)[i], b.detach().contiguous().reshape(-1)[i]
        raise AssertionError(
            f"{name}: {diff.numel()} of {ba.numel()} bytes differ; first at element {i} "
            f"({fa.float().item()!r} vs {fb.float().item()!r}, bytes {bits_of(fa).tolist()} vs {bits_of(fb).tolist()})"
        )


def assert_payload_equal(a: QuantizedTensor, b: QuantizedTensor, *, check_dtype: bool = True) -> None:
    """Assert two QuantizedTensors are the same bit for bit: same shape, quantizer, usages, and
    identical bytes of every present payload, scale and amax (compared as uint8, so NaN payloads
    compare equal and -0 differs from +0). `check_dtype=False` skips the nominal dtype."""
    for t, side in ((a, "first"), (b, "second")):
        if not isinstance(t, QuantizedTensor):
            raise AssertionError(f"assert_payload_equal: the {side} argument is a {type(t).__name__}, not a QuantizedTensor")
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.quantizer != b.quantizer:
        raise AssertionError(f"quantizers differ: {a.quantizer!r} vs {b.quantizer!r}")
    if check_dtype and a.orig_dtype != b.orig_dtype:
        raise AssertionError(f"nominal dtypes differ: {a.orig_dtype} vs {b.orig_dtype}")
    for name in _INNER:
        ta, tb = getattr(a, name), getattr(b, name)
        if (ta is None) != (tb is None):
            raise AssertionError(f"{name} is present in only one of them ({'first' if tb is None else 'second'})")
        if ta is not None:
            _assert_bits_equal(name, ta, tb)


def _codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """The `bits`-wide codes of a packed payload, read as the spec lays them out: the last dim's
    bytes as one little-endian bit stream, element i at bits [bits*i, bits*(i+1))."""
    shifts = torch.arange(8, device=data.device)
    stream = ((data.long().unsqueeze(-1) >> shifts) & 1).flatten(-2)  # (..., 8 * nbytes) bits
    fields = stream.unflatten(-1, (-1, bits))
    return (fields << shifts[:bits]).sum(-1)


def _float_facts(fmt: Format) -> tuple[int, int, int]:
    """(mantissa bits, exponent bias, exponent of the smallest normal) of a float element format."""
    codec = fmt.codec
    return codec.mbits, codec.bias, 1 - codec.bias


def _small_float_grid(fmt: Format) -> torch.Tensor:
    """The non-negative values of a float format narrower than a byte (no inf / NaN), float64,
    indexed by the magnitude bits: ``m * 2**(emin - mbits)`` for exponent field 0 (subnormals),
    ``(1 + m / 2**mbits) * 2**(e - bias)`` otherwise."""
    mbits, bias, emin = _float_facts(fmt)
    codes = torch.arange(2 ** (fmt.bits - 1), dtype=torch.float64)
    e, m = torch.div(codes, 2**mbits, rounding_mode="floor"), torch.remainder(codes, 2**mbits)
    return torch.where(e == 0, m * 2.0 ** (emin - mbits), (1 + m / 2**mbits) * torch.pow(2.0, e - bias))


def payload_values(data: torch.Tensor, quantizer: Quantizer) -> torch.Tensor:
    """The element values a payload holds, before scaling: float32 in the logical shape (packed
    payloads unpacked: 4-bit ones low nibble first), keeping signed zeros and FP8 NaNs."""
    fmt = quantizer.element_format()
    if fmt.torch_dtype is not None:
        return data.float()
    codes = _codes(data, fmt.bits)
    negative = codes >= 2 ** (fmt.bits - 1)
    if fmt.is_int:
        return torch.where(negative, codes - 2**fmt.bits, codes).float()
    mags = _small_float_grid(fmt).float()[codes % 2 ** (fmt.bits - 1)]
    return torch.where(negative, -mags, mags)


# ---------------------------------------------------------------------------------------------
# The scale rules, written from the spec (docs/numerics/), independently of the kernels
# ---------------------------------------------------------------------------------------------
def _unit_amax(a: torch.Tensor, layout: tuple[Granularity, int, int], scale_shape: tuple[int, ...]) -> torch.Tensor:
    """Max of the non-negative `a` over each scaling unit, in the scale's shape."""
    gran, axis, block = layout
    if a.numel() == 0:
        return a.new_zeros(scale_shape)
    if gran is Granularity.TENSORWISE:
        return a.amax()
    if gran is Granularity.ROWWISE:
        return a.amax(dim=axis, keepdim=True)
    blocks = a.unflatten(-1, (a.shape[-1] // block, block))
    if gran is Granularity.BLOCKWISE_1D:
        return blocks.amax(-1)
    return blocks.unflatten(-3, (a.shape[-2] // block, block)).amax((-3, -1))


def _per_element(scale: torch.Tensor, layout: tuple[Granularity, int, int]) -> torch.Tensor:
    """Broadcastable per-element view of a per-unit tensor."""
    gran, _, block = layout
    if gran is Granularity.BLOCKWISE_1D:
        return scale.repeat_interleave(block, dim=-1)
    if gran is Granularity.BLOCKWISE_2D:
        return scale.repeat_interleave(block, dim=-1).repeat_interleave(block, dim=-2)
    return scale


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def _transformed(q: Quantizer, x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` after the quantizer's transform (NVFP4 Hadamard), computed as the kernels do."""
    xf = x.float().contiguous()
    if q.hadamard_transformed():
        xf = (xf.unflatten(-1, (xf.shape[-1] // 16, 16)) @ hadamard_matrix(q.hadamard_seed, xf.device)).flatten(-2)
    return xf


def _mx_exponent(amax: torch.Tensor, q: MXQuantizer) -> torch.Tensor:
    """The block exponent from its exact definition (float64 comparisons, no log rounding)."""
    a = amax.double()
    fmax = q.format.max_value
    _, exp = torch.frexp(a)  # a = m * 2**exp with m in [0.5, 1): floor(log2 a) = exp - 1
    if q.scale_rounding is ScaleRounding.FLOOR:
        e = (exp - 1) - q.format.emax
    else:
        # The smallest e with a <= fmax * 2**e; the frexp estimate is off by at most one.
        _, e = torch.frexp(a / fmax)
        e = torch.where(torch.ldexp(torch.full_like(a, fmax), e - 1) >= a, e - 1, e)
        e = torch.where(torch.ldexp(torch.full_like(a, fmax), e) < a, e + 1, e)
    e = torch.where(a > 0, e, torch.full_like(e, -127))
    return e.clamp(-127, 127)


def _fp32_scale(fmt_max: float, amax: torch.Tensor, eps: float, power_of_two: bool) -> torch.Tensor:
    scale = torch.tensor(fmt_max, dtype=torch.float32) / amax.float().clamp(min=eps)
    scale = torch.where(scale > 0, scale.clamp(min=torch.finfo(torch.float32).tiny), scale)  # never subnormal (docs/numerics/int.md)
    if power_of_two:
        _, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exp - 1)
    return scale


def _nvfp4_scales(q: NVFP4Quantizer, xf: torch.Tensor, amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_enc, s_blk) with s_blk in the scale shape, as float8_e4m3fn."""
    a = _finite_abs(xf)
    if amax is None:
        amax = a.amax() if a.numel() else a.new_zeros(())
    s_enc = torch.tensor(_NVFP4_ENC, dtype=torch.float32) / amax.float().clamp(min=q.amax_epsilon)
    blk = _unit_amax(a, q.layout(), q.scale_shape(xf.shape))
    # Every operation a correctly rounded fp32 one (a true division, not a multiply by 1/6).
    s_blk = (torch.div(blk, torch.tensor(Format.E2M1.max_value)) * s_enc).clamp(max=Format.E4M3.max_value).to(torch.float8_e4m3fn)
    return s_enc, s_blk


def _check_amax(q: Quantizer, amax: torch.Tensor | None) -> None:
    if amax is not None and not q.uses_tensor_amax():
        raise ValueError(f"{q!r} computes its scales from local amaxes only; it takes no tensor-level amax (got one)")


def expected_scale_inv(quantizer: Quantizer, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The scale tensor the spec prescribes for quantizing `x` (shape ``quantizer.scale_shape``,
    dtype ``quantizer.scale_dtype()``), computed from the formulas of docs/numerics/ independently of
    the kernels: FP8/INT ``1 / (fmt_max / max(amax, eps))`` in fp32 (optionally a power of two),
    MX the E8M0 exponent from its exact floor/RCEIL definition, NVFP4 the E4M3 block scale.
    `amax` overrides the tensor-level amax of quantizers that use one."""
    _check_amax(quantizer, amax)
    return _spec_scale_inv(quantizer, _transformed(quantizer, x), amax)


# The scale rule of each family, from its docs/numerics page: registered per family.
@functools.singledispatch
def _spec_scale_inv(q: Quantizer, xf: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    raise TypeError(f"expected_scale_inv: unknown quantizer type {type(q).__name__}")


@_spec_scale_inv.register(NVFP4Quantizer)
def _(q: NVFP4Quantizer, xf, amax) -> torch.Tensor:
    return _nvfp4_scales(q, xf, amax)[1]


@_spec_scale_inv.register(MXQuantizer)
def _(q: MXQuantizer, xf, amax) -> torch.Tensor:
    e = _mx_exponent(_unit_amax(_finite_abs(xf), q.layout(), q.scale_shape(xf.shape)), q)
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


@_spec_scale_inv.register(Float8Quantizer)
@_spec_scale_inv.register(IntQuantizer)
def _(q: Float8Quantizer | IntQuantizer, xf, amax) -> torch.Tensor:
    return 1.0 / _amax_scale(q, xf, amax)


def _amax_scale(q: Float8Quantizer | IntQuantizer, xf: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """FP8 / INT: ``fmt_max / max(amax, eps)`` per unit (a power of two where asked)."""
    unit = amax if amax is not None else _unit_amax(_finite_abs(xf), q.layout(), q.scale_shape(xf.shape))
    # INT on the FULL grid: the amax maps half a step above the largest code (docs/numerics/int.md).
    top = q.element_format().max_value + (0.5 if getattr(q, "grid", None) is IntGrid.FULL else 0.0)
    return _fp32_scale(top, unit, q.amax_epsilon, getattr(q, "power_of_two_scale", False))


# ---------------------------------------------------------------------------------------------
# Error bounds
# ---------------------------------------------------------------------------------------------
def element_error_bound(fmt: Format, v: torch.Tensor, *, stochastic: bool = False) -> torch.Tensor:
    """Largest ``|q - v|`` when `v` (already scaled into the format) is cast to `fmt`: half the
    grid gap around ``|v|`` (the whole gap with stochastic rounding), or ``|v| - max`` where
    ``|v|`` exceeds the format max and saturates. float64, `v`'s shape; non-finite `v` gives inf."""
    t = v.double().abs()
    if fmt.is_float:
        # Neighbours are 2**(e - mbits) apart in the binade [2**e, 2**(e+1)), and 2**(emin - mbits)
        # apart among the subnormals (below 2**emin): for E2M1 0.5 below 2, 1 below 4, 2 below 6.
        mbits, _, emin = _float_facts(fmt)
        _, exp = torch.frexp(t)
        e = torch.where(t >= 2.0**emin, exp - 1, torch.full_like(exp, emin))
        half_gap = torch.ldexp(torch.ones_like(t), e - mbits - 1)
    elif fmt.is_int:
        half_gap = torch.full_like(t, 0.5)
    else:
        raise ValueError(f"element_error_bound: {fmt} is not an element format")
    bound = 2 * half_gap if stochastic else half_gap
    bound = torch.where(t > fmt.max_value, t - fmt.max_value, bound)
    return torch.where(torch.isfinite(t), bound, torch.full_like(t, math.inf))


def _slack(bound: torch.Tensor, x: torch.Tensor, fp32_roundings: int) -> torch.Tensor:
    return bound + (fp32_roundings + 1) * _U * (x.abs() + bound) + _FP32_SUBNORMAL


@functools.singledispatch
def _scaling(q: Quantizer, xf: torch.Tensor, amax: torch.Tensor | None):
    """(v, v_to_x, fp32_roundings, zero_units): the values the element format sees (float64),
    the per-element factor back to units of x, how many fp32 roundings a round trip adds, and the
    elements whose scale is zero (NVFP4 blocks whose E4M3 scale underflows), or None. Registered per family."""
    raise TypeError(f"unknown quantizer type {type(q).__name__}")


@_scaling.register(NVFP4Quantizer)
def _(q: NVFP4Quantizer, xf, amax):
    s_enc, s_blk = _nvfp4_scales(q, xf, amax)
    s_blk_e = _per_element(s_blk.float(), q.layout())
    zero = s_blk_e == 0
    # The kernels' fp32 order, so saturation is classified as they see it.
    v = torch.where(zero, torch.zeros_like(xf), xf * s_enc / s_blk_e)
    return v.double(), s_blk_e.double() / s_enc.double(), 3, zero


@_scaling.register(MXQuantizer)
def _(q: MXQuantizer, xf, amax):
    e = _mx_exponent(_unit_amax(_finite_abs(xf), q.layout(), q.scale_shape(xf.shape)), q)
    to_x = torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e)
    to_x = _per_element(to_x, q.layout())
    # The kernels divide in fp32: the exact quotient rounded once, which differs from it only
    # below fp32's normal range, where the element rounds to a (signed) zero either way.
    return (xf.double() / to_x).float().double(), to_x, 0, None


@_scaling.register(Float8Quantizer)
@_scaling.register(IntQuantizer)
def _(q: Float8Quantizer | IntQuantizer, xf, amax):
    s = _per_element(_amax_scale(q, xf, amax), q.layout())
    return (xf * s).double(), 1.0 / s.double(), 3, None


def scaled_values(quantizer: Quantizer, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The values the element format is asked to hold, ``x * scale`` (after the quantizer's
    transform), with the scales the spec prescribes; float64, `x`'s shape. Where ``|v|`` exceeds
    the format max the payload must saturate to ±max. `amax` as in `error_bound`."""
    _check_amax(quantizer, amax)
    return _scaling(quantizer, _transformed(quantizer, x), amax)[0]


def _round_small_float(v: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Nearest value of a small float format (E2M1, ...) by exhaustive search of its grid, ties to
    the even code, saturating."""
    grid = _small_float_grid(fmt)
    mag = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=fmt.max_value)
    dist = (mag.unsqueeze(-1) - grid).abs()
    best = dist == dist.amin(-1, keepdim=True)
    codes = torch.arange(grid.numel())
    # A tie has one even and one odd candidate; prefer the even one.
    key = torch.where(best, codes % 2 * grid.numel() + codes, torch.full_like(codes, 2 * grid.numel()))
    out = grid[key.argmin(-1)]
    # The IEEE sign carries over (-0.01 and -0.0 give -0); NaN gives +0.
    return torch.where(torch.signbit(v) & ~torch.isnan(v), -out, out).float()


def expected_payload_values(quantizer: Quantizer, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The element values (as `payload_values` decodes them) the spec prescribes: `scaled_values`
    rounded to nearest, ties to even (FP8 by torch's cast, E2M1 by searching its grid, INT by
    `torch.round`), saturated to ±max; NaN stays NaN in FP8 and is 0 in E2M1/INT. Not defined for
    stochastic rounding."""
    if quantizer.needs_seed():
        raise ValueError("expected_payload_values: stochastic rounding has no single expected payload")
    v = scaled_values(quantizer, x, amax)
    fmt = quantizer.element_format()
    if fmt.is_float and fmt.torch_dtype is not None:
        return v.float().clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype).float()
    if fmt.is_float:
        return _round_small_float(v, fmt)
    lo, hi = _int_codes(quantizer)
    return torch.nan_to_num(v, nan=0.0).clamp(lo, hi).round().float() + 0.0  # + 0.0: no -0 in INT


def _int_codes(q: Quantizer) -> tuple[float, float]:
    """The lowest and highest code of an integer quantizer, from the spec: ``-qmax..qmax``, or
    ``-qmax - 1..qmax`` on the FULL grid (docs/numerics/int.md)."""
    qmax = q.element_format().max_value
    return (-qmax - 1 if getattr(q, "grid", None) is IntGrid.FULL else -qmax), qmax


def saturation_values(quantizer: Quantizer, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, values) of the scaled values `v` (`scaled_values`) the format cannot hold, and the
    element value each saturates to: beyond ±max, or, on an integer FULL grid, below its lowest
    code (which is -max - 1)."""
    fmt = quantizer.element_format()
    lo, hi = _int_codes(quantizer) if fmt.is_int else (-fmt.max_value, fmt.max_value)
    over = torch.isfinite(v) & ((v > hi) | (v < lo))
    return over, torch.where(v > 0, hi, lo).float()


def _untransformed_bound(q: Quantizer, xf: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    v, to_x, roundings, zero = _scaling(q, xf, amax)
    stochastic = q.needs_seed()
    bound = _slack(element_error_bound(q.element_format(), v, stochastic=stochastic) * to_x, xf.double(), roundings)
    if zero is not None:
        # An E4M3 block scale is zero only when amax_blk / 6 * s_enc <= 2**-10 (its midpoint
        # between 0 and the smallest subnormal), and the block then dequantizes to 0; two fp32
        # roundings in that product add (1 + 3u) and the fp32 division by s_enc one more u.
        s_enc = _nvfp4_scales(q, xf, amax)[0].double()
        bound = torch.where(zero, _E4M3_HALF_SUBNORMAL * Format.E2M1.max_value / s_enc * (1 + 4 * _U), bound)
    return torch.where(torch.isfinite(xf), bound, torch.full_like(bound, math.inf))


def error_bound(quantizer: Quantizer, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` (dequantized to float32), derived in
    this module's docstring: the element format's rounding (or saturation) error at the scale the
    spec prescribes, plus the fp32 arithmetic of scaling and dequantizing.

    Returns a float64 tensor of `x`'s shape; it is ``inf`` where `x` is not finite (and, with the
    Hadamard transform, on every element of a 16-block holding a non-finite value or whose fp32
    transform overflows, which inputs above a quarter of fp32's max can make it do). `amax`
    overrides the tensor-level amax of quantizers that use one (e.g. a group-reduced amax).
    """
    _check_amax(quantizer, amax)
    xf = _transformed(quantizer, x)
    bound = _untransformed_bound(quantizer, xf, amax)
    if not quantizer.hadamard_transformed():
        return bound
    # y = y' @ Mᵀ with |M_ij| = 1/4: the transformed-domain errors add up with weight 1/4; the
    # forward and inverse 16-term fp32 products add at most gamma16 = 16u/(1-16u) of the
    # absolute sums they involve.
    gamma16 = 16 * _U / (1 - 16 * _U)
    blocks = lambda t: t.unflatten(-1, (t.shape[-1] // 16, 16))  # noqa: E731
    b = blocks(bound)
    x_abs, xt_abs = blocks(x.double().abs()), blocks(xf.double().abs())
    per_block = b.sum(-1) / 4 + gamma16 * x_abs.sum(-1) + gamma16 / 4 * (xt_abs + b).sum(-1)
    per_block = torch.where(torch.isfinite(blocks(xf)).all(-1), per_block, torch.full_like(per_block, math.inf))
    return per_block.unsqueeze(-1).expand(b.shape).flatten(-2)


def assert_error_within(quantizer: Quantizer, x: torch.Tensor, dequantized: torch.Tensor, amax: torch.Tensor | None = None) -> None:
    """Assert ``|dequantized - x| <= error_bound(quantizer, x, amax)`` at every finite element of
    `x` (elements where the bound is inf are skipped), naming the worst element on failure."""
    bound = error_bound(quantizer, x, amax)
    err = (dequantized.double() - x.double()).abs()
    checked = torch.isfinite(bound)
    bad = checked & ~(err <= bound)  # `~(<=)` so a NaN result counts as a failure
    if bad.any():
        excess = torch.where(bad, torch.nan_to_num(err / bound, nan=math.inf, posinf=math.inf), torch.zeros_like(err))
        i = int(excess.reshape(-1).argmax())
        idx = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), x.shape))
        raise AssertionError(
            f"{int(bad.sum())} of {int(checked.sum())} elements exceed the {quantizer!r} round-trip bound; worst at {idx}: "
            f"x={x[idx].item()!r}, dequantized={dequantized[idx].item()!r}, |error|={err[idx].item()!r}, bound={bound[idx].item()!r}"
        )
