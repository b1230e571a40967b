"""Quantizers equal in result are one compile-cache key (Dynamo guards on `__eq__`), and a
quantizer can be built inside a compiled function: the compiled side of tests/test_quantizer_canonical.py."""

from __future__ import annotations

import pytest
import torch
from test_quantizer_canonical import SAME_RESULT

import tqcompile as tq
from tqcompile.quantizers import Float8Quantizer
from tqcompile.testing.compile import CompileCounter


@pytest.mark.parametrize("name", ["fp8-tensorwise-block_size", "fp8-block1d-axis", "nvfp4-hadamard_seed-without-hadamard"])
def test_equal_result_quantizers_do_not_recompile(name):
    a, b = SAME_RESULT[name]
    torch.compiler.reset()
    counter = CompileCounter("aot_eager")
    f = torch.compile(lambda x, q: tq.quantize(x, q).dequantize(), backend=counter, fullgraph=True)
    x = torch.randn(64, 64)
    f(x, b)
    f(x, a)
    assert counter.frame_count == 1 and counter.recompiles == 0, counter


def test_quantizer_built_inside_a_compiled_function():
    """Construction (and its normalisation) runs fine when Dynamo traces it."""
    torch.compiler.reset()
    counter = CompileCounter("aot_eager")
    f = torch.compile(lambda x: tq.quantize(x, Float8Quantizer(block_size=64)).dequantize(), backend=counter, fullgraph=True)
    x = torch.randn(64, 64)
    assert torch.equal(f(x), tq.quantize(x, Float8Quantizer()).dequantize())
    assert counter.graph_breaks == 0
