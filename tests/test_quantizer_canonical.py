"""Quantizers that give the same result are equal (issue 6, item 11).

Equality is the compile cache key: Dynamo guards on a quantizer's `__eq__`. A field that cannot
change the result (a block size on a tensorwise quantizer, an axis on a blockwise one, a Hadamard
seed with no Hadamard transform) is reset to its default at construction, so such quantizers
compare and hash equal, share one repr, and never recompile. Fields that do change the result keep
them apart.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings

import tqcompile as tq
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, NVFP4Quantizer
from tqcompile.testing.strategies import quantizers

G = Granularity

# (quantizer built with a field that cannot matter, the same quantizer without it)
SAME_RESULT = {
    "fp8-tensorwise-block_size": (Float8Quantizer(block_size=64), Float8Quantizer()),
    "fp8-tensorwise-axis": (Float8Quantizer(axis=0), Float8Quantizer()),
    "fp8-rowwise-block_size": (
        Float8Quantizer(granularity=G.ROWWISE, axis=0, block_size=32),
        Float8Quantizer(granularity=G.ROWWISE, axis=0),
    ),
    "fp8-block1d-axis": (
        Float8Quantizer(granularity=G.BLOCKWISE_1D, axis=0, block_size=32),
        Float8Quantizer(granularity=G.BLOCKWISE_1D, block_size=32),
    ),
    "fp8-block2d-axis": (Float8Quantizer(granularity=G.BLOCKWISE_2D, axis=1), Float8Quantizer(granularity=G.BLOCKWISE_2D)),
    "int8-tensorwise-block_size-axis": (IntQuantizer(block_size=16, axis=1), IntQuantizer()),
    "int4-rowwise-block_size": (IntQuantizer(tq.Format.INT4, G.ROWWISE, block_size=16), IntQuantizer(tq.Format.INT4, G.ROWWISE)),
    "int8-block-axis": (
        IntQuantizer(granularity=G.BLOCKWISE_1D, axis=0, block_size=16),
        IntQuantizer(granularity=G.BLOCKWISE_1D, block_size=16),
    ),
    "nvfp4-hadamard_seed-without-hadamard": (NVFP4Quantizer(hadamard_seed=7), NVFP4Quantizer()),
    "nvfp4-sr-hadamard_seed-without-hadamard": (
        NVFP4Quantizer(stochastic_rounding=True, hadamard_seed=3),
        NVFP4Quantizer(stochastic_rounding=True),
    ),
}

# Pairs that differ only in a field that *does* change the result: they must stay unequal.
DIFFERENT_RESULT = {
    "fp8-rowwise-axis": (Float8Quantizer(granularity=G.ROWWISE, axis=0), Float8Quantizer(granularity=G.ROWWISE)),
    "fp8-block-size": (Float8Quantizer(granularity=G.BLOCKWISE_1D, block_size=32), Float8Quantizer(granularity=G.BLOCKWISE_1D)),
    "int-block-size": (IntQuantizer(granularity=G.BLOCKWISE_1D, block_size=16), IntQuantizer(granularity=G.BLOCKWISE_1D)),
    "nvfp4-hadamard_seed": (NVFP4Quantizer(hadamard=True, hadamard_seed=7), NVFP4Quantizer(hadamard=True)),
}


@pytest.mark.parametrize("name", list(SAME_RESULT))
def test_equal_result_quantizers_are_equal(name):
    a, b = SAME_RESULT[name]
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    source, names = a.__fx_repr__()
    assert eval(source, {"__builtins__": {}}, dict(names)) == b  # noqa: S307
    # Constructing through `dataclasses.replace` normalises as well.
    assert dataclasses.replace(b, **{f.name: getattr(a, f.name) for f in dataclasses.fields(a)}) == b


@pytest.mark.parametrize("name", list(SAME_RESULT))
def test_equal_result_quantizers_give_equal_payloads(name):
    """The premise of the normalisation, checked: the fields reset cannot change the result."""
    a, b = SAME_RESULT[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 128, 128, generator=g)
    seed = torch.tensor([1, 2])
    qa, qb = tq.quantize(x, a, seed=seed), tq.quantize(x, b, seed=seed)
    assert torch.equal(qa._data.view(torch.uint8), qb._data.view(torch.uint8))
    assert torch.equal(qa._scale_inv.float(), qb._scale_inv.float())


@pytest.mark.parametrize("name", list(DIFFERENT_RESULT))
def test_result_changing_fields_stay_apart(name):
    a, b = DIFFERENT_RESULT[name]
    assert a != b


def test_bad_values_of_unused_fields_are_still_errors():
    """Normalising happens after validation: a nonsense value is reported, not silently dropped."""
    with pytest.raises(ValueError, match="block_size=0"):
        Float8Quantizer(block_size=0)
    with pytest.raises(ValueError, match="hadamard_seed=-1"):
        NVFP4Quantizer(hadamard_seed=-1)


@settings(max_examples=100, deadline=None)
@given(quantizers())
def test_construction_is_idempotent(q):
    """Every quantizer is already in canonical form: rebuilding it from its fields gives itself."""
    again = type(q)(**{f.name: getattr(q, f.name) for f in dataclasses.fields(q)})
    assert again == q and repr(again) == repr(q)


