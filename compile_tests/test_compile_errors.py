"""Bad calls under `torch.compile(fullgraph=True)` raise our own error, as in eager mode.

Measured on torch 2.13 before this existed: every one of these surfaced as
`torch._dynamo.exc.Unsupported: Observed exception`, with our message only in the "Developer
debug context" (a 0-dim input gave a bare `IndexError: list index out of range`). Now tqcompile
defers the error to run time of the compiled code (`tqcompile.ops.errors`), so the exception is
the same type with the same message as eager mode.
"""

from __future__ import annotations

import pytest
import torch

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter

LINEAR_BAD_INPUTS = {
    "in_features": (lambda: torch.randn(32, 48), ValueError, "linear: input last dim 48 does not match weight in_features 64"),
    "token_count": (lambda: torch.randn(33, 64), ValueError, "(33 tokens = batch x sequence)"),
    "dtype": (lambda: torch.randn(32, 64, dtype=torch.float64), TypeError, "linear: input dtype torch.float64 is not supported"),
    "0-dim": (lambda: torch.randn(()), ValueError, "linear: input must have shape (..., in_features=64), got a 0-dim tensor"),
}


def _eager_error(fn, *args) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("case", list(LINEAR_BAD_INPUTS))
def test_linear_errors_under_fullgraph_compile(case):
    make_x, error, text = LINEAR_BAD_INPUTS[case]
    torch.manual_seed(0)
    layer = tq.nn.Linear(64, 64, recipe=tq.recipes.mxfp8())
    want = _eager_error(layer, make_x())
    assert type(want) is error and text in str(want)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(64, 64))  # a good call first: its graph must stay usable afterwards
    got = _eager_error(compiled, make_x())
    assert type(got) is error, f"{type(got).__name__}: {str(got)[:300]}"
    assert str(got) == str(want)
    # The graph compiled for the good call is not disturbed by the bad one.
    x = torch.randn(64, 64)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


def test_error_raised_inside_a_model_even_when_the_output_is_unused():
    """The op that raises is never dead-code eliminated, and traces where gradients are needed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), tq.nn.Linear(48, 64, recipe=tq.recipes.fp8_tensorwise()))

    def unused(x):
        model(x)
        return x * 2

    def loss(x):  # the autograd path: the placeholder sits in a graph that requires grad
        return model(x).square().mean()

    for fn in (unused, loss):
        torch.compiler.reset()
        counter = CompileCounter("aot_eager")
        with pytest.raises(ValueError, match="linear: input last dim 64 does not match weight in_features 48"):
            torch.compile(fn, backend=counter, fullgraph=True)(torch.randn(16, 32, requires_grad=True))
        assert counter.graph_breaks == 0


QUANTIZE_BAD_CALLS = {
    "dtype": (lambda: torch.randn(4, 32, dtype=torch.float64), tq.MXQuantizer(), {}, TypeError),
    "block": (lambda: torch.randn(4, 33), tq.MXQuantizer(), {}, ValueError),
    "columnwise-block": (lambda: torch.randn(33, 32), tq.MXQuantizer(), {"columnwise": True}, ValueError),
    "nvfp4-2d-block": (lambda: torch.randn(8, 32), tq.NVFP4Quantizer(block_2d=True), {}, ValueError),
}


@pytest.mark.parametrize("case", list(QUANTIZE_BAD_CALLS))
def test_quantize_errors_under_fullgraph_compile(case):
    make_x, q, kwargs, error = QUANTIZE_BAD_CALLS[case]

    def f(x):
        return tq.quantize(x, q, **kwargs).dequantize(torch.float32)

    want = _eager_error(f, make_x())
    got = _eager_error(torch.compile(f, backend="aot_eager", fullgraph=True), make_x())
    assert type(want) is error and type(got) is error, f"{type(got).__name__}: {str(got)[:300]}"
    assert str(got) == str(want)


def test_raise_error_op():
    """Eager: raises at once. Traced (fake tensors): a placeholder of the asked shape and dtype.
    Run: the kernel raises. (No `opcheck`: a kernel that always raises has no output to check.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tqcompile.ops import raise_error

    with pytest.raises(ValueError, match="^boom$"):
        raise_error(ValueError, "boom", torch.zeros(2), (3,))
    with pytest.raises(TypeError, match="error must be one of"):
        raise_error(KeyError, "boom", torch.zeros(2), (3,))
    with FakeTensorMode() as mode:
        like = mode.from_tensor(torch.zeros(2))
        out = torch.ops.tqcompile.raise_error(like, "TypeError", "boom", [3, 4], torch.bfloat16)
    assert out.shape == (3, 4) and out.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="^boom$"):
        torch.ops.tqcompile.raise_error(torch.zeros(2), "TypeError", "boom", [3, 4], torch.bfloat16)
