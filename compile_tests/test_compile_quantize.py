"""`torch.compile(fullgraph=True)` of quantize -> dequantize for every quantizer family.

Each family's quantizers are compiled together, in one function that loops over a tuple of
quantizers (Dynamo unrolls the loop), so a family costs one compile, not one per quantizer.
For each family the tests check: zero graph breaks; compiled results equal to eager bit for bit
(aot_eager runs the same custom-op kernels, so any difference would come from what Dynamo and
AOTAutograd did around them: views, transposes, dtype handling, QuantizedTensor rebuilding); no
recompile for equal but distinct quantizer objects; a recompile for a different quantizer; and
QuantizedTensors as graph outputs and graph inputs with rowwise, columnwise and both usages.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tqcompile as tq
from tqcompile import Format, Granularity, ScaleRounding
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal, assert_no_graph_breaks

F8, MX, NV, INT = tq.Float8Quantizer, tq.MXQuantizer, tq.NVFP4Quantizer, tq.IntQuantizer

_FP8_LAYOUTS = (
    F8(),
    F8(format=Format.E5M2),
    F8(granularity=Granularity.ROWWISE),
    F8(granularity=Granularity.ROWWISE, axis=0),
    F8(granularity=Granularity.BLOCKWISE_1D),
    F8(granularity=Granularity.BLOCKWISE_2D),
)

# family -> (input dtype, quantizers). Inputs are (128, 256): both it and its transpose fit
# 128x128 blocks, so every quantizer makes both usages.
FAMILIES: dict[str, tuple[torch.dtype, tuple[tq.Quantizer, ...]]] = {
    "fp8": (torch.float32, _FP8_LAYOUTS + tuple(dataclasses.replace(q, power_of_two_scale=True) for q in _FP8_LAYOUTS)),
    "mx": (
        torch.bfloat16,
        tuple(MX(format=f, scale_rounding=r) for f in (Format.E4M3, Format.E5M2, Format.E2M1) for r in ScaleRounding),
    ),
    "nvfp4": (
        torch.float32,
        (
            NV(),
            NV(block_2d=True),
            NV(stochastic_rounding=True),
            NV(hadamard=True, hadamard_seed=3),
            NV(block_2d=True, stochastic_rounding=True, hadamard=True),
        ),
    ),
    "int": (
        torch.float16,
        tuple(
            INT(format=f, granularity=g)
            for f in (Format.INT8, Format.INT4)
            for g in (Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCKWISE_1D)
        )
        + (INT(granularity=Granularity.ROWWISE, axis=0),),
    ),
}

# A quantizer of the same family, different from the family's last one: swapping it in for that one must recompile.
OTHER = {
    "fp8": F8(amax_epsilon=1e-6),
    "mx": MX(),
    "nvfp4": NV(hadamard=True, hadamard_seed=4),
    "int": INT(format=Format.INT4, granularity=Granularity.BLOCKWISE_1D, block_size=32),
}

SEED = torch.tensor([1234, 0], dtype=torch.int64)


def _input(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Spread the magnitudes over a few binades per row so blocks, rows and the tensor get different scales.
    x = torch.randn(128, 256, generator=g) * torch.logspace(-2, 2, 128).unsqueeze(1)
    return x.to(dtype)


def quantize_all(x: torch.Tensor, quantizers: tuple[tq.Quantizer, ...], seed: torch.Tensor) -> list:
    """Per quantizer: both usages as a graph output, their dequantizations, and a columnwise-only one."""
    out = []
    for q in quantizers:
        qx = tq.quantize(x, q, rowwise=True, columnwise=True, seed=seed)
        col_only = tq.quantize(x, q, rowwise=False, columnwise=True, seed=seed)
        out.append((qx, qx.dequantize(), qx.t().dequantize(), col_only.dequantize()))
    return out


def use_quantized(qxs: tuple[tq.QuantizedTensor, ...]) -> list:
    """QuantizedTensors as graph inputs; the inputs themselves, new QuantizedTensors made from them
    and their dequantizations (through each usage) as outputs."""
    out = []
    for qx in qxs:
        t = qx.t()
        out.append((qx, t.clone(), qx.dequantize(), t.dequantize(), qx.dequantize(torch.float32)))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_quantize_dequantize_fullgraph(family):
    dtype, quantizers = FAMILIES[family]
    x = _input(dtype)
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(quantize_all, backend=counter, fullgraph=True)

    assert_bitwise_equal(compiled(x, quantizers, SEED), quantize_all(x, quantizers, SEED))
    assert (counter.frame_count, counter.graph_breaks) == (1, 0), counter

    # Equal but distinct quantizer objects (and new data of the same shape) reuse the graph.
    equal = tuple(dataclasses.replace(q) for q in quantizers)
    assert all(a == b and a is not b for a, b in zip(equal, quantizers))
    x2 = _input(dtype, seed=1)
    assert_bitwise_equal(compiled(x2, equal, SEED), quantize_all(x2, equal, SEED))
    assert (counter.frame_count, counter.recompiles) == (1, 0), counter

    # One different quantizer: Dynamo guards on quantizer equality, so it must recompile.
    changed = quantizers[:-1] + (OTHER[family],)
    assert OTHER[family] != quantizers[-1]
    assert_bitwise_equal(compiled(x, changed, SEED), quantize_all(x, changed, SEED))
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (2, 1, 0), counter


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_quantized_tensor_graph_input(family):
    dtype, quantizers = FAMILIES[family]

    def make(x, qs, **usages):
        return tuple(tq.quantize(x, q, seed=SEED, **usages) for q in qs)

    qxs = make(_input(dtype), quantizers, rowwise=True, columnwise=True)
    eager = use_quantized(qxs)
    assert_bitwise_equal(assert_no_graph_breaks(use_quantized, qxs), eager)

    torch.compiler.reset()
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(use_quantized, backend=counter, fullgraph=True)
    assert_bitwise_equal(compiled(qxs), eager)

    # New payloads with equal (distinct) quantizers in the metadata: no recompile.
    qxs2 = make(_input(dtype, seed=1), tuple(dataclasses.replace(q) for q in quantizers), rowwise=True, columnwise=True)
    assert_bitwise_equal(compiled(qxs2), use_quantized(qxs2))
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0), counter

    # A different quantizer, or a different set of usages, changes the inner tensors: recompile.
    for variant in (
        qxs[:-1] + make(_input(dtype), (OTHER[family],), rowwise=True, columnwise=True),
        make(_input(dtype), quantizers, rowwise=True, columnwise=False),
        make(_input(dtype), quantizers, rowwise=False, columnwise=True),
    ):
        assert_bitwise_equal(compiled(variant), use_quantized(variant))
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (4, 3, 0), counter


def test_quantizer_from_closure_and_amax_group_name_recorded():
    """A quantizer captured from the enclosing scope (not an argument) is guarded too, and a
    group given by name for a quantizer with only local scales is just recorded (no collective)."""
    x = _input(torch.float32)
    q = F8(granularity=Granularity.BLOCKWISE_1D)

    def fn(x):
        return tq.quantize(x, q, amax_group="not-a-real-group", columnwise=True)

    counter = CompileCounter("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    out = compiled(x)
    assert_bitwise_equal(out, fn(x))
    assert out.amax_group_name == "not-a-real-group"
    q = dataclasses.replace(q)
    compiled(x)
    assert (counter.frame_count, counter.recompiles) == (1, 0), counter
    q = dataclasses.replace(q, power_of_two_scale=True)
    assert_bitwise_equal(compiled(x), fn(x))
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (2, 1, 0), counter


def test_inductor_fp8_tensorwise_and_mxfp8():
    """Inductor generates code around the custom ops (the elementwise producer and consumers,
    the transposes) and must pickle the quantizers into its FX graph cache key."""
    fp8, mxfp8 = F8(), MX()

    def fn(x, w_q):
        qx = tq.quantize(torch.relu(x) * 0.5, fp8, columnwise=True)
        qy = tq.quantize(x - 1.0, mxfp8, columnwise=True)
        return qx, qy, qx.dequantize() + 1.0, qy.t().dequantize() * 2.0, w_q.dequantize() - 3.0, w_q.t().dequantize()

    x = _input(torch.float32)
    w_q = tq.quantize(_input(torch.bfloat16, seed=2), mxfp8, rowwise=True, columnwise=True)
    counter = CompileCounter("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    # The elementwise ops around the custom ops are single IEEE operations (no fusion can change
    # their rounding), so inductor's result must match eager bit for bit.
    assert_bitwise_equal(compiled(x, w_q), fn(x, w_q))
    w_q2 = tq.quantize(_input(torch.bfloat16, seed=3), MX(), rowwise=True, columnwise=True)
    assert_bitwise_equal(compiled(x, w_q2), fn(x, w_q2))
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0), counter


def test_compile_helpers_report_breaks_and_recompiles():
    """The helpers themselves: a graph break is reported, a recompile is counted."""

    def breaks(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    x = torch.ones(4)
    with pytest.raises(AssertionError, match=r"2 graph\(s\) with 1 graph break"):
        assert_no_graph_breaks(breaks, x)

    counter = CompileCounter("aot_eager")
    compiled = torch.compile(lambda x: x + 1, backend=counter, fullgraph=True, dynamic=False)
    compiled(x)
    compiled(torch.ones(5))
    assert (counter.frame_count, counter.recompiles) == (2, 1), counter

    with pytest.raises(AssertionError, match=r"result\[1\]: 1 of 4 elements differ"):
        assert_bitwise_equal((x, torch.tensor([0.0, 1.0, 2.0, 3.0])), (x, torch.tensor([-0.0, 1.0, 2.0, 3.0])))


@pytest.mark.parametrize("view", ["detach", "t", "view", "slice"])
def test_view_of_graph_input_as_graph_output(view):
    """A *view* of a QuantizedTensor graph input can be a graph output (view handlers skip
    `return_and_correct_aliasing`, whose as_strided replay a payload cannot support)."""
    views = {
        "detach": lambda qx: qx.detach(),
        "t": lambda qx: qx.t(),
        "view": lambda qx: qx.view(2, 64, 256),
        "slice": lambda qx: qx[0:64],
    }
    qx = tq.quantize(_input(torch.float32), F8(), rowwise=True, columnwise=True)
    fn = views[view]
    assert_bitwise_equal(torch.compile(fn, backend="aot_eager", fullgraph=True)(qx), fn(qx))
