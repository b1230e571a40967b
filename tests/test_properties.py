"""Property tests of the quantize/dequantize numerics, for every quantizer family and option.

Bounds come from `tqcompile.testing.numerics` (derived there from each format's grid and the fp32
arithmetic of scaling); nothing here is a measured tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tqcompile as tq
from tqcompile.formats import E2M1_VALUES, Format
from tqcompile.formats.codec import unpack_codes
from tqcompile.kernels import reference
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, MXQuantizer, NVFP4Quantizer, ScaleRounding
from tqcompile.testing.numerics import (
    assert_error_within,
    assert_payload_equal,
    bits_of,
    expected_payload_values,
    expected_scale_inv,
    payload_values,
    saturation_values,
    scaled_values,
)
from tqcompile.testing.strategies import (
    INPUT_DTYPES,
    float8_quantizers,
    float_tensors,
    int_quantizers,
    mx_quantizers,
    nvfp4_quantizers,
    quantizer_inputs,
    quantizers,
    seeds,
    shapes_for,
    supports_columnwise,
)

qops = torch.ops.tqcompile
_U = 2.0**-24  # fp32 unit roundoff


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def _codes(data: torch.Tensor, q) -> torch.Tensor:
    """Per-element payload codes (uint8; sub-byte payloads unpacked: 4 bits two a byte, 6 bits four in three)."""
    if q.element_format().bits == 8:
        return data.contiguous().view(torch.uint8)
    return unpack_codes(data, q.element_format().bits)


def _per_element(unit: torch.Tensor, q, shape) -> torch.Tensor:
    """Broadcast a per-scaling-unit tensor (scale shape) to the element shape."""
    gran, _, block = q.layout()
    if gran is Granularity.BLOCKWISE_1D:
        unit = unit.repeat_interleave(block, -1)
    elif gran is Granularity.BLOCKWISE_2D:
        unit = unit.repeat_interleave(block, -1).repeat_interleave(block, -2)
    return unit.expand(shape)


def _is_hadamard(q) -> bool:
    return isinstance(q, NVFP4Quantizer) and q.hadamard


def _rowwise_only(qt: tq.QuantizedTensor) -> tq.QuantizedTensor:
    return tq.QuantizedTensor(
        qt.shape, qt.quantizer, qt.orig_dtype, qt.amax_group_name, _data=qt._data, _scale_inv=qt._scale_inv, _amax=qt._amax
    )


def _scale_value(scale_inv: torch.Tensor) -> torch.Tensor:
    return scale_inv.float()  # float8_e8m0fnu and float8_e4m3fn decode exactly to fp32


# ---------------------------------------------------------------------------------------------
# Round trip, scale rule and saturation
# ---------------------------------------------------------------------------------------------
@settings(max_examples=150)
@given(quantizer_inputs(), seeds())
def test_round_trip_within_error_bound(case, seed):
    q, x = case
    qt = tq.quantize(x, q, seed=seed)
    out = qt.dequantize(torch.float32)
    # The oracle recomputes amax and scales from x itself, so a wrong amax or scale fails here.
    assert_error_within(q, x, out)
    assert torch.equal(bits_of(qt._scale_inv), bits_of(expected_scale_inv(q, x))), "scales do not follow the spec"
    assert qt._scale_inv.shape == q.scale_shape(x.shape) and qt._scale_inv.dtype == q.scale_dtype()
    if not q.needs_seed():
        # Every element is the nearest grid value (ties to even) of what the spec scales it to.
        assert torch.equal(bits_of(payload_values(qt._data, q)), bits_of(expected_payload_values(q, x)))
    # Anything the format is asked to hold beyond its max saturates to ±max, sign preserved.
    over, sat = saturation_values(q, scaled_values(q, x))
    vals = payload_values(qt._data, q)
    assert torch.equal(vals[over], sat[over])
    # Dequantizing to the input dtype is the fp32 result saturated to that dtype's finite range (the
    # documented rule: a result beyond it would otherwise round to Inf in bf16/fp16) and cast once.
    big = torch.finfo(x.dtype).max
    assert torch.equal(bits_of(qt.dequantize()), bits_of(out.clamp(-big, big).to(x.dtype)))
    assert qt.dequantize().dtype == x.dtype


# The quantizers whose scales come from a tensor-level amax, the one `amax_group` reduces.
_TENSOR_AMAX = st.one_of(
    float8_quantizers(granularities=Granularity.TENSORWISE),
    int_quantizers(granularities=Granularity.TENSORWISE),
    nvfp4_quantizers(),
)


@settings(max_examples=80)
@given(quantizer_inputs(_TENSOR_AMAX, nonfinite=False), st.integers(-8, 8), seeds())
def test_external_amax_round_trip_and_saturation(case, log2_factor, seed):
    """A group-reduced amax (>= the local one) keeps the bound; a smaller one (values beyond the
    amax-derived range) saturates those values to ±max * scale_inv."""
    q, x = case
    amax = qops.amax(x, q) * 2.0**log2_factor
    # A reduced amax is the amax of some rank's finite values, inside the strategies' domain.
    assume(amax <= torch.finfo(torch.float32).max / 2)
    data, scale_inv = qops.quantize(x, q, amax, seed)
    out = qops.dequantize(data, scale_inv, amax, q, torch.float32)
    assert_error_within(q, x, out, amax)
    assert torch.equal(bits_of(scale_inv), bits_of(expected_scale_inv(q, x, amax)))
    over, fsat = saturation_values(q, scaled_values(q, x, amax))
    assert torch.equal(payload_values(data, q)[over], fsat[over])
    if not _is_hadamard(q):
        # ±max * scale_inv, in the dequantizer's own fp32 order (NVFP4: q * (s_blk / s_enc), the
        # order compressed-tensors' decompressor uses).
        if isinstance(q, NVFP4Quantizer):
            s_enc = torch.div(Format.E4M3.max_value * Format.E2M1.max_value, amax.clamp(min=q.amax_epsilon))
            sat = fsat * _per_element(scale_inv.float() / s_enc, q, x.shape)
        else:
            sat = fsat * scale_inv
        assert torch.equal(out[over], sat[over])


_NO_HADAMARD = st.one_of(float8_quantizers(), mx_quantizers(), int_quantizers(), nvfp4_quantizers(hadamard=False))


@settings(max_examples=60)
@given(quantizer_inputs(_NO_HADAMARD), seeds(), st.data())
def test_inf_saturates_nan_follows_format(case, seed, data):
    """Reference conventions: amaxes ignore non-finite values (scales equal those of the tensor
    with them zeroed), ±Inf saturates to ±max, NaN stays NaN in FP8 and becomes +0 in E2M1/INT.
    (The Hadamard transform has its own test: it spreads a non-finite value over its block.)"""
    q, x = case
    n = x.numel()
    idx = data.draw(st.lists(st.integers(0, n - 1), min_size=min(3, n), max_size=min(3, n), unique=True))
    x = x.clone()
    x.view(-1)[idx] = torch.tensor([math.inf, -math.inf, math.nan][: len(idx)], dtype=x.dtype)
    finite = torch.isfinite(x)
    x0 = torch.where(finite, x, torch.zeros_like(x))
    qt, qt0 = tq.quantize(x, q, seed=seed), tq.quantize(x0, q, seed=seed)
    assert torch.equal(bits_of(qt._scale_inv), bits_of(qt0._scale_inv))
    if qt._amax is not None:
        assert torch.equal(bits_of(qt._amax), bits_of(qt0._amax))
    codes, codes0 = _codes(qt._data, q), _codes(qt0._data, q)
    assert torch.equal(codes[finite], codes0[finite])
    vals = payload_values(qt._data, q)
    _, (lo, hi) = saturation_values(q, torch.tensor([-math.inf, math.inf]))
    out = qt.dequantize(torch.float32)
    posinf, neginf, nan = x == math.inf, x == -math.inf, torch.isnan(x)
    live = torch.ones_like(finite)
    if isinstance(q, NVFP4Quantizer):
        # A block whose finite amax is 0 gets a zero E4M3 scale; Inf there dequantizes to
        # ±6 * 0 = 0 (its payload code is 0, see test_nvfp4_inf_in_zero_scale_block_saturates).
        live = _per_element(qt._scale_inv.float(), q, x.shape) != 0
        assert torch.equal(out[~live & ~nan], torch.zeros_like(out[~live & ~nan]))
    assert torch.equal(vals[posinf & live], torch.full_like(vals[posinf & live], float(hi)))
    assert torch.equal(vals[neginf & live], torch.full_like(vals[neginf & live], float(lo)))
    assert torch.isfinite(out[~nan]).all()
    if q.element_format() in (Format.E4M3, Format.E5M2):
        assert torch.isnan(vals[nan]).all() and torch.isnan(out[nan]).all()
    else:
        assert torch.equal(codes[nan], torch.zeros_like(codes[nan])), "NaN must become +0"


@settings(max_examples=40)
@given(quantizer_inputs(nvfp4_quantizers(hadamard=True, stochastic_rounding=False), nonfinite=False), st.data())
def test_hadamard_nonfinite_poisons_only_its_block(case, data):
    """The transform mixes a 16-block: one non-finite input x_i makes every transformed element j
    of its block non-finite (NaN, or Inf with the sign of x_i * M[i, j]). Amaxes ignore them, so
    scales and all other blocks quantize as if the block were zero; the poisoned elements then
    follow the usual rules (Inf saturates, NaN becomes 0), and a unit whose finite amax is 0 has
    a zero scale and dequantizes to 0."""
    q, x = case
    x = x.clone()
    flat_i = data.draw(st.integers(0, x.numel() - 1))
    bad = data.draw(st.sampled_from((math.inf, -math.inf, math.nan)))
    x.view(-1)[flat_i] = bad
    poisoned = (~torch.isfinite(x)).unflatten(-1, (-1, 16)).any(-1, keepdim=True).expand(*x.shape[:-1], -1, 16).flatten(-2)
    x0 = torch.where(poisoned, torch.zeros_like(x), x)
    qt, qt0 = tq.quantize(x, q), tq.quantize(x0, q)
    assert torch.equal(bits_of(qt._scale_inv), bits_of(qt0._scale_inv)) and torch.equal(qt._amax, qt0._amax)
    vals, vals0 = payload_values(qt._data, q), payload_values(qt0._data, q)
    assert torch.equal(bits_of(vals[~poisoned]), bits_of(vals0[~poisoned]))
    live = _per_element(qt._scale_inv.float(), q, x.shape) != 0
    if math.isnan(bad):
        expected = torch.zeros(16)
    else:
        m = reference.hadamard_matrix(q.hadamard_seed)
        expected = math.copysign(Format.E2M1.max_value, bad) * torch.sign(m[flat_i % x.shape[-1] % 16])
    got = vals[poisoned]
    expected = torch.where(live[poisoned], expected, torch.zeros_like(expected))
    assert torch.equal(got, expected), (got, expected)
    out = qt.dequantize(torch.float32)
    assert torch.equal(out[poisoned & ~live], torch.zeros_like(out[poisoned & ~live]))


# ---------------------------------------------------------------------------------------------
# Idempotence: quantize(dequantize(qt)) reproduces qt
# ---------------------------------------------------------------------------------------------
@settings(max_examples=120)
@given(quantizer_inputs(quantizers(stochastic_rounding=False)))
def test_idempotence(case):
    """Grid points are fixed points of the round trip. What "bit for bit" can mean depends on the
    scale rule (each case derived in its branch); stochastic rounding is tested separately."""
    q, x = case
    qt = tq.quantize(x, q)
    y = qt.dequantize(torch.float32)
    if isinstance(q, NVFP4Quantizer):
        # Requantized with the same tensor amax (re-deriving it from y would move s_enc). A block
        # scale in E4M3's normal range is within 2**-4 of amax_blk/6*s_enc, so the block max
        # lands in [5.6, 6.4] and rounds to 6: the block amax of y reproduces the scale exactly.
        # A subnormal block scale has a coarser relative step and may change; those blocks are
        # left out. Zero-scale blocks stay zero.
        data2, scale2 = qops.quantize(y, q, qt._amax, None)
        keep_units = (qt._scale_inv.float() >= 2.0**-6) | (qt._scale_inv.float() == 0)
        assert torch.equal(bits_of(scale2[keep_units]), bits_of(qt._scale_inv[keep_units]))
        keep = _per_element(keep_units, q, x.shape)
        codes, codes2 = _codes(qt._data, q), _codes(data2, q)
        if q.hadamard:
            # The round trip passes through the inverse and forward transform in fp32: a value
            # that rounds to zero may come back as a tiny value of either sign, so only the
            # magnitude of a zero code is a fixed point (code 8 is -0).
            codes, codes2 = (torch.where(c == 8, torch.zeros_like(c), c) for c in (codes, codes2))
        assert torch.equal(codes2[keep], codes[keep])
        return
    if getattr(q, "grid", None) is tq.IntGrid.FULL:
        # The FULL grid's bottom code is one step beyond -amax: where the unit max is negative and
        # takes it, y's amax is (qmax + 1) / (qmax + 0.5) of x's and a re-derived scale moves, as in
        # llmcompressor. With the same static amax (what calibrated weights hold) it is a fixed point.
        data2, scale2 = reference.quantize(y, q, reference.unit_amax(x, q), None)
        assert torch.equal(_codes(data2, q), _codes(qt._data, q))
        assert torch.equal(bits_of(scale2), bits_of(qt._scale_inv))
        return
    qt2 = tq.quantize(y, q)
    pow2_scales = isinstance(q, MXQuantizer) or (isinstance(q, Float8Quantizer) and q.power_of_two_scale)
    if not pow2_scales:
        # FP8/INT with fp32 scales: the largest element comes back as fmt_max * (1/s), one
        # rounding away from amax, so the re-derived scale may move by a few ulps: amax' has two
        # roundings, s' = fmt_max/amax' one, 1/s' one more; with second-order terms, 6u. The
        # payload (a grid point perturbed by that much) is unchanged.
        assert torch.equal(_codes(qt2._data, q), _codes(qt._data, q))
        assert ((qt2._scale_inv.double() / qt._scale_inv.double() - 1).abs() <= 6 * _U).all()
        return
    rceil = isinstance(q, MXQuantizer) and q.scale_rounding is ScaleRounding.RCEIL
    if isinstance(q, MXQuantizer) and not rceil:
        # MX FLOOR: the block max comes back in [2**emax, fmt_max], which has the same floor(log2).
        assert torch.equal(bits_of(qt2._scale_inv), bits_of(qt._scale_inv))
        assert torch.equal(_codes(qt2._data, q), _codes(qt._data, q))
        return
    # Power-of-two FP8 scales and MX RCEIL: when the unit max rounded down to exactly half the
    # format max, the re-derived scale doubles and every payload doubles with it (exact, since
    # all of them are <= max/2); values are unchanged bit for bit either way (E2M1's -0 included).
    y2 = qt2.dequantize(torch.float32)
    assert torch.equal(bits_of(y2), bits_of(y))
    ratio = qt._scale_inv.float() / qt2._scale_inv.float()
    assert ((ratio == 1) | (ratio == 2)).all(), ratio.unique()


@pytest.mark.parametrize("q", [MXQuantizer(format=Format.E2M1), NVFP4Quantizer()], ids=["mxfp4", "nvfp4"])
def test_e2m1_negative_zero_is_idempotent(q):
    """A small negative value rounds to -0 (code 8), and -0.0 re-encodes as -0: the sign bit is kept."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 6.0, -0.01  # -0.01 rounds to zero on a grid scaled for 6
    qt = tq.quantize(x, q)
    assert _codes(qt._data, q)[0, 1] == 8
    again = qops.quantize(qt.dequantize(torch.float32), q, qt._amax, None)[0]
    assert torch.equal(_codes(again, q), _codes(qt._data, q))


