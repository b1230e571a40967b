"""`tq.nn.Linear` under `torch.compile(fullgraph=True)`, forward and backward, for every recipe.

For each recipe: the compiled layer traces into one graph with zero graph breaks (Dynamo's forward;
AOTAutograd traces the backward from it, so an untraceable backward fails the compile); a second
call with a new input of the same shape, after the weights changed in place, reuses that graph;
the backward runs and fills every gradient. A golden of the fp8_tensorwise forward graph shows
what the compiler sees: tqcompile's amax/quantize/gemm_tn ops with the quantizers inline. (That
compiled results equal eager bit for bit is tested in tests/test_linear_numerics.py.)
"""

from __future__ import annotations

import expecttest
import pytest
import torch

import tqcompile as tq
from tqcompile.testing.compile import AotGraphRecorder, CompileCounter, graph_code

# 128 tokens, 128 in/out features: the smallest sizes every recipe's blocks divide.
TOKENS, IN, OUT = 128, 128, 128


@pytest.mark.parametrize("name", list(tq.recipes.RECIPES))
def test_linear_compiles_fullgraph_without_recompiles(name):
    torch.manual_seed(0)
    layer = tq.nn.Linear(IN, OUT, recipe=tq.recipes.get(name))
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(2, TOKENS // 2, IN, generator=g, requires_grad=True)
        compiled(x).pow(2).mean().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0
        assert layer.weight.grad.abs().sum() > 0 and layer.bias.grad.abs().sum() > 0
        with torch.no_grad():  # an optimizer step: must not invalidate a guard
            layer.weight -= 0.1 * layer.weight.grad
        layer.zero_grad()
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0), (counter, counter.break_reasons)


def test_a_different_recipe_recompiles():
    """Dynamo guards on the recipe by value: an equal recipe reuses the graph, another one does not."""
    layer = tq.nn.Linear(IN, OUT, recipe=tq.recipes.fp8_rowwise())
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    x = torch.randn(TOKENS, IN)
    compiled(x)
    layer.recipe = tq.recipes.fp8_rowwise()  # equal, not the same object
    compiled(x)
    assert counter.frame_count == 1
    layer.recipe = tq.recipes.mxfp8()
    compiled(x)
    assert counter.frame_count == 2 and counter.graph_breaks == 0


class TestLinearGraph(expecttest.TestCase):
    def test_fp8_tensorwise_forward_graph(self):
        """The forward: per operand one amax and two quantizes, rowwise for fprop and columnwise
        for backward (x's for wgrad, W's for dgrad: the recipe uses equal quantizers there, so
        both usages share the amax); one gemm_tn; the bias add. Returned after the output: what
        backward needs, the columnwise payloads and scales only (no high-precision x or W)."""
        torch.manual_seed(0)
        layer = tq.nn.Linear(32, 16, recipe=tq.recipes.fp8_tensorwise())
        recorder = AotGraphRecorder()
        counter = CompileCounter(recorder)
        torch.compile(layer, backend=counter, fullgraph=True)(torch.randn(8, 32, requires_grad=True))
        assert (counter.frame_count, counter.graph_breaks, len(recorder.forward_graphs)) == (1, 0, 1), counter
        self.assertExpectedInline(graph_code(recorder.forward_graphs[0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[16, 32]", primals_2: "f32[16]", primals_3: "f32[8, 32]"):
        view: "f32[8, 32]" = torch.ops.aten.view.default(primals_3, [-1, 32]);  primals_3 = None
        view_1: "f32[8, 32]" = torch.ops.aten.view.default(view, [8, 32])
        t: "f32[32, 8]" = torch.ops.aten.t.default(view_1);  view_1 = None
        amax: "f32[]" = torch.ops.tqcompile.amax.default(view, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12))
        quantize = torch.ops.tqcompile.quantize.default(view, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), amax, None);  view = None
        getitem: "f8e4m3fn[8, 32]" = quantize[0]
        getitem_1: "f32[]" = quantize[1];  quantize = None
        quantize_1 = torch.ops.tqcompile.quantize.default(t, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), amax, None);  t = None
        getitem_2: "f8e4m3fn[32, 8]" = quantize_1[0]
        getitem_3: "f32[]" = quantize_1[1];  quantize_1 = None
        view_2: "f32[16, 32]" = torch.ops.aten.view.default(primals_1, [16, 32])
        t_1: "f32[32, 16]" = torch.ops.aten.t.default(view_2);  view_2 = None
        amax_1: "f32[]" = torch.ops.tqcompile.amax.default(primals_1, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12))
        quantize_2 = torch.ops.tqcompile.quantize.default(primals_1, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), amax_1, None);  primals_1 = None
        getitem_4: "f8e4m3fn[16, 32]" = quantize_2[0]
        getitem_5: "f32[]" = quantize_2[1];  quantize_2 = None
        quantize_3 = torch.ops.tqcompile.quantize.default(t_1, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), amax_1, None);  t_1 = None
        getitem_6: "f8e4m3fn[32, 16]" = quantize_3[0]
        getitem_7: "f32[]" = quantize_3[1];  quantize_3 = None
        gemm_tn: "f32[8, 16]" = torch.ops.tqcompile.gemm_tn.default(getitem, getitem_1, amax, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), getitem_4, getitem_5, amax_1, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), torch.float32);  getitem = getitem_1 = getitem_4 = getitem_5 = None
        add: "f32[8, 16]" = torch.ops.aten.add.Tensor(gemm_tn, primals_2);  gemm_tn = primals_2 = None
        return (add, amax, getitem_2, getitem_3, amax_1, getitem_6, getitem_7)
""")
