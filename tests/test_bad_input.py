"""Bad and edge-case input: every rejection names the bad value and what is allowed, and every
accepted edge case (empty, non-contiguous, NaN/Inf, all zero) has a defined result.

The amax_group non-member case is covered by the multi-process gloo tests.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import tqcompile as tq

G = tq.Granularity

# One quantizer per scale layout and element format. Block sizes are small so the shapes used
# below (multiples of 64) hold whole blocks in both usages.
QUANTIZERS = {
    "fp8_tensor": tq.Float8Quantizer(),
    "fp8_e5m2_row": tq.Float8Quantizer(format=tq.Format.E5M2, granularity=G.ROWWISE),
    "fp8_1x32": tq.Float8Quantizer(granularity=G.BLOCKWISE_1D, block_size=32),
    "fp8_32x32_pow2": tq.Float8Quantizer(granularity=G.BLOCKWISE_2D, block_size=32, power_of_two_scale=True),
    "mxfp8": tq.MXQuantizer(),
    "mxfp4_rceil": tq.MXQuantizer(format=tq.Format.E2M1, scale_rounding=tq.ScaleRounding.RCEIL),
    "nvfp4": tq.NVFP4Quantizer(),
    "nvfp4_2d": tq.NVFP4Quantizer(block_2d=True),
    "nvfp4_rht": tq.NVFP4Quantizer(hadamard=True, hadamard_seed=3),
    "int8_tensor": tq.IntQuantizer(),
    "int8_row": tq.IntQuantizer(granularity=G.ROWWISE),
    "int4_1x32": tq.IntQuantizer(format=tq.Format.INT4, granularity=G.BLOCKWISE_1D, block_size=32),
}
QUANTIZER_PARAMS = [pytest.param(q, id=name) for name, q in QUANTIZERS.items()]


def _inner_bytes(qx: tq.QuantizedTensor) -> dict[str, torch.Tensor]:
    """Every inner tensor, with one-byte dtypes viewed as uint8 so NaN payloads compare bitwise."""
    return {n: (t.view(torch.uint8) if t.element_size() == 1 else t) for n, t in qx._inner().items()}


def _assert_same_quantization(a: tq.QuantizedTensor, b: tq.QuantizedTensor) -> None:
    ia, ib = _inner_bytes(a), _inner_bytes(b)
    assert ia.keys() == ib.keys()
    for name in ia:
        assert torch.equal(ia[name], ib[name]), name


def _scales_finite(qx: tq.QuantizedTensor) -> bool:
    """All scales and amaxes are finite (E8M0 bytes decode to finite powers of two unless 0xFF)."""
    for name, t in qx._inner().items():
        if name.startswith("_data"):
            continue
        if t.dtype == torch.float8_e8m0fnu:
            if (t.view(torch.uint8) == 0xFF).any():
                return False
        elif not torch.isfinite(t.float()).all():
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Unsupported dtypes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64, torch.complex64, torch.float8_e4m3fn]
)
@pytest.mark.parametrize("q", [QUANTIZERS["fp8_tensor"], QUANTIZERS["nvfp4"]], ids=["fp8", "nvfp4"])
def test_unsupported_dtype(dtype, q):
    x = torch.ones(4, 32).to(dtype)
    with pytest.raises(TypeError) as e:
        tq.quantize(x, q)
    msg = str(e.value)
    assert f"x.dtype={dtype}" in msg
    assert "torch.float32, torch.bfloat16, torch.float16" in msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_supported_dtypes_are_kept_as_the_nominal_dtype(dtype):
    qx = tq.quantize(torch.ones(4, 32, dtype=dtype), tq.MXQuantizer())
    assert qx.dtype == dtype and qx.dequantize().dtype == dtype


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "q, shape, dim, size, block, pad, padded",
    [
        (tq.MXQuantizer(), (4, 40), 1, 40, 32, 24, 64),
        (tq.MXQuantizer(format=tq.Format.E2M1), (2, 3, 33), 2, 33, 32, 31, 64),
        (tq.NVFP4Quantizer(), (4, 20), 1, 20, 16, 12, 32),
        (tq.NVFP4Quantizer(block_2d=True), (40, 32), 0, 40, 16, 8, 48),
        (tq.Float8Quantizer(granularity=G.BLOCKWISE_1D), (2, 100), 1, 100, 128, 28, 128),
        (tq.Float8Quantizer(granularity=G.BLOCKWISE_2D), (130, 128), 0, 130, 128, 126, 256),
        (tq.IntQuantizer(granularity=G.BLOCKWISE_1D, block_size=32), (3, 48), 1, 48, 32, 16, 64),
    ],
)
def test_shape_not_divisible_by_block_names_padding(q, shape, dim, size, block, pad, padded):
    with pytest.raises(ValueError) as e:
        tq.quantize(torch.zeros(shape), q)
    msg = str(e.value)
    assert f"dim {dim} of shape {shape} is {size}" in msg
    assert f"block size {block}" in msg
    assert f"pad it with {pad} zeros to {padded}" in msg


def test_columnwise_shape_error_names_the_transpose():
    # (3, 32) is fine rowwise; the columnwise usage quantizes the (32, 3) transpose, whose last dim is 3.
    q = tq.MXQuantizer()
    tq.quantize(torch.zeros(3, 32), q)
    with pytest.raises(ValueError) as e:
        tq.quantize(torch.zeros(3, 32), q, columnwise=True)
    msg = str(e.value)
    assert "columnwise usage quantizes the transpose, of shape (32, 3)" in msg
    assert "pad it with 29 zeros to 32" in msg


@pytest.mark.parametrize(
    "q", [tq.Float8Quantizer(granularity=G.BLOCKWISE_2D), tq.NVFP4Quantizer(block_2d=True)], ids=["fp8_2d", "nvfp4_2d"]
)
def test_2d_blocks_need_two_dims(q):
    with pytest.raises(ValueError, match=r"BLOCKWISE_2D .*needs at least 2 dims, got shape \(256,\)"):
        tq.quantize(torch.zeros(256), q)


@pytest.mark.parametrize(
    "q, shape",
    [
        (tq.IntQuantizer(format=tq.Format.INT4), (4, 7)),
        (tq.IntQuantizer(format=tq.Format.INT4, granularity=G.ROWWISE), (3, 5)),
        (tq.IntQuantizer(format=tq.Format.INT4), (9,)),
    ],
)
def test_4bit_odd_last_dim(q, shape):
    with pytest.raises(ValueError) as e:
        tq.quantize(torch.zeros(shape), q)
    msg = str(e.value)
    assert "two elements a byte; the last dim must be even" in msg
    assert f"got shape {shape}" in msg


def test_4bit_odd_leading_dim_fails_only_columnwise():
    q = tq.IntQuantizer(format=tq.Format.INT4)
    tq.quantize(torch.zeros(3, 4), q)
    with pytest.raises(ValueError, match=r"transpose, of shape \(4, 3\).*last dim must be even"):
        tq.quantize(torch.zeros(3, 4), q, columnwise=True)


def test_rowwise_axis_out_of_range():
    q = tq.Float8Quantizer(granularity=G.ROWWISE, axis=2)
    with pytest.raises(ValueError, match=re.escape("axis=2 is out of range for a 2-dim tensor of shape (4, 32)")):
        tq.quantize(torch.zeros(4, 32), q)


def test_zero_dim_tensor():
    # Tensorwise quantizes a scalar; a per-row scale or a columnwise usage needs a dim.
    assert tq.quantize(torch.tensor(2.0), tq.Float8Quantizer()).dequantize().item() == 2.0
    with pytest.raises(ValueError, match="ROWWISE needs a tensor with at least 1 dim, got a 0-dim tensor"):
        tq.quantize(torch.tensor(2.0), tq.Float8Quantizer(granularity=G.ROWWISE))
    with pytest.raises(ValueError, match="columnwise usage needs a tensor with at least 1 dim"):
        tq.quantize(torch.tensor(2.0), tq.Float8Quantizer(), columnwise=True)


# ---------------------------------------------------------------------------------------------
# Empty tensors: an empty QuantizedTensor of the same shape, with finite scales
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (0, 32, 64)])
@pytest.mark.parametrize("q", QUANTIZER_PARAMS)
def test_empty_tensor(q, shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    qx = tq.quantize(x, q, columnwise=True)
    assert qx.shape == shape and qx.dtype == torch.bfloat16
    assert qx._data.shape == q.payload_shape(shape) and qx._data.numel() == 0
    assert qx._scale_inv.shape == q.scale_shape(shape)
    assert qx._data_t.shape == q.payload_shape((shape[-1], math.prod(shape[:-1])))
    assert _scales_finite(qx)
    out = qx.dequantize()
    assert out.shape == shape and out.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Non-contiguous input: the same bytes as the contiguous copy
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda b: b.t(), id="transposed"),
        pytest.param(lambda b: torch.cat((b, b), dim=1)[:, ::2], id="strided"),
        pytest.param(lambda b: b[:1].expand(64, 64), id="expanded"),
        pytest.param(lambda b: b.reshape(64, 2, 32).permute(1, 0, 2), id="permuted3d"),
    ],
)
@pytest.mark.parametrize("q", QUANTIZER_PARAMS)
def test_non_contiguous_equals_contiguous(q, make):
    base = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    x = make(base)
    assert not x.is_contiguous()
    seed = torch.tensor([7, 0])
    a = tq.quantize(x, q, columnwise=True, seed=seed)
    b = tq.quantize(x.contiguous(), q, columnwise=True, seed=seed)
    _assert_same_quantization(a, b)
    assert a._data.is_contiguous() and a._data_t.is_contiguous()


# ---------------------------------------------------------------------------------------------
# NaN / Inf: never a NaN or Inf scale; Inf saturates; NaN stays NaN in FP8 and is 0 elsewhere
# ---------------------------------------------------------------------------------------------
def _special_tensor(dtype: torch.dtype) -> torch.Tensor:
    """64x64, row 0 mixes specials with finite values; row 1 is all NaN, row 2 all +Inf."""
    x = torch.zeros(64, 64)
    x[0, :4] = torch.tensor([math.inf, -math.inf, math.nan, 2.0])
    x[1] = math.nan
    x[2] = math.inf
    x[3:] = torch.linspace(-1, 1, 61 * 64).reshape(61, 64)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q", QUANTIZER_PARAMS)
def test_nan_inf_give_finite_scales(q, dtype):
    qx = tq.quantize(_special_tensor(dtype), q, columnwise=True)
    assert _scales_finite(qx)


@pytest.mark.parametrize(
    "q", [QUANTIZERS[n] for n in ("fp8_tensor", "fp8_e5m2_row", "fp8_1x32", "mxfp8")], ids=["t", "row", "1x32", "mx"]
)
def test_fp8_inf_saturates_nan_propagates(q):
    fmax = q.element_format().max_value
    qx = tq.quantize(_special_tensor(torch.float32), q)
    payload = qx._data.float()
    # Row 0's unit holds the finite 2.0, so +-Inf land on exactly +-max of the format.
    assert payload[0, 0].item() == fmax and payload[0, 1].item() == -fmax
    assert math.isnan(payload[0, 2].item())
    assert torch.isnan(payload[1]).all()
    assert (payload[2] == fmax).all()
    deq = qx.dequantize()
    assert math.isnan(deq[0, 2].item()) and torch.isfinite(deq[0, [0, 1, 3]]).all()


@pytest.mark.parametrize(
    "q", [QUANTIZERS[n] for n in ("mxfp4_rceil", "nvfp4", "int8_tensor", "int4_1x32")], ids=["mxfp4", "nvfp4", "int8", "int4"]
)
def test_nan_is_zero_and_inf_saturates_in_formats_without_nan(q):
    qx = tq.quantize(_special_tensor(torch.float32), q)
    deq = qx.dequantize()
    assert torch.isfinite(deq).all()
    # NaN has no encoding in E2M1 / INT: it becomes 0.
    assert deq[0, 2].item() == 0.0 and (deq[1] == 0).all()
    # +-Inf saturates to the largest magnitude of its scaling unit, which here is the one
    # dequantized value 2.0 also maps to (it is the unit's finite amax) - or above it for RCEIL.
    assert deq[0, 0].item() == -deq[0, 1].item() >= deq[0, 3].item() > 0


def test_nvfp4_block_with_zero_scale_dequantizes_inf_to_zero():
    # A row of +Inf has no finite amax: its E4M3 block scales are 0 (finite), and the largest
    # magnitude such a block can express is 6 * 0, so its elements, Inf included, dequantize to 0.
    # (Which E2M1 code the Inf gets there, 0 or the saturated 7, does not change that.)
    qx = tq.quantize(_special_tensor(torch.float32), tq.NVFP4Quantizer())
    assert (qx._scale_inv[2].float() == 0).all()
    assert (qx.dequantize()[2] == 0).all()


# ---------------------------------------------------------------------------------------------
# All-zero tensors and blocks: finite scale, zero payload
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", QUANTIZER_PARAMS)
def test_all_zero_tensor(q):
    qx = tq.quantize(torch.zeros(64, 64), q, columnwise=True)
    assert _scales_finite(qx)
    assert (qx._data.view(torch.uint8) == 0).all() and (qx._data_t.view(torch.uint8) == 0).all()
    assert (qx.dequantize() == 0).all()


@pytest.mark.parametrize(
    "q",
    [tq.Float8Quantizer(), tq.Float8Quantizer(format=tq.Format.E5M2), tq.IntQuantizer(), tq.IntQuantizer(format=tq.Format.INT4)],
    ids=["e4m3", "e5m2", "int8", "int4"],
)
def test_all_zero_scale_comes_from_amax_epsilon(q):
    # amax 0 is clamped to amax_epsilon (1e-12 in fp32): scale = max / eps, scale_inv = 1 / scale.
    qx = tq.quantize(torch.zeros(4, 32), q)
    expected = 1.0 / torch.div(q.element_format().max_value, torch.tensor(1e-12))
    assert torch.equal(qx._scale_inv, expected)
    assert 0 < qx._scale_inv.item() < 1e-12


def test_zero_blocks_next_to_nonzero_blocks():
    x = torch.zeros(2, 64)
    x[0, :32] = 1.0  # block (0, 0) nonzero, the other three blocks all zero
    mx = tq.quantize(x, tq.MXQuantizer())
    # E8M0 byte 0 is 2^-127, the smallest scale: what an all-zero MX block gets.
    assert mx._scale_inv.view(torch.uint8).tolist() == [[127 - 8, 0], [0, 0]]
    nv = tq.quantize(x, tq.NVFP4Quantizer())
    assert (nv._scale_inv.float()[0, :2] == 448).all() and (nv._scale_inv.float()[0, 2:] == 0).all()
    assert (nv._scale_inv.float()[1] == 0).all()
    fp8 = tq.quantize(x, tq.Float8Quantizer(granularity=G.BLOCKWISE_1D, block_size=32))
    assert torch.equal(fp8._scale_inv[0, 0], torch.tensor(1 / 448))
    assert torch.isfinite(fp8._scale_inv).all() and (fp8._scale_inv > 0).all()
    for qx in (mx, nv, fp8):
        assert torch.equal(qx.dequantize(), x)


# ---------------------------------------------------------------------------------------------
# Invalid quantizer fields
# ---------------------------------------------------------------------------------------------
INVALID_FIELDS = [
    (tq.Float8Quantizer, "format", tq.Format.E2M1, "Format.E4M3, Format.E5M2"),
    (tq.Float8Quantizer, "format", "e4m3", "Format.E4M3, Format.E5M2"),
    (tq.Float8Quantizer, "granularity", "rowwise", "Granularity.TENSORWISE"),
    (tq.Float8Quantizer, "block_size", 0, "an int >= 1"),
    (tq.Float8Quantizer, "block_size", 32.0, "an int >= 1"),
    (tq.Float8Quantizer, "block_size", True, "an int >= 1"),
    (tq.Float8Quantizer, "axis", 1.0, "an int"),
    (tq.Float8Quantizer, "power_of_two_scale", 1, "True or False"),
    (tq.Float8Quantizer, "amax_epsilon", 0.0, "a positive float"),
    (tq.Float8Quantizer, "amax_epsilon", -1e-6, "a positive float"),
    (tq.Float8Quantizer, "amax_epsilon", math.inf, "a positive float"),
    (tq.Float8Quantizer, "amax_epsilon", math.nan, "a positive float"),
    (tq.Float8Quantizer, "amax_epsilon", 1e-40, "finite in fp32"),
    (tq.MXQuantizer, "format", tq.Format.INT8, "Format.E4M3, Format.E5M2, Format.E2M1"),
    (tq.MXQuantizer, "format", tq.Format.E8M0, "Format.E4M3, Format.E5M2, Format.E2M1"),
    (tq.MXQuantizer, "scale_rounding", "floor", "ScaleRounding.FLOOR, ScaleRounding.RCEIL"),
    (tq.NVFP4Quantizer, "block_2d", "yes", "True or False"),
    (tq.NVFP4Quantizer, "stochastic_rounding", 0, "True or False"),
    (tq.NVFP4Quantizer, "hadamard", None, "True or False"),
    (tq.NVFP4Quantizer, "hadamard_seed", -1, "an int >= 0"),
    (tq.NVFP4Quantizer, "amax_epsilon", 0.0, "a positive float"),
    (tq.IntQuantizer, "format", tq.Format.E4M3, "Format.INT8, Format.INT4"),
    (tq.IntQuantizer, "granularity", G.BLOCKWISE_2D, "Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCKWISE_1D"),
    (tq.IntQuantizer, "block_size", -128, "an int >= 1"),
    (tq.IntQuantizer, "amax_epsilon", -math.inf, "a positive float"),
]


@pytest.mark.parametrize(
    "cls, field, value, allowed", INVALID_FIELDS, ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__
)
def test_invalid_quantizer_field(cls, field, value, allowed):
    with pytest.raises(ValueError) as e:
        cls(**{field: value})
    msg = str(e.value)
    assert msg.startswith(f"{cls.__name__}: {field}={value!r} is not allowed")
    assert allowed in msg


def test_unknown_quantizer_field():
    with pytest.raises(TypeError, match="block_size"):
        tq.MXQuantizer(block_size=16)


# ---------------------------------------------------------------------------------------------
# tq.quantize arguments
# ---------------------------------------------------------------------------------------------
def test_quantize_a_quantized_tensor():
    qx = tq.quantize(torch.ones(4, 32), tq.Float8Quantizer())
    with pytest.raises(TypeError) as e:
        tq.quantize(qx, tq.Float8Quantizer())
    msg = str(e.value)
    assert "x is already quantized (QuantizedTensor(shape=(4, 32)" in msg
    assert "dequantize it first" in msg


def test_quantize_a_non_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        tq.quantize([1.0, 2.0], tq.Float8Quantizer())


@pytest.mark.parametrize("bad, name", [("e4m3", "str"), (tq.Format.E4M3, "Format"), (None, "NoneType")])
def test_quantize_with_a_non_quantizer(bad, name):
    with pytest.raises(TypeError) as e:
        tq.quantize(torch.ones(4, 32), bad)
    msg = str(e.value)
    assert f"got {name}" in msg and "quantizer must be a tq.Quantizer" in msg


def test_quantize_with_no_usage():
    with pytest.raises(ValueError, match=re.escape("at least one usage (rowwise=True and/or columnwise=True)")):
        tq.quantize(torch.ones(4, 32), tq.Float8Quantizer(), rowwise=False, columnwise=False)


@pytest.mark.parametrize(
    "seed, got",
    [
        (torch.tensor([1, 2], dtype=torch.int32), "torch.int32 (2,)"),
        (torch.tensor([1.0, 2.0]), "torch.float32 (2,)"),
        (torch.tensor([1, 2, 3]), "torch.int64 (3,)"),
        (torch.tensor([[1, 2]]), "torch.int64 (1, 2)"),
    ],
)
def test_quantize_with_a_bad_seed_tensor(seed, got):
    with pytest.raises(ValueError) as e:
        tq.quantize(torch.ones(4, 32), tq.NVFP4Quantizer(stochastic_rounding=True), seed=seed)
    msg = str(e.value)
    assert "seed must be an int64 tensor of shape (2,)" in msg
    assert f"got {got}" in msg


def test_quantize_with_a_seed_that_is_not_a_tensor():
    with pytest.raises(TypeError) as e:
        tq.quantize(torch.ones(4, 32), tq.NVFP4Quantizer(stochastic_rounding=True), seed=42)
    msg = str(e.value)
    assert "seed must be an int64 tensor of shape (2,)" in msg and "got int 42" in msg


def test_quantize_with_a_bad_amax_group_type():
    with pytest.raises(
        TypeError, match="amax_group must be a torch.distributed.ProcessGroup, its group_name \\(str\\) or None; got int"
    ):
        tq.quantize(torch.ones(4, 32), tq.Float8Quantizer(), amax_group=5)