# ---------------------------------------------------------------------------------------------
# Dequantization never overflows (docs/numerics: "Dequantization saturates")
# ---------------------------------------------------------------------------------------------
# Regression: each of these rounded the largest element up to a grid point above the dtype's max
# (pow2 FP8 and MX RCEIL: 256 * 2**120 = 2**128 from fp32's max, 256 * 2**8 from fp16's 65504;
# INT8: 127 * scale_inv an ulp above fp32's max), so a finite input dequantized to ±Inf.
_OVERFLOWED = {
    "fp8-e4m3-pow2": (Float8Quantizer(power_of_two_scale=True), (torch.float32, torch.bfloat16, torch.float16)),
    "fp8-e5m2-pow2": (
        Float8Quantizer(format=Format.E5M2, power_of_two_scale=True),
        (torch.float32, torch.bfloat16, torch.float16),
    ),
    "int8": (IntQuantizer(), (torch.float32,)),
    "mxfp8-rceil": (MXQuantizer(scale_rounding=ScaleRounding.RCEIL), (torch.float32, torch.bfloat16, torch.float16)),
    "mxfp4-rceil": (
        MXQuantizer(format=Format.E2M1, scale_rounding=ScaleRounding.RCEIL),
        (torch.float32, torch.bfloat16, torch.float16),
    ),
}


