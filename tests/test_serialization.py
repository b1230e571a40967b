"""Saving and restoring: QuantizedTensors and quantizers through `torch.save` /
`torch.load(weights_only=True)`, quantizers through pickle and `__fx_repr__`, and the value-object
rules (frozen, equal-by-value, `dataclasses.replace` for changes)."""

from __future__ import annotations

import dataclasses
import io
import pickle
import types

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

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
from tqcompile.testing.strategies import float8_quantizers, int_quantizers, mx_quantizers, nvfp4_quantizers, quantizers

G = Granularity

QUANTIZERS = {
    "fp8-tensor": Float8Quantizer(),
    "fp8-row-e5m2": Float8Quantizer(format=Format.E5M2, granularity=G.ROWWISE, axis=0),
    "fp8-1x16-pow2": Float8Quantizer(granularity=G.BLOCKWISE_1D, block_size=16, power_of_two_scale=True),
    "fp8-16x16": Float8Quantizer(granularity=G.BLOCKWISE_2D, block_size=16, amax_epsilon=1e-6),
    "mxfp8": MXQuantizer(),
    "mxfp4-rceil": MXQuantizer(format=Format.E2M1, scale_rounding=ScaleRounding.RCEIL),
    "nvfp4-2d": NVFP4Quantizer(block_2d=True),
    "nvfp4-sr-hadamard": NVFP4Quantizer(stochastic_rounding=True, hadamard=True, hadamard_seed=9),
    "int8-channel": IntQuantizer(granularity=G.ROWWISE),
    "int4-1x32": IntQuantizer(format=Format.INT4, granularity=G.BLOCKWISE_1D, block_size=32),
}


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _quantized(q, *, dtype=torch.bfloat16, columnwise=True, seed=0):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return tq.quantize(x, q, columnwise=columnwise, seed=torch.tensor([seed, 0]))


# ---------------------------------------------------------------------------------------------
# torch.save / torch.load(weights_only=True)
# ---------------------------------------------------------------------------------------------
def test_state_dict_of_every_family_loads_with_weights_only():
    state = {f"{name}.weight": _quantized(q, seed=i) for i, (name, q) in enumerate(QUANTIZERS.items())}
    state.update({f"{name}.quantizer": q for name, q in QUANTIZERS.items()})
    state["rowwise_only_fp32"] = _quantized(Float8Quantizer(), dtype=torch.float32, columnwise=False)
    state["columnwise_only"] = tq.quantize(torch.randn(32, 64), NVFP4Quantizer(), rowwise=False, columnwise=True)
    state["with_group"] = tq.quantize(torch.randn(4, 64), MXQuantizer(), amax_group="tp_group_0")  # MX only records it
    state["plain"] = torch.arange(4.0)
    loaded = _round_trip(state)
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        got = loaded[key]
        assert type(got) is type(value), key
        if isinstance(value, QuantizedTensor):
            assert_payload_equal(got, value)
            assert (got.dtype, got.amax_group_name) == (value.dtype, value.amax_group_name), key
            assert torch.equal(bits_of(got.dequantize()), bits_of(value.dequantize())), key
        elif isinstance(value, tq.Quantizer):
            assert got == value and hash(got) == hash(value), key
        else:
            assert torch.equal(got, value)


class _Holder(torch.nn.Module):
    def __init__(self, weight: QuantizedTensor):
        super().__init__()
        self.register_buffer("weight", weight)


@pytest.mark.parametrize("q", list(QUANTIZERS.values()), ids=list(QUANTIZERS))
def test_module_state_dict_round_trip_into_a_fresh_module(q):
    src = _Holder(_quantized(q, seed=1))
    dst = _Holder(torch.empty_like(src.weight))
    dst.load_state_dict(_round_trip(src.state_dict()))  # copy_ from a QuantizedTensor
    assert_payload_equal(dst.weight, src.weight)


class _Unlisted:
    """Not among tqcompile's safe globals."""


def test_weights_only_load_refuses_unregistered_classes():
    buf = io.BytesIO()
    torch.save({"x": _Unlisted()}, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------------------------
# Quantizers as values
# ---------------------------------------------------------------------------------------------
@settings(max_examples=150)
@given(quantizers())
def test_quantizer_pickle_and_weights_only_round_trip(q):
    for back in (pickle.loads(pickle.dumps(q)), _round_trip(q)):
        assert back == q and hash(back) == hash(q) and type(back) is type(q)
        assert repr(back) == repr(q)


@settings(max_examples=150)
@given(quantizers())
def test_fx_repr_evaluates_back_and_names_only_classes(q):
    source, names = q.__fx_repr__()
    assert source == repr(q)
    for name, obj in names.items():
        assert isinstance(obj, type) and not isinstance(obj, types.ModuleType), (name, obj)
        assert obj.__name__ == name
    # Only the names it declares: no builtins, no modules.
    assert eval(source, {"__builtins__": {}}, dict(names)) == q  # noqa: S307


@settings(max_examples=100)
@given(quantizers())
def test_quantizers_are_frozen(q):
    field = dataclasses.fields(q)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(q, field.name, getattr(q, field.name))
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):
        q.brand_new_attribute = 1


_SAME_FAMILY = st.one_of(
    st.tuples(float8_quantizers(), float8_quantizers()),
    st.tuples(mx_quantizers(), mx_quantizers()),
    st.tuples(nvfp4_quantizers(), nvfp4_quantizers()),
    st.tuples(int_quantizers(), int_quantizers()),
)


@settings(max_examples=150)
@given(_SAME_FAMILY)
def test_replace_makes_a_new_quantizer(pair):
    q, other = pair
    assert dataclasses.replace(q) == q
    assume(other != q)
    changes = {f.name: getattr(other, f.name) for f in dataclasses.fields(q) if getattr(other, f.name) != getattr(q, f.name)}
    before = repr(q)
    new = dataclasses.replace(q, **changes)
    assert new == other and hash(new) == hash(other)
    assert new != q and repr(q) == before  # the original is untouched


def test_equal_quantizers_hash_equal_and_work_as_dict_keys():
    a = NVFP4Quantizer(block_2d=True, hadamard=True, hadamard_seed=4)
    b = NVFP4Quantizer(hadamard_seed=4, hadamard=True, block_2d=True)
    assert a == b and hash(a) == hash(b) and a is not b
    assert {a: 1}[b] == 1
    assert a != NVFP4Quantizer(block_2d=True, hadamard=True, hadamard_seed=5)
    # Same field values, different families: never equal.
    assert Float8Quantizer(format=Format.E4M3) != MXQuantizer(format=Format.E4M3)


def test_replace_validates_like_the_constructor():
    with pytest.raises(ValueError, match="format=<Format.INT8"):
        dataclasses.replace(Float8Quantizer(), format=Format.INT8)
    with pytest.raises(ValueError, match="amax_epsilon"):
        dataclasses.replace(NVFP4Quantizer(), amax_epsilon=0.0)
