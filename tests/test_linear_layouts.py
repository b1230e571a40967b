"""The one quantized linear in its tensor-parallel layouts, on a single-rank group: every layout
quantizes what one process quantizes, so with one rank each must equal `tq.nn.functional.linear`
bit for bit, stochastic rounding included. That holds only if every layout quantizes dy for a GEMM
only where the GEMM runs: a dgrad dy quantized for a first layer (whose input needs no gradient)
would draw a stochastic-rounding seed that one process does not, and the wgrad seed after it would
differ."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import tqcompile as tq
from tqcompile.distributed.tp_linear import REPLICATE, SEQUENCE, colwise_linear, rowwise_linear
from tqcompile.testing.compile import assert_bitwise_equal


@pytest.fixture
def group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _grads(fn, x, w, b, dy, seed=0):
    w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
    torch.manual_seed(seed)
    y = fn(x, w, b)
    y.backward(dy)
    return y.detach(), w.grad, b.grad, None if x.grad is None else x.grad.clone()


@pytest.mark.parametrize("input_grad", [False, True], ids=["first-layer", "inner-layer"])
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8", "fp8_rowwise_hp_wgrad"])
def test_one_rank_layouts_equal_one_process(group, recipe, input_grad):
    r = tq.recipes.get(recipe)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 64, generator=g)
    w, b = torch.randn(32, 64, generator=g) * 0.1, torch.randn(32, generator=g)
    dy = torch.randn(2, 32, 32, generator=g)

    def run(fn):
        xr = x.clone().requires_grad_(input_grad)
        return _grads(fn, xr, w, b, dy)

    want = run(lambda x, w, b: tq.nn.functional.linear(x, w, b, r))
    for mode in (REPLICATE, SEQUENCE):
        for name, layout in (("colwise", colwise_linear), ("rowwise", rowwise_linear)):
            got = run(lambda x, w, b, f=layout, m=mode: f(x, w, b, r, group, 1, m, 1, f"{f.__name__} {m}", None))
            for what, a, e in zip(("y", "dW", "db", "dx"), got, want):
                if e is None:
                    assert a is None, f"{name} {mode}: {what}"
                else:
                    assert_bitwise_equal(a, e, f"{recipe} {name} {mode}: {what}")