@pytest.mark.parametrize(
    "name, dtype",
    [(name, dt) for name, (_, dts) in _OVERFLOWED.items() for dt in dts],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_dequantize_of_dtype_max_saturates(name, dtype):
    q = _OVERFLOWED[name][0]
    big = torch.finfo(dtype).max
    x = torch.full((2, 32), big, dtype=dtype)
    x[1] = -big
    qt = tq.quantize(x, q)
    # The raw product does overflow: the saturation is what keeps the result finite.
    raw = (payload_values(qt._data, q) * _per_element(_scale_value(qt._scale_inv), q, x.shape)).to(dtype)
    assert not torch.isfinite(raw).any()
    # Saturated to the dtype's max, which is exactly the input...
    assert torch.equal(qt.dequantize(), x)
    # ...and to fp32's max when dequantized to fp32 (the bf16/fp16 products are finite there).
    assert torch.isfinite(qt.dequantize(torch.float32)).all()


def _near_max_tensors(base, dtype, picks):
    """`base` with `picks` [(index, fraction, sign)] set to sign * fraction-of-the-way between
    half the dtype's max and its max (rounded to `dtype`, so the max itself is reachable)."""
    fi = torch.finfo(dtype)
    x = base.to(dtype).clone()
    flat = x.view(-1)
    for i, frac, sign in picks:
        flat[i % flat.numel()] = sign * min(fi.max, fi.max / 2 * (1 + frac))
    return x


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_finite_input_dequantizes_finite(data):
    """Property, every family and option: a finite input, magnitudes up to the dtype's largest
    finite value, never dequantizes to ±Inf or NaN, in its own dtype or in fp32."""
    q = data.draw(quantizers())
    dtype = data.draw(st.sampled_from(INPUT_DTYPES))
    columnwise = supports_columnwise(q) and data.draw(st.booleans())
    base = data.draw(float_tensors(q, dtype=dtype, special_values=True, nonfinite=False, columnwise=columnwise))
    if base.numel() == 0:
        return
    picks = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, base.numel() - 1), st.sampled_from((1.0, 0.999, 0.9, 0.75, 0.5, 0.0)), st.sampled_from((1.0, -1.0))
            ),
            max_size=6,
        )
    )
    x = _near_max_tensors(base, dtype, picks)
    assume(torch.isfinite(x).all())
    if _is_hadamard(q) and dtype != torch.float16:
        # The transform sums 16 terms of |x| / 4: beyond fp32's max / 4 the transformed value has
        # no fp32 representation (docs/numerics/nvfp4.md); up to there it must stay finite.
        limit = torch.finfo(torch.float32).max / 4
        x = x.clamp(-limit, limit)
    qt = tq.quantize(x, q, columnwise=columnwise)
    for out_dtype in {dtype, torch.float32}:
        out = _rowwise_only(qt).dequantize(out_dtype)
        assert torch.isfinite(out).all(), (q, out_dtype, x[~torch.isfinite(out)], out[~torch.isfinite(out)])
        if qt.has_columnwise:
            assert torch.isfinite(qt.keep_usages(rowwise=False, columnwise=True).dequantize(out_dtype)).all()


