"""Token counts and recompiles: how many graphs a quantized linear needs as the token count varies,
against `nn.Linear` (issue 6, item 9).

Fixed: a token count T of exactly one block (32 for MXFP8, 16 for NVFP4, 128 for FP8 1x128
blocks) used to compile one extra graph once T was dynamic, forward and training alike. The
recipes' columnwise (wgrad) operands are quantized in 1-D blocks along T, and their scale had
shape (K, T // block). AOTAutograd's tracer records every tensor of the graph it builds and asks
whether it is contiguous: `torch/fx/experimental/proxy_tensor.py` `set_meta` ->
`torch/fx/passes/shape_prop.py` `_extract_tensor_metadata` -> `torch/_prims_common/__init__.py:285`
(`check_contiguous_sizes_strides`: `if maybe_guard_or_false(x == 1)`, skipping dims of size 1).
With x = T // block, a backed symbol whose value may be 1, `guard_or_false` installed the guard
`(x.size()[0] // 32) != 1` (torch 2.13). `nn.Linear` has only T itself, which Dynamo already
assumes is not 1.

No op-local change avoids it: torch asks this of *any* graph tensor with a T // block dim (the
op's output, a view of it, a saved tensor), whatever its strides (a transposed layout moves the
question to a stride, `guard_or_true(T // block != 1)`). The fix is the layout: a columnwise usage
keeps 1-D block scales flat, (K * (T // block),), whose size is provably not 1
(`Quantizer.flat_columnwise_scale`; `tqcompile::quantize(..., flat_scale=True)` returns them so).
torch's global `torch.fx.experimental._config.backed_size_oblivious = True` also removes the guard,
but changes 0/1 specialisation for the whole program, so a library must not set it.

Graphs for T = 2, 3, 1, 4 blocks, measured before -> after: MXFP8, NVFP4 and FP8 1x128 each
3 -> 2, as nn.Linear (2), with or without backward; `GroupedLinear` on (experts, T, K) inputs
likewise (MXFP8, NVFP4, FP8 1x128: 3 -> 2). Still open: 2-D block scales (16x16, 128x128)
on a T-dependent operand (the recipes use them for weights only), a QuantizedTensor's `t()` (its
rowwise scale is 2-D again), and sequence-parallel gathers, which view the scale as
(K, T // block) to interleave the ranks' pieces.
"""

from __future__ import annotations

import pytest
import torch

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter

TOKEN_COUNTS = (64, 96, 128, 160)


def _frames(layer: torch.nn.Module, token_counts, backward: bool = False, lead: tuple[int, ...] = ()) -> int:
    """Graphs compiled for inputs of shape (*lead, T, in_features), T in `token_counts` (training: with `.backward()`)."""
    torch.compiler.reset()
    counter = CompileCounter("aot_eager")
    f = torch.compile(layer, backend=counter, fullgraph=True)
    for t in token_counts:
        x = torch.randn(*lead, t, layer.in_features, requires_grad=backward)
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


@pytest.mark.parametrize(("recipe", "block", "k"), ONE_BLOCK_CASES, ids=[c[0] for c in ONE_BLOCK_CASES])
def test_one_block_of_tokens_does_not_recompile(recipe, block, k):
    """Training (forward and backward): the weight needs a gradient, so the forward quantizes the
    input's columnwise usage for wgrad, and backward the gradient's; a forward alone traces the same."""
    torch.manual_seed(0)
    counts = (2 * block, 3 * block, block, 4 * block)  # mxfp8: 64, 96, 32, 128
    want = _frames(torch.nn.Linear(k, k), counts, backward=True)
    assert want == 2
    assert _frames(tq.nn.Linear(k, k, recipe=tq.recipes.get(recipe)), counts, backward=True) == want


@pytest.mark.parametrize(("recipe", "block"), [("mxfp8", 32), ("nvfp4", 16)])
def test_grouped_linear_one_block_of_tokens_does_not_recompile(recipe, block):
    """`GroupedLinear` on (experts, T, K) inputs had the same extra graph (measured 3 -> 2)."""
    torch.manual_seed(0)
    counts = (2 * block, 3 * block, block, 4 * block)
    experts = tq.nn.GroupedLinear(2, 64, 64, recipe=tq.recipes.get(recipe))
    want = _frames(torch.nn.Linear(64, 64), counts, backward=True, lead=(2,))
    assert want == 2
    assert _frames(experts, counts, backward=True, lead=(2,)) == want
