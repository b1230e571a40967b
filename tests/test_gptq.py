"""GPTQ on one weight with tq's numerics (tqcompile.calibration.gptq): the result is a weight the
calibrated model computes with as it is, and never has a larger output error on its calibration
inputs than round to nearest."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tqcompile as tq
from tqcompile.calibration import fake_quantize
from tqcompile.calibration.fake_quant import round_to_nearest, static_weight_amax
from tqcompile.calibration.gptq import GPTQ, _gptq, _requantize_moved_blocks, gptq_quantize, hessian
from tqcompile.formats import E2M1_VALUES, Format
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, MXQuantizer, NVFP4Quantizer, ScaleRounding

QUANTIZERS = {
    "int4_g32": IntQuantizer(Format.INT4, Granularity.BLOCKWISE_1D, block_size=32),
    "int8_channel": IntQuantizer(Format.INT8, Granularity.ROWWISE),
    "int4_channel": IntQuantizer(Format.INT4, Granularity.ROWWISE),
    "int8_tensor": IntQuantizer(Format.INT8),
    "fp8_channel": Float8Quantizer(granularity=Granularity.ROWWISE),
    "fp8_g32": Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, block_size=32),
    "mxfp8": MXQuantizer(),
    "mxfp8_rceil": MXQuantizer(scale_rounding=ScaleRounding.RCEIL),
    "mxfp4": MXQuantizer(Format.E2M1),
    "nvfp4": NVFP4Quantizer(),
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
    r = _gptq(w, hessian(x), q, GPTQ(block_size=block_size, act_order=act_order), "w")
    rtn = fake_quantize(w, q)  # round to nearest with each unit's own max: `max` calibration
    assert _err(w, r.q, x) <= _err(w, rtn, x) * (1 + 1e-6)
    assert torch.equal(fake_quantize(r.q, q, amax=r.amax), r.q)  # the calibrated model computes with exactly this
    if isinstance(q, MXQuantizer):
        assert r.amax is None  # every MX scale comes from Q's own blocks
    if isinstance(q, NVFP4Quantizer):
        assert torch.equal(r.amax, w.abs().amax())  # the tensor scale s_enc stays the starting weight's
        assert r.requantized_blocks == 0  # every block got its ±6 while being rounded


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    x, w = _correlated(0), torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    for name, q in QUANTIZERS.items():
        out, _, how = gptq_quantize(w, hessian(x), q)
        rtn = fake_quantize(w, q)
        assert how == "gptq" and _err(w, out, x) < 0.8 * _err(w, rtn, x), name


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_bfloat16_weight_reproduces_itself(name):
    """A bf16 model stores Q in bf16, where NVFP4's products ``code * (s_blk / s_enc)`` round once
    more; they still requantize to themselves (a relative change of 2**-9 moves no scale or code)."""
    x, w = _correlated(5), torch.randn(32, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    q = QUANTIZERS[name]
    out, amax, how = gptq_quantize(w, hessian(x), q)
    assert how == "gptq" and out.dtype == torch.bfloat16
    assert torch.equal(fake_quantize(out, q, amax=amax), out)


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


def test_all_zero_inputs_fall_back_to_round_to_nearest():
    """Calibration inputs that are all zero (a zero Hessian: no information about the weight) made
    GPTQ set the whole weight and its amax to 0, labelled "gptq", without a word. Now the weight is
    rounded to nearest, with a warning, like a singular Hessian."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    for name, q in QUANTIZERS.items():
        with pytest.warns(UserWarning, match=r"'layer.fc'.*all zero.*rounded to nearest"):
            out, amax, how = gptq_quantize(w, hessian(torch.zeros(8, 64)), q, name="layer.fc")
        assert how == "rtn", name
        assert torch.equal(out, round_to_nearest(w, q)), name
        assert amax is None or torch.equal(amax, static_weight_amax(w, q)), name