def test_nvfp4_inf_in_zero_scale_block_encodes_zero():
    """Documented exception (reference docstring): a block whose block scale is 0 has nothing to
    scale by, so every element, Inf included, encodes +0."""
    x = torch.zeros(1, 16)
    x[0, 3], x[0, 5] = math.inf, -math.inf
    qt = tq.quantize(x, NVFP4Quantizer())
    assert qt._scale_inv.float().item() == 0.0
    assert _codes(qt._data, qt.quantizer)[0].tolist() == [0] * 16


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2, Format.E2M1])
def test_mx_rceil_exponent_of_tiny_amax(fmt):
    """Regression: amax / fmt_max underflowing fp32 to 0 once gave frexp's exponent 0 (scale 1),
    flushing the block to zero, instead of ceil(log2(...)) clamped to -127."""
    q = MXQuantizer(format=fmt, scale_rounding=ScaleRounding.RCEIL)
    x = torch.full((32,), 2.0**-149)  # 2**-149 / fmt_max underflows fp32
    assert tq.quantize(x, q)._scale_inv.view(torch.uint8).item() == 0  # E8M0 code of 2**-127


# ---------------------------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------------------------
_E2M1_GAPS = [(lo, hi) for lo, hi in zip(E2M1_VALUES, E2M1_VALUES[1:])]


