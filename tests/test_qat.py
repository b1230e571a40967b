"""QAT: straight-through estimators (by hand and by hypothesis), training (compiled QAT steps:
compile_tests/test_qat_compile.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tqcompile as tq
import tqcompile.testing.strategies  # noqa: F401  (tq.testing.strategies, for the hypothesis strategies)
from tqcompile import ops
from tqcompile.calibration import fake_quantize
from tqcompile.calibration.fake_quant import static_amax_kind
from tqcompile.kernels.reference import unit_amax
from tqcompile.testing import assert_bitwise_equal


def _grad(x, q, amax, ste, upstream=None):
    x = x.clone().requires_grad_(True)
    y = fake_quantize(x, q, amax, ste=ste)
    y.backward(torch.ones_like(x) if upstream is None else upstream)
    return y.detach(), x.grad


def test_ste_by_hand_tensorwise():
    x = torch.tensor([-3.0, -2.0, -1.5, 0.0, 0.7, 2.0, 2.5, float("inf"), float("nan")])
    amax = torch.tensor(2.0)
    _, g_plain = _grad(x, tq.IntQuantizer(), amax, "plain")
    _, g_clip = _grad(x, tq.IntQuantizer(), amax, "clipped")
    assert g_plain.tolist() == [1.0] * 9
    # Zero beyond ±amax (where INT8 saturates), and for non-finite inputs; the boundary passes.
    assert g_clip.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_ste_by_hand_per_channel_and_per_block():
    x = torch.tensor([[0.5, -1.5, 2.0, 4.0], [0.5, -1.5, 2.0, 4.0]])
    rowwise = tq.IntQuantizer(granularity=tq.Granularity.ROWWISE)
    _, g = _grad(x, rowwise, torch.tensor([[1.0], [3.0]]), "clipped", upstream=torch.full_like(x, 0.5))
    assert g.tolist() == [[0.5, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.0]]
    blocks = tq.Float8Quantizer(granularity=tq.Granularity.BLOCKWISE_1D, block_size=2)
    _, g = _grad(x, blocks, torch.tensor([[1.0, 4.0], [2.0, 1.0]]), "clipped")
    assert g.tolist() == [[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]


def test_ste_without_a_static_range_passes_the_gradient():
    x = torch.randn(4, 64) * 10
    for q, amax in ((tq.MXQuantizer(), None), (tq.IntQuantizer(), None), (tq.NVFP4Quantizer(hadamard=True), torch.tensor(1.0))):
        y, g = _grad(x, q, amax, "clipped")
        assert torch.equal(g, torch.ones_like(x)), q
        assert_bitwise_equal(y, tq.quantize(x, q, amax=amax).dequantize())
    with pytest.raises(ValueError, match="ste='straight' is not allowed"):
        fake_quantize(x, tq.IntQuantizer(), ste="straight")


_STATIC = [
    tq.IntQuantizer(),
    tq.IntQuantizer(tq.Format.INT4),
    tq.Float8Quantizer(),
    tq.Float8Quantizer(tq.Format.E5M2),
    tq.NVFP4Quantizer(),
]


@settings(max_examples=60)
@given(
    q=st.sampled_from(_STATIC),
    values=st.lists(st.floats(-100, 100, width=32), min_size=16, max_size=16),
    amax=st.floats(0.015625, 100, width=32),
    upstream=st.floats(-4, 4, width=32),
    ste=st.sampled_from(["clipped", "plain"]),
)
def test_ste_properties(q, values, amax, upstream, ste):
    x = torch.tensor(values).reshape(1, 16)
    a = torch.tensor(amax)
    y, g = _grad(x, q, a, ste, upstream=torch.full_like(x, upstream))
    assert_bitwise_equal(y, tq.quantize(x, q, amax=a).dequantize())  # forward: the library's quantize
    expected = torch.full_like(x, upstream)
    if ste == "clipped":
        expected = torch.where(x.abs() <= a, expected, torch.zeros_like(expected))
    assert torch.equal(g, expected)


@settings(max_examples=80)
@given(case=tq.testing.strategies.quantizer_inputs(tq.testing.strategies.quantizers(stochastic_rounding=False), max_numel=512))
def test_fake_quant_with_the_data_amax_is_quantize_dequantize_bit_for_bit(case):
    # Every quantizer family, shapes, dtypes and special values (0, subnormals, huge, +-inf, NaN):
    # fake quantization with the amax calibration would take from x is tq.quantize(x).dequantize().
    q, x = case
    kind = static_amax_kind(q, "weight")
    amax = None if kind is None else (ops.amax(x, q) if kind == "tensor" else unit_amax(x, q))
    y = fake_quantize(x, q, amax)
    assert_bitwise_equal(y, tq.quantize(x, q).dequantize())


def test_qat_trains_through_fake_quantization():
    # A calibrated W8A8 student learns a teacher's function: the loss falls by more than half in
    # 40 SGD steps, so gradients flow through every fake quantizer (the clipped STE).
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    student = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(128, 32)
    target = teacher(x).detach()
    tq.calibrate(student, tq.configs.int8(), lambda m: m(x), progress=False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = F.mse_loss(student(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
