"""`tq.nn.GroupedLinear` compiled with fullgraph=True: bad counts raise at run time, and every
`m_splits` form compiles to one graph equal to eager bit for bit. The compiled side of
tests/test_grouped_linear.py, whose helpers it uses."""

from __future__ import annotations

import copy

import pytest
import torch
from test_grouped_linear import E, K, N, _experts, _step

from tqcompile.nn.grouped import _CHECK_MESSAGE_TRACES
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal


def test_bad_m_splits_error_in_a_compiled_call():
    """Compiled, the module's eager check is skipped (it would need the counts on the host); the
    ops' kernels check them on CPU and raise the same kind of error at run time."""
    experts = _experts("fp8_tensorwise")
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, K)
    assert compiled(x, torch.tensor([2, 2, 0, 4])).shape == (8, N)
    with pytest.raises(
        ValueError,
        match=r"m_splits=\[2, 2, 2, 3\] must be non-negative per-expert token counts summing to the number of tokens 8",
    ):
        compiled(x, torch.tensor([2, 2, 2, 3]))
    torch.compiler.reset()


def test_bincount_counts_of_a_wrong_length_error_in_a_compiled_call():
    """Counts from `torch.bincount(ids, minlength=E)` have a data-dependent length: the call
    compiles, and an expert id past the last expert (E + 2 counts) raises when the compiled code
    runs, saying what the counts must be."""
    experts = _experts("mxfp8")
    compiled = torch.compile(lambda x, ids: experts(x, torch.bincount(ids, minlength=E)), backend="aot_eager", fullgraph=True)
    x = torch.randn(8, K)
    assert compiled(x, torch.tensor([0, 0, 1, 1, 3, 3, 3, 3])).shape == (8, N)
    # torch 2.11 cannot trace the check's message (`tqcompile.nn.grouped._CHECK_MESSAGE_TRACES`):
    # the call still fails, with torch's own words.
    message = r"count tensor \(m_splits, .*has a length other than the number of experts" if _CHECK_MESSAGE_TRACES else None
    with pytest.raises(RuntimeError, match=message):
        compiled(x, torch.tensor([0, 0, 1, 1, 3, 3, 3, E + 1]))
    torch.compiler.reset()


@pytest.mark.parametrize("mode", ["dense", "list", "tensor"])
@pytest.mark.parametrize("name", ["fp8_tensorwise", "nvfp4"])
def test_compiled_fullgraph_no_graph_breaks(name, mode):
    torch.compiler.reset()
    experts = _experts(name)
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(copy.deepcopy(experts), backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(4)
    m_splits = {"dense": None, "list": [16, 48, 32, 32], "tensor": torch.tensor([16, 48, 0, 64])}[mode]
    shape = (E, 32) if mode == "dense" else (128,)
    x, dy = torch.randn(*shape, K, generator=g), torch.randn(*shape, N, generator=g)
    assert_bitwise_equal(_step(compiled, x, dy, m_splits), _step(experts, x, dy, m_splits))
    assert counter.frame_count == 1 and counter.graph_breaks == 0 and counter.recompiles == 0, counter
    torch.compiler.reset()