def _sr_input(value: float, rows: int) -> torch.Tensor:
    """Rows of 16: a leading 6.0 sets every block amax (and the tensor amax) to 6, so s_enc = 448,
    every block scale is e4m3(6/6*448) = 448 and the element format sees x exactly (x * 448 / 448
    is exact for values with few mantissa bits)."""
    x = torch.full((rows, 16), value)
    x[:, 0] = 6.0
    return x


@settings(max_examples=40)
@given(st.sampled_from(_E2M1_GAPS), st.integers(1, 63), st.sampled_from((1.0, -1.0)), seeds(), st.booleans())
def test_stochastic_rounding_is_unbiased(gap, k, sign, seed, block_2d):
    lo, hi = gap
    value = sign * (lo + (hi - lo) * k / 64)  # exactly representable, p = k/64 exactly
    q = NVFP4Quantizer(stochastic_rounding=True, block_2d=block_2d)
    rows = 8192  # 122880 roundings: 6 sigma is under 0.9% of the gap, so a 1% bias in P(up) shows
    out = tq.quantize(_sr_input(value, rows), q, seed=seed).dequantize(torch.float32)[:, 1:]
    # Each rounding lands on one of the two neighbours...
    assert ((out == sign * lo) | (out == sign * hi)).all()
    # ...and goes up with probability p = k/64, so the mean is unbiased: for N independent
    # roundings its standard deviation is gap * sqrt(p (1 - p) / N). Six of them: a correct
    # generator fails with probability ~2e-9 per example.
    n, p = out.numel(), k / 64
    sigma = (hi - lo) * math.sqrt(p * (1 - p) / n)
    assert abs(out.double().mean().item() - value) <= 6 * sigma


