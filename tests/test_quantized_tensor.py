"""QuantizedTensor: flatten/unflatten and the aten ops it supports (and refuses)."""

from __future__ import annotations

import pytest
import torch

import tqcompile as tq
from tqcompile import (
    Float8Quantizer,
    Format,
    Granularity,
    IntQuantizer,
    MXQuantizer,
    NVFP4Quantizer,
    QuantizedTensor,
    ScaleRounding,
)
from tqcompile.testing.numerics import assert_payload_equal, bits_of

G = Granularity

# One quantizer per family and layout; each accepts (64, 64) and its transpose.
QUANTIZERS = {
    "fp8-tensor": Float8Quantizer(),
    "fp8-row": Float8Quantizer(granularity=G.ROWWISE),
    "fp8-1x16": Float8Quantizer(granularity=G.BLOCKWISE_1D, block_size=16),
    "fp8-16x16-e5m2-pow2": Float8Quantizer(format=Format.E5M2, granularity=G.BLOCKWISE_2D, block_size=16, power_of_two_scale=True),
    "mxfp8": MXQuantizer(),
    "mxfp4-rceil": MXQuantizer(format=Format.E2M1, scale_rounding=ScaleRounding.RCEIL),
    "nvfp4": NVFP4Quantizer(),
    "nvfp4-2d-hadamard": NVFP4Quantizer(block_2d=True, hadamard=True, hadamard_seed=3),
    "nvfp4-sr": NVFP4Quantizer(stochastic_rounding=True),
    "int8": IntQuantizer(),
    "int8-channel-axis0": IntQuantizer(granularity=G.ROWWISE, axis=0),
    "int4-1x32": IntQuantizer(format=Format.INT4, granularity=G.BLOCKWISE_1D, block_size=32),
}
ALL = pytest.mark.parametrize("q", list(QUANTIZERS.values()), ids=list(QUANTIZERS))
SEED = torch.tensor([11, 0])