def test_calibrate_labels_a_layer_with_all_zero_inputs_rtn():
    """Through tq.calibrate: the layer after a ReLU that is never positive keeps its weight rounded
    to nearest (not zero) and `tq.summary` says "rtn"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every ReLU output is 0: the last layer's inputs carry nothing
    w = model[2].weight.detach().clone()
    x = torch.randn(64, 32)
    with pytest.warns(UserWarning, match=r"'2'.*all zero.*rounded to nearest"):
        tq.calibrate(model, tq.configs.int8(), lambda m: m(x), algorithm="gptq", progress=False)
    q = model[2].weight_quantizer.quantizer
    assert torch.equal(model[2].weight, round_to_nearest(w, q))
    assert torch.equal(model[2].weight_quantizer.amax, static_weight_amax(w, q))
    assert {r.name: r.method for r in tq.summary(model).rows}["2"] == "rtn"


def _grid(fmt: Format) -> torch.Tensor:
    """The finite non-negative values of an element format."""
    if fmt is Format.E2M1:
        return torch.tensor(E2M1_VALUES)
    vals = torch.arange(128, dtype=torch.uint8).view(fmt.torch_dtype).float()
    return vals[torch.isfinite(vals)]


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2, Format.E2M1])
@pytest.mark.parametrize("rounding", list(ScaleRounding))
def test_mx_block_whose_max_shrank_stays_on_grid(fmt, rounding):
    """GPTQ rounds an MX block with the exponent e of its starting max; if its updates leave a
    smaller max, tq requantizes with an exponent e' <= e, and each code times 2**(e - e') is again
    a code, except past the element max: only E4M3 under FLOOR (block max in [256, 512), E4M3 stops
    at 448), for a largest code of mantissa 1.875 (240, 120, ...)."""
    q = MXQuantizer(fmt, scale_rounding=rounding)
    grid, e = _grid(fmt), 2.0**-3  # the exponent GPTQ chose for the block
    g = torch.Generator().manual_seed(0)
    for top in grid[grid > 0]:
        below = grid[grid <= top]
        codes = below[torch.randint(len(below), (31,), generator=g)]
        signs = torch.where(torch.rand(32, generator=g) < 0.5, -1.0, 1.0)
        block = (torch.cat((top.reshape(1), codes)) * signs * e).reshape(1, 32)
        mantissa = float(top) / 2.0 ** torch.floor(torch.log2(top))
        overflows = fmt is Format.E4M3 and rounding is ScaleRounding.FLOOR and mantissa == 1.875
        assert torch.equal(fake_quantize(block, q), block) != overflows, float(top)


def test_blocks_that_do_not_reproduce_are_requantized():
    q = MXQuantizer()  # E4M3, FLOOR: a block whose largest code is 240 moves (see the test above)
    block = torch.cat((torch.tensor([240.0, -104.0]), torch.zeros(30))).reshape(1, 32) * 2.0**-4
    kept = torch.linspace(-1, 1, 32).reshape(1, 32)
    kept = fake_quantize(kept, q)
    out, moved = _requantize_moved_blocks(torch.cat((block, kept), 1), q, None)
    assert moved == 1
    assert torch.equal(out[:, 32:], kept) and out[0, 0] == 224 * 2.0**-4 and torch.equal(out[:, 1:32], block[:, 1:])
    assert torch.equal(fake_quantize(out, q), out)


@pytest.mark.parametrize(
    "q, bad",
    [
        (NVFP4Quantizer(hadamard=True), "hadamard=True"),
        (NVFP4Quantizer(block_2d=True), "block_2d=True"),
        (NVFP4Quantizer(stochastic_rounding=True), "stochastic_rounding=True"),
        (Float8Quantizer(Format.E5M2, granularity=Granularity.ROWWISE), "E5M2"),
    ],
)
def test_unsupported_quantizers_are_refused(q, bad):
    with pytest.raises(ValueError, match=rf"{type(q).__name__}\(.*{bad}.*allowed: "):
        gptq_quantize(torch.randn(16, 64), torch.eye(64), q)


def test_bad_input():
    with pytest.raises(ValueError, match="block_size=0 is not allowed"):
        GPTQ(block_size=0)
    with pytest.raises(ValueError, match="dampening=1 is not allowed"):
        GPTQ(dampening=1)


@pytest.mark.parametrize(
    "grid, granularity",
    [(grid, gran) for grid in tq.IntGrid for gran in ("rows", "g32", "tensor") if not (grid is tq.IntGrid.ASYMMETRIC and gran == "tensor")],
)
def test_int_column_rounding_is_the_reference_kernels(grid, granularity):
    """GPTQ rounds Int columns with scales held per unit (`IntQuantizer.reference_round`): bit for
    bit what the reference quantize and dequantize kernels give, column by column (the path FP8 takes)."""
    from tqcompile.calibration import gptq as gptq_module

    layout = {"rows": dict(granularity=Granularity.ROWWISE), "g32": dict(granularity=Granularity.BLOCKWISE_1D, block_size=32), "tensor": {}}
    q = tq.IntQuantizer(tq.Format.INT4, grid=grid, **layout[granularity])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 128, generator=g) * torch.linspace(0.2, 3, 128)
    w = torch.randn(32, 128, generator=g) * 0.05
    h = gptq_module.hessian(x)
    for act_order in (True, False):
        fast = gptq_module.gptq_quantize(w, h, q, tq.GPTQ(act_order=act_order))
        original = gptq_module._column_rounder
        gptq_module._column_rounder = gptq_module._RoundRows
        try:
            slow = gptq_module.gptq_quantize(w, h, q, tq.GPTQ(act_order=act_order))
        finally:
            gptq_module._column_rounder = original
        assert torch.equal(fast[0].view(torch.int32), slow[0].view(torch.int32)) and torch.equal(fast[1], slow[1]) and fast[2] == slow[2]


def test_comparison_with_round_to_nearest_costs_no_hessian_sized_product():
    """GPTQ's own output error is the sum of its steps' squared errors (W - Q = E U with U the
    factor of the dampened inverse Hessian, so tr((W - Q) H (W - Q)^T) = |E|^2), and round to
    nearest's is one triangular solve with U. Before, both came from (out, in) x (in, in) float64
    products: 4 out in^2 flops, the largest single cost at Llama-3-8B's down_proj (issue 28 item 4).
    What remains of matrix products is the lazy block updates, out * in * (in - block_size)."""
    from torch.utils.flop_counter import FlopCounterMode

    out_f, in_f = 32, 512
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1024, in_f, generator=g) * torch.linspace(0.2, 3, in_f)
    w, h = torch.randn(out_f, in_f, generator=g) * 0.05, hessian(x)
    with FlopCounterMode(display=False) as flops:
        r = _gptq(w, h, QUANTIZERS["int4_g32"], GPTQ(), "w")
    assert r.how == "gptq"
    assert flops.get_total_flops() <= out_f * in_f * (in_f - 128), flops.get_flop_counts()


def test_a_worse_gptq_result_is_replaced_by_round_to_nearest(monkeypatch):
    """The comparison keeps round to nearest where GPTQ's result has the larger output error: here
    a column rounding that gives zeros (GPTQ's own error, from its steps, counts what it rounds)."""
    from tqcompile.calibration import gptq as gptq_module

    x, w = _correlated(7), torch.randn(48, 64, generator=torch.Generator().manual_seed(8))
    q = QUANTIZERS["int8_channel"]
    kept = gptq_quantize(w, hessian(x), q)
    assert kept[2] == "gptq" and _err(w, kept[0], x) < _err(w, fake_quantize(w, q), x)

    class Zeros(gptq_module._IntColumns):
        def __call__(self, col, amax, unit):
            return super().__call__(col * 0, amax, unit)

    monkeypatch.setattr(gptq_module, "_column_rounder", Zeros)
    out, amax, how = gptq_quantize(w, hessian(x), q)
    assert how == "rtn" and torch.equal(out, round_to_nearest(w, q)) and torch.equal(amax, static_weight_amax(w, q))


def test_a_hessian_float32_cannot_factor_is_factored_in_float64():
    """GPTQ factors the Hessian in float32 (the same codes as float64 on the llmcompressor fixture,
    half the time and memory); where float32's Cholesky fails at the requested dampening, float64
    factors it, rather than the dampening being raised or the weight rounded to nearest."""
    g = torch.Generator().manual_seed(9)
    basis = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))[0]
    h = basis @ torch.diag(torch.logspace(0, -11, 64, dtype=torch.float64)) @ basis.T  # SPD, condition 1e11
    assert int(torch.linalg.cholesky_ex(h.float())[1]) != 0 and int(torch.linalg.cholesky_ex(h)[1]) == 0
    w = torch.randn(16, 64, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = _gptq(w, h, QUANTIZERS["int8_channel"], GPTQ(dampening=1e-12), "w")
    assert r.how == "gptq"