@settings(max_examples=20)
@given(seeds(), st.booleans())
def test_stochastic_rounding_of_grid_values_is_exact(seed, block_2d):
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))
    x = _sr_input(0.0, 16)
    x[:, 1:] = grid[torch.arange(16 * 15) % grid.numel()].reshape(16, 15)
    q = NVFP4Quantizer(stochastic_rounding=True, block_2d=block_2d)
    assert torch.equal(tq.quantize(x, q, seed=seed).dequantize(torch.float32), x)


@settings(max_examples=20)
@given(quantizer_inputs(nvfp4_quantizers(stochastic_rounding=True), nonfinite=False, max_numel=512), seeds())
def test_stochastic_rounding_is_deterministic_in_its_seed(case, seed):
    q, x = case
    a, b = tq.quantize(x, q, seed=seed), tq.quantize(x, q, seed=seed.clone())
    assert_payload_equal(a, b)


def test_stochastic_rounding_offset_changes_the_draw():
    x = _sr_input(2.5, 64)  # p = 1/2 for all 960 test elements
    q = NVFP4Quantizer(stochastic_rounding=True)
    a = tq.quantize(x, q, seed=torch.tensor([7, 0]))._data
    b = tq.quantize(x, q, seed=torch.tensor([7, 1000]))._data
    assert not torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Zeros, usages, strides, dtypes
