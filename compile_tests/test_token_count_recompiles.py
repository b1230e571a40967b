"""Token counts and recompiles: how many graphs a quantized linear needs as the token count varies,
against `nn.Linear` (issue 6, item 9).

Known limit, measured on torch 2.13 (aot_eager), forward and backward alike: once the token count
T is dynamic, every recipe whose columnwise (wgrad) operand is quantized in 1-D blocks along T
compiles one extra graph for T equal to one block: MXFP8 (T=32), NVFP4 (T=16), FP8 1x128 blocks
(`fp8_blockwise`, T=128). Their columnwise scale has shape (K, T // block). AOTAutograd's tracer
records every tensor of the graph it builds, and for the scale returned by `tqcompile::quantize`
it asks whether that tensor is contiguous:
`torch/fx/experimental/proxy_tensor.py` `set_meta` -> `torch/fx/passes/shape_prop.py`
`_extract_tensor_metadata` -> `torch/_prims_common/__init__.py:285`
(`check_contiguous_sizes_strides`: `if maybe_guard_or_false(x == 1)`, a dim of size 1 is
skipped). With x = T // block, a backed symbol whose value may be 1, `guard_or_false` installs the
guard `(x.size()[0] // 32) != 1`. `nn.Linear` has only T itself, which Dynamo already assumes is
not 1 (its range starts at 2), so it asks nothing.

What was tried: no tqcompile code compares a size with 1, and no op-local change helps, because
torch asks this of *any* graph tensor with a T // block dim (the op's output, a view of it, a
saved tensor), whatever its strides (a transposed layout moves the question to a stride:
`guard_or_true(T // block != 1)`). What removes it: a flat (1-D) columnwise scale, K * (T // block)
elements (measured with MXFP8 forward: 2 graphs, as nn.Linear; K >= 2 makes its size provably not 1), which changes
the QuantizedTensor layout that FSDP2, the TP collectives and the slicing handlers rely on; or
torch's global `torch.fx.experimental._config.backed_size_oblivious = True` (2 graphs for MXFP8), which
changes 0/1 specialisation for the whole program and so is not set by a library. The cost today
is one compile per layer shape, once.
"""

from __future__ import annotations

import pytest
import torch

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter

TOKEN_COUNTS = (64, 96, 128, 160)


def _frames(layer: torch.nn.Module, token_counts, backward: bool = False) -> int:
    torch.compiler.reset()
    counter = CompileCounter("aot_eager")
    f = torch.compile(layer, backend=counter, fullgraph=True)
    for t in token_counts:
        x = torch.randn(t, layer.in_features, requires_grad=backward)
        y = f(x)
        if backward:
            y.sum().backward()
    return counter.frame_count


def test_token_counts_compile_like_nn_linear():
    """Static first, then one dynamic graph for every other multiple of the block (above one block)."""
    torch.manual_seed(0)
    want = _frames(torch.nn.Linear(64, 64), TOKEN_COUNTS)
    assert want == 2
    assert _frames(tq.nn.Linear(64, 64, recipe=tq.recipes.mxfp8()), TOKEN_COUNTS) == want


# (recipe, block along T of its columnwise operands, in_features): T runs 2, 3, 1, 4 blocks.
ONE_BLOCK_CASES = [("mxfp8", 32, 64), ("nvfp4", 16, 64), ("fp8_blockwise", 128, 128)]


@pytest.mark.xfail(strict=True, reason="torch guards T // block != 1 on the columnwise scale's contiguity (module docstring)")
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize(("recipe", "block", "k"), ONE_BLOCK_CASES, ids=[c[0] for c in ONE_BLOCK_CASES])
def test_one_block_of_tokens_does_not_recompile(recipe, block, k, backward):
    torch.manual_seed(0)
    counts = (2 * block, 3 * block, block, 4 * block)  # mxfp8: 64, 96, 32, 128
    want = _frames(torch.nn.Linear(k, k), counts, backward)
    assert want == 2
    assert _frames(tq.nn.Linear(k, k, recipe=tq.recipes.get(recipe)), counts, backward) == want
