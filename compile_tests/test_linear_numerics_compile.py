"""`tq.nn.Linear` compiled (aot_eager, fullgraph=True) equals eager bit for bit for every recipe,
and keeps the delayed-scaling histories as eager does: the compiled side of
tests/test_linear_numerics.py, whose helpers it uses."""

from __future__ import annotations

import copy

import pytest
import torch
from test_linear_numerics import _finite_amax, _train_step

import tqcompile as tq
from tqcompile.testing.compile import assert_bitwise_equal


@pytest.mark.parametrize("name", list(tq.recipes.RECIPES))
def test_compiled_equals_eager_bitwise(name):
    torch.compiler.reset()
    torch.manual_seed(0)
    eager = tq.nn.Linear(128, 128, recipe=tq.recipes.get(name))
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(128, 128, generator=g) * (4.0 if step == 0 else 0.5)
        dy = torch.randn(128, 128, generator=g)
        assert_bitwise_equal(_train_step(compiled, x, dy, step), _train_step(eager, x, dy, step), f"{name} step {step}")
    for buf in ("amax_history_input", "amax_history_weight", "amax_history_grad"):
        assert_bitwise_equal(getattr(compiled_layer, buf), getattr(eager, buf), buf)
    torch.compiler.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_compiled_equals_eager_low_precision_inputs(dtype):
    torch.compiler.reset()
    torch.manual_seed(0)
    eager = tq.nn.Linear(64, 32, recipe=tq.recipes.fp8_rowwise(), dtype=dtype)
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager", fullgraph=True)
    x, dy = torch.randn(3, 5, 64).to(dtype), torch.randn(3, 5, 32).to(dtype)
    assert_bitwise_equal(_train_step(compiled, x, dy, 0), _train_step(eager, x, dy, 0))
    torch.compiler.reset()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_delayed_scaling_histories(mode):
    torch.compiler.reset()
    hist_len = 4
    layer = tq.nn.Linear(64, 32, recipe=tq.recipes.fp8_delayed(hist_len))
    run = torch.compile(layer, backend="aot_eager", fullgraph=True) if mode == "compiled" else layer
    for name in ("amax_history_input", "amax_history_weight", "amax_history_grad"):
        buf = getattr(layer, name)
        assert buf.shape == (hist_len,) and buf.dtype == torch.float32 and not buf.any()
    assert set(layer.state_dict()) == {"weight", "bias", "amax_history_input", "amax_history_weight", "amax_history_grad"}

    g = torch.Generator().manual_seed(0)
    x_amaxes, dy_amaxes = [], []
    for step, scale in enumerate((8.0, 1.0, 2.0)):
        x = torch.randn(16, 64, generator=g) * scale
        dy = torch.randn(16, 32, generator=g) * scale * 0.1
        x_amaxes.insert(0, _finite_amax(x))
        dy_amaxes.insert(0, _finite_amax(dy))
        run(x).backward(dy)
        # Rolled one place per step, this step's amax at index 0, zeros not yet overwritten at the end.
        pad = [0.0] * (hist_len - step - 1)
        assert layer.amax_history_input.tolist() == x_amaxes + pad
        assert layer.amax_history_grad.tolist() == dy_amaxes + pad
        assert layer.amax_history_weight.tolist() == [_finite_amax(layer.weight)] * (step + 1) + pad
    torch.compiler.reset()
