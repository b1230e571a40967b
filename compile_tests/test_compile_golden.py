"""Golden graphs: what the compiler sees for representative tqcompile code.

Each test records the AOTAutograd forward graph (aten level, after functionalization; what
inductor would get) and compares its normalised code with the inline golden. A change in what
the compiler sees (an extra op, a lost fusion opportunity, a quantizer field) shows up in review
as a diff of the golden. Regenerate with ``EXPECTTEST_ACCEPT=1 pytest compile_tests/test_compile_golden.py``
and read the diff before committing it.
"""

import expecttest
import torch

import tqcompile as tq
from tqcompile.testing.compile import AotGraphRecorder, CompileCounter, graph_code


def _forward_graph(fn, *args) -> str:
    torch.compiler.reset()
    recorder = AotGraphRecorder()
    counter = CompileCounter(recorder)
    torch.compile(fn, backend=counter, fullgraph=True)(*args)
    assert (counter.frame_count, counter.graph_breaks, len(recorder.forward_graphs)) == (1, 0, 1), counter
    return graph_code(recorder.forward_graphs[0])


class TestGoldenGraphs(expecttest.TestCase):
    def test_float8_tensorwise_quantize_dequantize(self):
        """One amax shared by both usages, two quantize calls (x and its transpose), one dequantize
        per usage; the QuantizedTensor output flattens to its payloads, scales and amax."""
        q = tq.Float8Quantizer()

        def fn(x):
            qx = tq.quantize(x, q, rowwise=True, columnwise=True)
            return qx, qx.dequantize(), qx.t().dequantize()

        self.assertExpectedInline(_forward_graph(fn, torch.randn(32, 64)), """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "f32[32, 64]"):
        view: "f32[32, 64]" = torch.ops.aten.view.default(arg0_1, [32, 64])
        t: "f32[64, 32]" = torch.ops.aten.t.default(view);  view = None
        amax: "f32[]" = torch.ops.tqcompile.amax.default(arg0_1, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12))
        quantize = torch.ops.tqcompile.quantize.default(arg0_1, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), amax, None);  arg0_1 = None
        getitem: "f8e4m3fn[32, 64]" = quantize[0]
        getitem_1: "f32[]" = quantize[1];  quantize = None
        quantize_1 = torch.ops.tqcompile.quantize.default(t, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), amax, None);  t = None
        getitem_2: "f8e4m3fn[64, 32]" = quantize_1[0]
        getitem_3: "f32[]" = quantize_1[1];  quantize_1 = None
        dequantize: "f32[32, 64]" = torch.ops.tqcompile.dequantize.default(getitem, getitem_1, amax, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), torch.float32)
        dequantize_1: "f32[64, 32]" = torch.ops.tqcompile.dequantize.default(getitem_2, getitem_3, amax, Float8Quantizer(format=Format.E4M3, granularity=Granularity.TENSORWISE, axis=-1, block_size=128, power_of_two_scale=False, amax_epsilon=1e-12), torch.float32)
        return (getitem, getitem_1, amax, getitem_2, getitem_3, amax, dequantize, dequantize_1)
""")

    def test_mxfp8_quantized_tensor_input(self):
        """A QuantizedTensor graph input arrives as its inner tensors (payload, E8M0 scales per
        usage; no amax for MX), and dequantizing to another dtype is one op."""
        qx = tq.quantize(torch.randn(32, 64, dtype=torch.bfloat16), tq.MXQuantizer(), rowwise=True, columnwise=True)

        def fn(qx):
            return qx.dequantize(torch.float32), qx.t().dequantize()

        self.assertExpectedInline(_forward_graph(fn, qx), """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "f8e4m3fn[32, 64]", arg1_1: "f8e8m0fnu[32, 2]", arg2_1: "f8e4m3fn[64, 32]", arg3_1: "f8e8m0fnu[64]"):
        dequantize: "f32[32, 64]" = torch.ops.tqcompile.dequantize.default(arg0_1, arg1_1, None, MXQuantizer(format=Format.E4M3, scale_rounding=ScaleRounding.FLOOR), torch.float32);  arg0_1 = arg1_1 = None
        view: "f8e8m0fnu[64, 1]" = torch.ops.aten.view.default(arg3_1, [64, 1]);  arg3_1 = None
        dequantize_1: "bf16[64, 32]" = torch.ops.tqcompile.dequantize.default(arg2_1, view, None, MXQuantizer(format=Format.E4M3, scale_rounding=ScaleRounding.FLOOR), torch.bfloat16);  arg2_1 = view = None
        return (dequantize, dequantize_1)
""")

    def test_nvfp4_hadamard_columnwise(self):
        """NVFP4 with the Hadamard transform: the columnwise usage gets its own tensor amax (the
        transform mixes different elements there); the stochastic-rounding seed is a graph input."""
        q = tq.NVFP4Quantizer(hadamard=True, stochastic_rounding=True)

        def fn(x, seed):
            qx = tq.quantize(x, q, rowwise=True, columnwise=True, seed=seed)
            return qx, qx.dequantize()

        self.assertExpectedInline(_forward_graph(fn, torch.randn(32, 64), torch.tensor([7, 0])), """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "f32[32, 64]", arg1_1: "i64[2]"):
        view: "f32[32, 64]" = torch.ops.aten.view.default(arg0_1, [32, 64])
        t: "f32[64, 32]" = torch.ops.aten.t.default(view);  view = None
        amax: "f32[]" = torch.ops.tqcompile.amax.default(arg0_1, NVFP4Quantizer(block_2d=False, stochastic_rounding=True, hadamard=True, hadamard_seed=0, amax_epsilon=1e-12))
        amax_1: "f32[]" = torch.ops.tqcompile.amax.default(t, NVFP4Quantizer(block_2d=False, stochastic_rounding=True, hadamard=True, hadamard_seed=0, amax_epsilon=1e-12))
        quantize = torch.ops.tqcompile.quantize.default(arg0_1, NVFP4Quantizer(block_2d=False, stochastic_rounding=True, hadamard=True, hadamard_seed=0, amax_epsilon=1e-12), amax, arg1_1);  arg0_1 = None
        getitem: "u8[32, 32]" = quantize[0]
        getitem_1: "f8e4m3fn[32, 4]" = quantize[1];  quantize = None
        quantize_1 = torch.ops.tqcompile.quantize.default(t, NVFP4Quantizer(block_2d=False, stochastic_rounding=True, hadamard=True, hadamard_seed=0, amax_epsilon=1e-12), amax_1, arg1_1, True);  t = arg1_1 = None
        getitem_2: "u8[64, 16]" = quantize_1[0]
        getitem_3: "f8e4m3fn[128]" = quantize_1[1];  quantize_1 = None
        dequantize: "f32[32, 64]" = torch.ops.tqcompile.dequantize.default(getitem, getitem_1, amax, NVFP4Quantizer(block_2d=False, stochastic_rounding=True, hadamard=True, hadamard_seed=0, amax_epsilon=1e-12), torch.float32)
        return (getitem, getitem_1, amax, getitem_2, getitem_3, amax_1, dequantize)
""")