# ---------------------------------------------------------------------------------------------
@settings(max_examples=60)
@given(st.data())
def test_all_zero_input(data):
    q = data.draw(quantizers())
    columnwise = supports_columnwise(q) and data.draw(st.booleans())
    shape = data.draw(shapes_for(q, columnwise=columnwise, allow_empty=True))  # empty tensors too
    dtype = data.draw(st.sampled_from(INPUT_DTYPES))
    qt = tq.quantize(torch.zeros(shape, dtype=dtype), q, columnwise=columnwise, seed=data.draw(seeds()))
    for name in ("_scale_inv", "_scale_inv_t", "_amax", "_amax_t"):
        t = getattr(qt, name)
        if t is not None:
            assert torch.isfinite(_scale_value(t)).all(), f"{name} is not finite: {t}"
    for name in ("_data", "_data_t"):
        t = getattr(qt, name)
        if t is not None:
            assert not bits_of(t).any(), f"{name} is not all zero bits"
    out = qt.dequantize(torch.float32)
    assert out.shape == shape and not bits_of(out).any()  # +0.0 everywhere


@settings(max_examples=80)
@given(quantizer_inputs(columnwise=True), seeds())
def test_columnwise_is_the_rowwise_quantization_of_the_transpose(case, seed):
    q, x = case
    qt = tq.quantize(x, q, columnwise=True, seed=seed)
    x_t = x.reshape(-1, x.shape[-1]).t()
    ref = tq.quantize(x_t.contiguous(), q, seed=seed)
    # Same bytes; the columnwise scale in its own layout (flat for 1-D blocks: Quantizer.flat_columnwise_scale).
    assert tuple(qt._scale_inv_t.shape) == tuple(q.columnwise_scale_shape(x_t.shape))
    for col, row in (("_data_t", "_data"), ("_scale_inv_t", "_scale_inv"), ("_amax_t", "_amax")):
        a, b = getattr(qt, col), getattr(ref, row)
        assert (a is None) == (b is None), col
        if a is not None:
            assert torch.equal(bits_of(a), bits_of(b)), col
    # The rowwise usage is untouched by asking for the columnwise one too.
    assert_payload_equal(tq.quantize(x, q, seed=seed), _rowwise_only(qt))
    if x.dim() == 2:
        assert torch.equal(bits_of(qt.t().dequantize()), bits_of(tq.quantize(x.t(), q, seed=seed).dequantize()))
    only_col = tq.quantize(x, q, rowwise=False, columnwise=True, seed=seed)
    assert torch.equal(bits_of(only_col.dequantize()), bits_of(ref.dequantize().t().reshape(x.shape)))


@settings(max_examples=60)
@given(quantizer_inputs(), seeds(), st.booleans())
def test_noncontiguous_input_matches_contiguous(case, seed, transposed):
    q, x = case
    x_nc = x.transpose(-1, -2).contiguous().transpose(-1, -2) if transposed and x.dim() >= 2 else x
    if x_nc.is_contiguous():  # also when a transposed dim has size 1
        x_nc = torch.stack((x, torch.full_like(x, 12345.0)), dim=-1)[..., 0]  # stride 2 in the last dim
    assert not x_nc.is_contiguous() or x.numel() <= 1
    assert_payload_equal(tq.quantize(x_nc, q, seed=seed), tq.quantize(x, q, seed=seed))


@settings(max_examples=60)
@given(quantizer_inputs(dtype=(torch.bfloat16, torch.float16)), seeds())
def test_low_precision_inputs_quantize_like_their_fp32_value(case, seed):
    q, x = case
    qt = tq.quantize(x, q, seed=seed)
    assert qt.dtype == x.dtype and qt.orig_dtype == x.dtype
    assert_payload_equal(qt, tq.quantize(x.float(), q, seed=seed), check_dtype=False)
    assert qt.dequantize().dtype == x.dtype
