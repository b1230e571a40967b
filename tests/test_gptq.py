"""GPTQ on one weight with tq's numerics (tqcompile.calibration.gptq): the result is a weight the
calibrated model computes with as it is, and never has a larger output error on its calibration
inputs than round to nearest."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqcompile.calibration import fake_quantize
from tqcompile.calibration.gptq import GPTQ, gptq_quantize, hessian
from tqcompile.formats import Format
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, MXQuantizer

QUANTIZERS = {
    "int4_g32": IntQuantizer(Format.INT4, Granularity.BLOCKWISE_1D, block_size=32),
    "int8_channel": IntQuantizer(Format.INT8, Granularity.ROWWISE),
    "int4_channel": IntQuantizer(Format.INT4, Granularity.ROWWISE),
    "int8_tensor": IntQuantizer(Format.INT8),
    "fp8_channel": Float8Quantizer(granularity=Granularity.ROWWISE),
    "fp8_g32": Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, block_size=32),
}


def _correlated(seed: int, n: int = 256, k: int = 64, rank: int = 8) -> torch.Tensor:
    """Inputs whose features are strongly correlated (low-rank plus noise), as activations are."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, rank, generator=g) @ torch.randn(rank, k, generator=g) + 0.1 * torch.randn(n, k, generator=g)


def _err(w, q, x) -> float:
    return float(((x @ (w - q).T) ** 2).sum())


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(sorted(QUANTIZERS)), st.booleans(), st.sampled_from([16, 64]))
def test_gptq_never_worse_than_round_to_nearest(seed, name, act_order, block_size):
    x = _correlated(seed)
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(seed + 1))
    q = QUANTIZERS[name]
    out, amax, how = gptq_quantize(w, hessian(x), q, GPTQ(block_size=block_size, act_order=act_order))
    rtn = fake_quantize(w, q)  # round to nearest with each unit's own max: `max` calibration
    assert _err(w, out, x) <= _err(w, rtn, x) * (1 + 1e-6)
    assert torch.equal(fake_quantize(out, q, amax=amax), out)  # the calibrated model computes with exactly this


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    x, w = _correlated(0), torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    for name, q in QUANTIZERS.items():
        out, _, how = gptq_quantize(w, hessian(x), q)
        rtn = fake_quantize(w, q)
        assert how == "gptq" and _err(w, out, x) < 0.8 * _err(w, rtn, x), name


def test_dead_inputs_and_singular_hessian():
    x = _correlated(3)
    x[:, 5] = 0  # an input that is always zero: its weight is set to zero
    w = torch.randn(16, 64)
    out, _, _ = gptq_quantize(w, hessian(x), QUANTIZERS["int8_channel"])
    assert torch.all(out[:, 5] == 0)
    nan_h = torch.full((64, 64), float("nan"), dtype=torch.float64)
    with pytest.warns(UserWarning, match="stays singular"):
        _, _, how = gptq_quantize(w, nan_h, QUANTIZERS["int8_channel"], name="layer.q_proj")
    assert how == "rtn"


def test_bad_input():
    with pytest.raises(ValueError, match=r"MXQuantizer.*not supported yet"):
        gptq_quantize(torch.randn(4, 64), torch.eye(64), MXQuantizer())
    with pytest.raises(ValueError, match="block_size=0 is not allowed"):
        GPTQ(block_size=0)
    with pytest.raises(ValueError, match="dampening=1 is not allowed"):
        GPTQ(dampening=1)