def _x(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _qt(q, shape=(64, 64), *, rowwise=True, columnwise=True, dtype=torch.float32):
    return tq.quantize(_x(*shape, dtype=dtype), q, rowwise=rowwise, columnwise=columnwise, seed=SEED)


def _deq_bits(t: torch.Tensor) -> torch.Tensor:
    return bits_of(t.dequantize() if isinstance(t, QuantizedTensor) else t)


def _same_storage(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    return all(
        getattr(a, n).untyped_storage().data_ptr() == getattr(b, n).untyped_storage().data_ptr()
        for n in ("_data", "_scale_inv", "_data_t", "_scale_inv_t")
        if getattr(a, n) is not None
    )


# ---------------------------------------------------------------------------------------------
# Construction, flatten / unflatten
# ---------------------------------------------------------------------------------------------
@ALL
def test_flatten_unflatten_round_trip(q):
    qt = _qt(q)
    names, meta = qt.__tensor_flatten__()
    assert set(names) == {n for n in ("_data", "_scale_inv", "_amax", "_data_t", "_scale_inv_t", "_amax_t") if getattr(qt, n) is not None}
    back = QuantizedTensor.__tensor_unflatten__({n: getattr(qt, n) for n in names}, meta, qt.shape, qt.stride())
    assert type(back) is QuantizedTensor
    assert_payload_equal(back, qt)
    assert (back.quantizer, back.orig_dtype, back.amax_group_name, back.dtype) == (q, torch.float32, None, torch.float32)


def test_flatten_metadata_carries_the_group_name_not_the_group():
    qt = tq.quantize(_x(4, 32, dtype=torch.bfloat16), MXQuantizer(), amax_group="tp")  # MX: the group is only recorded
    names, meta = qt.__tensor_flatten__()
    assert meta == (MXQuantizer(), torch.bfloat16, "tp", None)  # None: rowwise_not_gathered (below)
    back = QuantizedTensor.__tensor_unflatten__({n: getattr(qt, n) for n in names}, meta, qt.shape, qt.stride())
    assert back.amax_group_name == "tp" and back.dtype == torch.bfloat16
    assert "amax_group='tp'" in repr(back)


def test_rowwise_not_gathered_is_metadata_kept_by_views_of_the_rowwise_usage():
    """The FSDP2 gather's record of an unfilled rowwise usage is flatten metadata (Dynamo guards on it),
    kept by the ops that keep that usage (detach, views, slices, copies) and dropped where the result's
    rowwise usage is another one (`t()`) or absent."""
    qt = tq.quantize(_x(64, 32), Float8Quantizer(), rowwise=True, columnwise=True)
    assert qt.rowwise_not_gathered is None
    qt.rowwise_not_gathered = "not gathered"
    names, meta = qt.__tensor_flatten__()
    assert meta[-1] == "not gathered"
    assert QuantizedTensor.__tensor_unflatten__({n: getattr(qt, n) for n in names}, meta, qt.shape, qt.stride()).rowwise_not_gathered == "not gathered"
    for kept in (qt.detach(), qt.view(2, 32, 32), qt[:32], qt.clone(), qt.keep_usages(rowwise=True, columnwise=False)):
        assert kept.rowwise_not_gathered == "not gathered"
    for dropped in (qt.t(), qt.keep_usages(rowwise=False, columnwise=True)):
        assert dropped.rowwise_not_gathered is None


def test_usages_and_accessors():
    q = Float8Quantizer()
    row, col, both = (_qt(q, rowwise=r, columnwise=c) for r, c in ((True, False), (False, True), (True, True)))
    assert (row.has_rowwise, row.has_columnwise) == (True, False)
    assert (col.has_rowwise, col.has_columnwise) == (False, True)
    assert (both.has_rowwise, both.has_columnwise) == (True, True)
    assert row.amax_group is None and row.amax_group_name is None
    # A columnwise-only tensor dequantizes through its transposed payload.
    assert torch.equal(_deq_bits(col), bits_of(both.t().dequantize().t().contiguous()))
    with pytest.raises(ValueError, match="rowwise.*columnwise"):
        QuantizedTensor((2, 2), q, torch.float32)
    with pytest.raises(TypeError, match="unknown inner tensors"):
        QuantizedTensor((2, 2), q, torch.float32, _data=row._data, _bogus=row._data)


# ---------------------------------------------------------------------------------------------
# detach / clone / to / empty_like
# ---------------------------------------------------------------------------------------------
@ALL
def test_detach_aliases_and_clone_copies(q):
    qt = _qt(q)
    d = qt.detach()
    assert type(d) is QuantizedTensor
    assert_payload_equal(d, qt)
    assert _same_storage(d, qt)
    c = qt.clone()
    assert_payload_equal(c, qt)
    assert not _same_storage(c, qt)
    assert_payload_equal(qt.clone(memory_format=torch.contiguous_format), qt)
    with pytest.raises(ValueError, match="clone"):
        _qt(q, (2, 2, 16, 64), columnwise=False).clone(memory_format=torch.channels_last)


@ALL
def test_to_dtype_changes_only_the_nominal_dtype(q):
    qt = _qt(q)
    for dtype in (torch.bfloat16, torch.float16):
        moved = qt.to(dtype)
        assert type(moved) is QuantizedTensor and moved.dtype == dtype and moved.orig_dtype == dtype
        assert_payload_equal(moved, qt, check_dtype=False)
        assert moved.dequantize().dtype == dtype
        assert torch.equal(bits_of(moved.dequantize()), bits_of(qt.dequantize(dtype)))
    with pytest.raises(TypeError, match="floating point"):
        qt.to(torch.int32)


@ALL
def test_to_device_copies(q):
    qt = _qt(q)
    assert qt.to("cpu") is qt  # no-op, as for plain tensors
    moved = qt.to("cpu", copy=True)
    assert_payload_equal(moved, qt)
    assert not _same_storage(moved, qt)


@ALL
def test_empty_like(q):
    qt = _qt(q)
    e = torch.empty_like(qt)
    assert type(e) is QuantizedTensor and e.shape == qt.shape and e.quantizer == q and e.dtype == qt.dtype
    for name in ("_data", "_scale_inv", "_amax", "_data_t", "_scale_inv_t", "_amax_t"):
        a, b = getattr(e, name), getattr(qt, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert (a.shape, a.dtype) == (b.shape, b.dtype), name


# ---------------------------------------------------------------------------------------------
# t / transpose
# ---------------------------------------------------------------------------------------------
@ALL
def test_t_swaps_usages(q):
    x = _x(64, 64)
    qt = tq.quantize(x, q, columnwise=True, seed=SEED)
    tt = qt.t()
    assert tt.shape == (64, 64) and type(tt) is QuantizedTensor
    for a, b in (("_data", "_data_t"), ("_scale_inv", "_scale_inv_t"), ("_amax", "_amax_t")):
        assert getattr(tt, a) is getattr(qt, b) or torch.equal(bits_of(getattr(tt, a)), bits_of(getattr(qt, b)))
    assert_payload_equal(tt.t(), qt)
    assert_payload_equal(qt.transpose(0, 1), tt)
    assert_payload_equal(qt.transpose(-1, 0), tt)
    assert torch.equal(_deq_bits(tt), _deq_bits(tq.quantize(x.t(), q, seed=SEED)))


def test_t_of_non_square_and_rowwise_only():
    q = Float8Quantizer(granularity=G.BLOCKWISE_1D, block_size=16)
    x = _x(32, 48)
    qt = tq.quantize(x, q)  # rowwise only: its transpose is columnwise only
    tt = qt.t()
    assert tt.shape == (48, 32) and not tt.has_rowwise and tt.has_columnwise
    assert torch.equal(_deq_bits(tt), bits_of(qt.dequantize().t().contiguous()))


def test_t_needs_2d():
    qt = _qt(Float8Quantizer(), (2, 8, 16), columnwise=False)
    with pytest.raises(NotImplementedError, match="2-D"):
        qt.t()
    with pytest.raises(NotImplementedError, match="2-D"):
        qt.transpose(0, 2)


# ---------------------------------------------------------------------------------------------
# view / reshape
# ---------------------------------------------------------------------------------------------
_VIEWABLE = {k: v for k, v in QUANTIZERS.items() if k != "int8-channel-axis0"}


@pytest.mark.parametrize("q", list(_VIEWABLE.values()), ids=list(_VIEWABLE))
@pytest.mark.parametrize("op", ["view", "reshape"])
def test_view_keeping_the_last_dim(q, op):
    qt = _qt(q, (4, 16, 64))
    flat = getattr(qt, op)(64, 64)
    assert type(flat) is QuantizedTensor and flat.shape == (64, 64)
    assert torch.equal(_deq_bits(flat), bits_of(qt.dequantize().reshape(64, 64)))
    assert _same_storage(flat, qt)
    back = getattr(flat, op)(-1, 16, 64)
    assert_payload_equal(back, qt)
    # The columnwise usage is already that of the (-1, K) flattening; a view keeps it.
    assert torch.equal(bits_of(flat._data_t), bits_of(qt._data_t))


@ALL
def test_view_changing_the_last_dim_is_refused(q):
    qt = _qt(q, (4, 16, 64))
    with pytest.raises(NotImplementedError, match="last dim"):
        qt.view(4, 1024)
    with pytest.raises(NotImplementedError, match="last dim"):
        qt.reshape(-1)


def test_view_of_rowwise_along_another_axis_is_refused():
    qt = _qt(IntQuantizer(granularity=G.ROWWISE, axis=0), (4, 16, 64), columnwise=False)
    with pytest.raises(NotImplementedError, match="axis 0"):
        qt.view(64, 64)


def test_view_breaking_a_2d_block_is_refused():
    qt = _qt(Float8Quantizer(granularity=G.BLOCKWISE_2D, block_size=16), (4, 16, 64), columnwise=False)
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        qt.view(8, 8, 64)


# ---------------------------------------------------------------------------------------------
# slice / split along dim 0
# ---------------------------------------------------------------------------------------------
def _cuts_columnwise_unit(q) -> bool:
    # The columnwise payload is (K, R): slicing rows of x slices its dim 1, which a ROWWISE scale
    # along the last axis (one scale over all of R) cannot follow.
    gran, axis, _ = q.layout()
    return gran is G.ROWWISE and axis % 2 == 1


@ALL
def test_columnwise_scale_layout(q):
    """A columnwise usage keeps `columnwise_scale_shape` (flat for 1-D blocks, so a dynamic token
    count never recompiles at one block: compile_tests/test_token_count_recompiles.py) through
    quantize, slicing dim 0 and t(), which gives the rowwise usage its 2-D scales back."""
    assert q.flat_columnwise_scale() == (q.layout()[0] is G.BLOCKWISE_1D)
    qt = _qt(q, (96, 64))  # not square: a wrong layout shows
    k, rows = qt.shape[1], qt.shape[0]
    assert tuple(qt._scale_inv_t.shape) == tuple(q.columnwise_scale_shape((k, rows)))
    tt = qt.t()
    assert tuple(tt._scale_inv.shape) == tuple(q.scale_shape((k, rows)))
    assert tuple(tt._scale_inv_t.shape) == tuple(q.columnwise_scale_shape((rows, k)))
    col = qt.keep_usages(rowwise=False, columnwise=True)  # what tt's rowwise usage holds
    assert torch.equal(_deq_bits(tt), bits_of(col.dequantize().t().contiguous()))
    assert_payload_equal(tt.t(), qt)
    if not _cuts_columnwise_unit(q) and q.layout()[0] is not G.ROWWISE:
        s = qt[32:]
        assert tuple(s._scale_inv_t.shape) == tuple(q.columnwise_scale_shape((k, rows - 32)))
        assert torch.equal(_deq_bits(col[32:]), bits_of(col.dequantize()[32:].contiguous()))


@ALL
@pytest.mark.parametrize("bounds", [(0, 32), (32, 64), (16, 48)], ids=["head", "tail", "middle"])
def test_slice_dim0(q, bounds):
    a, b = bounds
    qt = _qt(q, columnwise=False)
    gran, axis, block = q.layout()
    unit_rows = {G.BLOCKWISE_2D: block, G.ROWWISE: 64 if axis % 2 == 0 else 1}.get(gran, 1)
    if a % unit_rows:
        with pytest.raises(NotImplementedError, match="cuts through scaling units"):
            qt[a:b]
        return
    if unit_rows == 64:
        with pytest.raises(NotImplementedError, match="cuts through scaling units"):
            qt[a:b]
        return
    s = qt[a:b]
    assert type(s) is QuantizedTensor and s.shape == (b - a, 64)
    assert torch.equal(_deq_bits(s), bits_of(qt.dequantize()[a:b].contiguous()))
    assert _same_storage(s, qt)
    col = _qt(q, rowwise=False)
    if _cuts_columnwise_unit(q) or (gran in (G.BLOCKWISE_1D, G.BLOCKWISE_2D) and (a % block or b % block)):
        with pytest.raises(NotImplementedError, match="cuts through scaling units"):
            col[a:b]
    else:
        assert torch.equal(_deq_bits(col[a:b]), bits_of(col.dequantize()[a:b].contiguous()))


def test_slice_cutting_a_2d_block_raises():
    qt = _qt(NVFP4Quantizer(block_2d=True), columnwise=False)
    with pytest.raises(NotImplementedError, match="units of 16 elements"):
        qt[0:8]


@pytest.mark.parametrize("q", [MXQuantizer(), IntQuantizer(format=Format.INT4)], ids=["mx-32-block", "int4-packed-byte"])
def test_slice_of_1d_tensor_inside_a_unit_raises(q):
    qt = tq.quantize(_x(64), q)
    with pytest.raises(NotImplementedError, match="cuts through scaling units|splits a byte"):
        qt[0:3]


def test_slice_other_dims_or_steps_is_refused():
    qt = _qt(Float8Quantizer(), columnwise=False)
    with pytest.raises(NotImplementedError, match="slicing dim 0"):
        qt[:, 0:32]
    with pytest.raises(NotImplementedError, match="step 1"):
        qt[0:32:2]


@ALL
def test_split_dim0(q):
    if q.layout()[:2] == (G.ROWWISE, 0):
        pytest.skip("one scale spans all rows: covered by test_slice_dim0's error cases")
    qt = _qt(q, columnwise=False)
    ref = qt.dequantize()
    for parts, sizes in ((qt.split(32), (32, 32)), (qt.split([16, 48]), (16, 48)), (torch.split(qt, 16), (16,) * 4)):
        assert [p.shape[0] for p in parts] == list(sizes)
        start = 0
        for p, n in zip(parts, sizes):
            assert type(p) is QuantizedTensor
            assert torch.equal(_deq_bits(p), bits_of(ref[start : start + n].contiguous()))
            start += n


# ---------------------------------------------------------------------------------------------
# copy_
# ---------------------------------------------------------------------------------------------
@ALL
def test_copy_from_quantized_tensor(q):
    src = _qt(q)
    dst = torch.empty_like(src)
    out = dst.copy_(src)
    assert out is dst
    assert_payload_equal(dst, src)
    assert not _same_storage(dst, src)


@ALL
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_copy_from_plain_tensor_requantizes(q, src_dtype):
    dst = _qt(q)
    x2 = _x(64, 64, dtype=src_dtype, seed=1)
    dst.copy_(x2)
    if q.needs_seed():  # a fresh seed is drawn: only the scales are determined
        expected = tq.quantize(x2.to(dst.orig_dtype), q, columnwise=True, seed=SEED)
        assert torch.equal(bits_of(dst._scale_inv), bits_of(expected._scale_inv))
        return
    assert_payload_equal(dst, tq.quantize(x2.to(dst.orig_dtype), q, columnwise=True))


def test_copy_errors():
    q = Float8Quantizer()
    dst = _qt(q)
    with pytest.raises(ValueError, match="quantizer and usages must be equal"):
        dst.copy_(_qt(Float8Quantizer(format=Format.E5M2)))
    with pytest.raises(ValueError, match="quantizer and usages must be equal"):
        dst.copy_(_qt(q, columnwise=False))
    with pytest.raises(ValueError, match="shape mismatch"):
        dst.copy_(_qt(q, (32, 64)))
    with pytest.raises(NotImplementedError, match="dequantize"):
        torch.empty(64, 64).copy_(dst)


# ---------------------------------------------------------------------------------------------
# Everything else is refused, naming the op
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda t: t + 1, "aten.add.Tensor"),
        (lambda t: t * 2.0, "aten.mul.Tensor"),
        (lambda t: torch.mm(t, torch.ones(64, 8)), "aten.mm.default"),
        (lambda t: t @ torch.ones(64, 8), "aten.mm.default"),
        (lambda t: t.sum(), "aten.sum.default"),
        (lambda t: torch.cat([t, t]), "aten.cat.default"),
        (lambda t: t.abs(), "aten.abs.default"),
        (lambda t: torch.nn.functional.relu(t), "aten.relu.default"),
    ],
    ids=["add", "mul", "mm", "matmul", "sum", "cat", "abs", "relu"],
)
def test_unsupported_ops_name_the_op(fn, op):
    qt = _qt(MXQuantizer(), columnwise=False)
    with pytest.raises(NotImplementedError, match=op.replace(".", r"\.")) as info:
        fn(qt)
    assert ".dequantize()" in str(info.value)
