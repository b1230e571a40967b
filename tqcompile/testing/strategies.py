"""Hypothesis strategies for quantizers and for the tensors they can quantize.

Reuse them in your own property tests (needs the `hypothesis` package)::

    from hypothesis import given
    from tqcompile.testing.strategies import quantizer_inputs

    @given(quantizer_inputs())
    def test_my_kernel_matches_reference(case):
        quantizer, x = case
        ...

`quantizers()` draws any valid quantizer of every family with every option combination;
`float_tensors(quantizer)` draws a small tensor whose shape that quantizer accepts, with magnitudes
anywhere from the input dtype's subnormals to half its largest finite value, and optionally special
values (±0, subnormals, the smallest normal, huge values, ±Inf, NaN) at random positions.

"Huge" stops at half the dtype's largest finite value on purpose: dequantizing rounds the largest
element of a scaling unit to a grid point that may lie above it, so a value within a grid step of
fp32's maximum can come back as Inf. With NVFP4's Hadamard transform it stops at fp32's max / 64:
the transform and its inverse sum 16 products in fp32, and those sums overflow well before the
inputs do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from tqcompile.formats import Format
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

__all__ = [
    "float8_quantizers",
    "mx_quantizers",
    "nvfp4_quantizers",
    "int_quantizers",
    "quantizers",
    "shapes_for",
    "special_values_for",
    "float_tensors",
    "quantizer_inputs",
]

# Small block sizes keep generated tensors small; 3 exercises a block that is not a power of two
# and 128 the DeepSeek-V3 default.
DEFAULT_BLOCK_SIZES: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 32, 128)
DEFAULT_AXES: tuple[int, ...] = (-3, -2, -1, 0, 1, 2)
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def _choice(values, default) -> SearchStrategy:
    """`values` may be None (all of `default`), one value, or a sequence of allowed values."""
    if values is None:
        values = default
    if isinstance(values, (list, tuple)):
        return st.sampled_from(tuple(values))
    return st.just(values)


def amax_epsilons() -> SearchStrategy[float]:
    """Valid `amax_epsilon` values: the 1e-12 default and powers of ten from 1e-30 to 1."""
    return st.one_of(st.just(1e-12), st.integers(-30, 0).map(lambda k: 10.0**k))


def float8_quantizers(
    *,
    formats: Format | Sequence[Format] | None = None,
    granularities: Granularity | Sequence[Granularity] | None = None,
    block_sizes: int | Sequence[int] | None = None,
    axes: int | Sequence[int] | None = None,
    power_of_two_scale: bool | None = None,
) -> SearchStrategy[Float8Quantizer]:
    """`Float8Quantizer`s; each argument restricts one field (None: every allowed value)."""
    return st.builds(
        Float8Quantizer,
        format=_choice(formats, Float8Quantizer.allowed_formats()),
        granularity=_choice(granularities, tuple(Granularity)),
        axis=_choice(axes, DEFAULT_AXES),
        block_size=_choice(block_sizes, DEFAULT_BLOCK_SIZES),
        power_of_two_scale=_choice(power_of_two_scale, (False, True)),
        amax_epsilon=amax_epsilons(),
    )


def mx_quantizers(
    *,
    formats: Format | Sequence[Format] | None = None,
    scale_roundings: ScaleRounding | Sequence[ScaleRounding] | None = None,
) -> SearchStrategy[MXQuantizer]:
    """`MXQuantizer`s (MXFP8 E4M3/E5M2, MXFP4: every registered MX element format) with either scale rounding rule."""
    return st.builds(
        MXQuantizer,
        format=_choice(formats, MXQuantizer.allowed_formats()),
        scale_rounding=_choice(scale_roundings, tuple(ScaleRounding)),
    )


def nvfp4_quantizers(
    *,
    block_2d: bool | None = None,
    stochastic_rounding: bool | None = None,
    hadamard: bool | None = None,
) -> SearchStrategy[NVFP4Quantizer]:
    """`NVFP4Quantizer`s with every combination of 2-D blocks, stochastic rounding and the
    Hadamard transform (with a random `hadamard_seed`)."""
    return st.builds(
        NVFP4Quantizer,
        block_2d=_choice(block_2d, (False, True)),
        stochastic_rounding=_choice(stochastic_rounding, (False, True)),
        hadamard=_choice(hadamard, (False, True)),
        hadamard_seed=st.integers(0, 2**31 - 1),
        amax_epsilon=amax_epsilons(),
    )


def int_quantizers(
    *,
    formats: Format | Sequence[Format] | None = None,
    granularities: Granularity | Sequence[Granularity] | None = None,
    block_sizes: int | Sequence[int] | None = None,
    axes: int | Sequence[int] | None = None,
) -> SearchStrategy[IntQuantizer]:
    """`IntQuantizer`s (INT8, INT4, INT3, INT2) per tensor, per channel (any axis) or per block, on
    the SYMMETRIC or FULL grid. (ASYMMETRIC, weights only, has its own tests against
    compressed-tensors' observer: tests/test_int_asymmetric.py.)"""
    return st.builds(
        IntQuantizer,
        format=_choice(formats, IntQuantizer.allowed_formats()),
        granularity=_choice(granularities, (Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCKWISE_1D)),
        axis=_choice(axes, DEFAULT_AXES),
        block_size=_choice(block_sizes, DEFAULT_BLOCK_SIZES),
        amax_epsilon=amax_epsilons(),
        grid=st.sampled_from((IntGrid.SYMMETRIC, IntGrid.FULL)),
    )


_FAMILIES = {
    Float8Quantizer: float8_quantizers,
    MXQuantizer: mx_quantizers,
    NVFP4Quantizer: nvfp4_quantizers,
    IntQuantizer: int_quantizers,
}


def quantizers(*families: type[Quantizer], stochastic_rounding: bool | None = None) -> SearchStrategy[Quantizer]:
    """Any valid quantizer of the given families (default: all four), every option combination.

    `stochastic_rounding=False` leaves out quantizers that round stochastically (they are not
    idempotent by nature); True draws only those.

    Example:
        >>> quantizers(Float8Quantizer, MXQuantizer).example()  # doctest: +SKIP
    """
    families = families or tuple(_FAMILIES)
    unknown = [f for f in families if f not in _FAMILIES]
    if unknown:
        raise ValueError(f"quantizers: unknown families {unknown}; allowed: {[f.__name__ for f in _FAMILIES]}")
    options = []
    for family in families:
        if family is NVFP4Quantizer:
            options.append(nvfp4_quantizers(stochastic_rounding=stochastic_rounding))
        elif stochastic_rounding is not True:
            options.append(_FAMILIES[family]())
    if not options:
        raise ValueError(f"quantizers: none of {[f.__name__ for f in families]} rounds stochastically")
    return st.one_of(options)


def supports_columnwise(quantizer: Quantizer) -> bool:
    """Whether some input shape allows the columnwise usage (the 2-D transpose): a ROWWISE axis
    must exist in 2 dims."""
    gran, axis, _ = quantizer.layout()
    return gran is not Granularity.ROWWISE or -2 <= axis < 2


def _units(quantizer: Quantizer) -> tuple[int, int, int]:
    """(last-dim unit, second-to-last unit, minimum ndim) of the shapes `quantizer` accepts."""
    gran, axis, block = quantizer.layout()
    last = block if gran in (Granularity.BLOCKWISE_1D, Granularity.BLOCKWISE_2D) else 1
    last = math.lcm(last, quantizer.element_format().pack_elements)
    if quantizer.hadamard_transformed():
        last = math.lcm(last, 16)
    second = block if gran is Granularity.BLOCKWISE_2D else 1
    ndim = {Granularity.BLOCKWISE_1D: 1, Granularity.BLOCKWISE_2D: 2}.get(gran, 1)
    if gran is Granularity.ROWWISE:
        ndim = max(ndim, axis + 1 if axis >= 0 else -axis)
    return last, second, ndim


@st.composite
def shapes_for(
    draw,
    quantizer: Quantizer,
    *,
    columnwise: bool = False,
    min_dims: int = 1,
    max_dims: int = 3,
    max_numel: int = 2048,
    max_dim: int = 64,
    allow_empty: bool = False,
) -> tuple[int, ...]:
    """Shapes `quantizer` accepts (and, with `columnwise`, whose 2-D transpose it accepts too).

    Dims are multiples of what the layout needs (block sizes, even last dim for 4-bit payloads,
    16 for the Hadamard transform); each is at most `max_dim` unless the layout needs more, and the
    element count stays within `max_numel` unless the smallest valid shape is larger.
    `allow_empty` lets dims other than the last be 0.
    """
    last, second, need = _units(quantizer)
    if columnwise:
        if not supports_columnwise(quantizer):
            raise ValueError(f"shapes_for: {quantizer!r} has no columnwise usage (its ROWWISE axis needs more than 2 dims)")
        # The transpose is (K, R) with R = numel / K: its last dim R must satisfy the same
        # constraints as a last dim, which holds when dim -2 is a multiple of `last`.
        need, second = max(need, 2), math.lcm(second, last)
    ndim = draw(st.integers(max(min_dims, need), max(max_dims, need)))
    units = [1] * ndim
    units[-1] = last
    if ndim >= 2:
        units[-2] = second
    budget = max(max_numel, math.prod(units))
    dims: list[int | None] = [None] * ndim
    # The last dims first: they carry the layout's constraints.
    for i in reversed(range(ndim)):
        rest = math.prod(units[j] for j in range(ndim) if dims[j] is None and j != i)
        used = math.prod(d for d in dims if d is not None and d > 0)
        top = max(1, min(budget // (used * rest * units[i]), max_dim // units[i]))
        low = 0 if allow_empty and i != ndim - 1 else 1
        dims[i] = units[i] * draw(st.integers(low, top))
    shape = tuple(dims)
    quantizer.check_shape(shape)  # a strategy bug shows here, not as a confusing test failure
    if columnwise:
        quantizer.check_shape((shape[-1], math.prod(shape[:-1])))
    return shape


def largest_magnitude(dtype: torch.dtype, quantizer: Quantizer | None = None) -> float:
    """The largest finite magnitude the strategies generate for `dtype` inputs to `quantizer`
    (see the module docstring for why it is below the dtype's max)."""
    huge = torch.finfo(dtype).max / 2
    if quantizer.hadamard_transformed():
        huge = min(huge, torch.finfo(torch.float32).max / 64)
    return huge


def special_values_for(dtype: torch.dtype, *, nonfinite: bool = True, quantizer: Quantizer | None = None) -> tuple[float, ...]:
    """Values that stress a quantizer, exactly representable in `dtype`: ±0, the smallest and the
    largest subnormal, the smallest normal, ±`largest_magnitude(dtype, quantizer)`, and, with
    `nonfinite`, ±Inf and NaN."""
    fi = torch.finfo(dtype)
    tiny_sub = fi.smallest_normal * fi.eps  # eps = 2**-mantissa_bits, so this is the smallest subnormal
    huge = largest_magnitude(dtype, quantizer)
    values = (0.0, -0.0, tiny_sub, -tiny_sub, fi.smallest_normal - tiny_sub, fi.smallest_normal, huge, -huge)
    return values + ((math.inf, -math.inf, math.nan) if nonfinite else ())


def _exponent_range(dtype: torch.dtype, quantizer: Quantizer | None) -> tuple[int, int]:
    fi = torch.finfo(dtype)
    lowest = math.floor(math.log2(fi.smallest_normal * fi.eps))
    return lowest, math.floor(math.log2(largest_magnitude(dtype, quantizer)))


@st.composite
def float_tensors(
    draw,
    quantizer: Quantizer | None = None,
    *,
    shape: tuple[int, ...] | SearchStrategy[tuple[int, ...]] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    special_values: bool = True,
    nonfinite: bool = True,
    columnwise: bool = False,
    max_numel: int = 2048,
) -> torch.Tensor:
    """A small contiguous float tensor for `quantizer` (or of `shape`).

    Magnitudes are log-uniform over a random window (0 to 32 binades wide) placed anywhere from the
    dtype's smallest subnormal to `largest_magnitude(dtype, quantizer)`, with random signs; values are
    generated from a drawn seed (fast even for thousands of elements). With `special_values`, up
    to 6 elements are replaced by values from `special_values_for(dtype, nonfinite=nonfinite)`.
    `dtype` may be one dtype or several to draw from (default: float32, bfloat16, float16).
    """
    if shape is None:
        if quantizer is None:
            shape = st.lists(st.integers(1, 16), min_size=1, max_size=3).map(tuple)
        else:
            shape = shapes_for(quantizer, columnwise=columnwise, max_numel=max_numel)
    if isinstance(shape, SearchStrategy):
        shape = draw(shape)
    elif quantizer is not None:
        quantizer.check_shape(shape)
    dtype = draw(_choice(dtype, INPUT_DTYPES))
    lowest, highest = _exponent_range(dtype, quantizer)
    width = draw(st.integers(0, 32))
    start = draw(st.integers(lowest - width // 2, highest))
    seed = draw(st.integers(0, 2**32 - 1))
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    signs = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    huge = largest_magnitude(dtype, quantizer)
    x = (signs * torch.exp2(start + width * u)).clamp(-huge, huge).to(dtype)
    if special_values and x.numel():
        specials = special_values_for(dtype, nonfinite=nonfinite, quantizer=quantizer)
        picks = draw(st.lists(st.tuples(st.integers(0, x.numel() - 1), st.sampled_from(specials)), max_size=min(6, x.numel())))
        flat = x.view(-1)
        for i, v in picks:
            flat[i] = v
    return x


def seeds() -> SearchStrategy[torch.Tensor]:
    """Stochastic-rounding seeds: int64 tensors ``[seed, offset]``."""
    return st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)).map(lambda s: torch.tensor(s, dtype=torch.int64))


@st.composite
def quantizer_inputs(
    draw,
    quantizer_strategy: SearchStrategy[Quantizer] | None = None,
    *,
    columnwise: bool = False,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    special_values: bool = True,
    nonfinite: bool = True,
    max_numel: int = 2048,
) -> tuple[Quantizer, torch.Tensor]:
    """A ``(quantizer, x)`` pair: a quantizer (default `quantizers()`) and a tensor it accepts.
    With `columnwise`, only quantizers that have a columnwise usage, and shapes whose 2-D transpose
    is accepted too."""
    q = draw(quantizer_strategy if quantizer_strategy is not None else quantizers())
    if columnwise:
        assume(supports_columnwise(q))
    x = draw(
        float_tensors(
            q, dtype=dtype, special_values=special_values, nonfinite=nonfinite, columnwise=columnwise, max_numel=max_numel
        )
    )
    return q, x
