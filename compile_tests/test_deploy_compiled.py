"""tq.compress under torch.compile(fullgraph=True): one graph, no break, and no work on a weight.

The deployed forward's traced graph holds no quantize of a weight and no dequantize at all for the
layers that run a kernel (W8A8 quantizes its activations only); inductor lowers the aten kernels
itself (``_weight_int8pack_mm`` asserted on a cast scale before the scales were stored in the
model dtype) and computes what eager computes.
"""

from __future__ import annotations

import pytest
import torch
from test_deploy import CPU_KERNEL, IDS, calibrated, logits
from torch._dynamo.backends.common import aot_autograd

import tqcompile as tq


@pytest.mark.parametrize("preset", ["int8", "int4_weight_only", "int8_weight_only"])
def test_compiled_fullgraph_without_weight_work(preset):
    """The compiled forward holds no quantize of a weight and no dequantize at all: W8A8 quantizes
    its activations only (one quantize per linear layer), weight-only layers nothing."""
    m = tq.compress(calibrated(preset))
    eager = logits(m)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(m, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(IDS).logits
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    quantizes = sum("tqcompile.quantize" in t for t in targets)
    assert sum("tqcompile.dequantize" in t for t in targets) == 0
    assert quantizes == (14 if preset == "int8" else 0)
    assert any(CPU_KERNEL[preset].replace("int4pack_mm", "_weight_int4pack_mm_for_cpu") in t for t in targets)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_compiled_with_inductor_int8_weight_only():
    # Inductor lowers _weight_int8pack_mm itself: it asserted on a cast scale (kernels.weight_only_mm).
    m = tq.compress(calibrated("int8_weight_only"))
    eager = logits(m)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(m, fullgraph=True)(IDS).logits
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


def _with_inductor(preset: str):
    """A compressed model of `preset`, its eager logits, and its inductor-compiled output and generated code."""
    from torch._inductor.utils import run_and_get_code

    m = tq.compress(calibrated(preset))
    eager = logits(m)
    torch._dynamo.reset()
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(m, fullgraph=True), IDS)
    return m, eager, out, "\n".join(code)


def test_inductor_fuses_the_activation_quantization_of_w8a8():
    """INT8 activations per token: inductor generates their quantization (the decomposed
    `tqcompile::quantize`) next to the op before it; the generated code calls no tqcompile op
    and `torch._int_mm` for every linear layer."""
    _, eager, out, source = _with_inductor("int8_dynamic")
    assert "torch.ops.tqcompile" not in source  # no opaque tqcompile kernel is called
    assert "Original ATen: [tqcompile.quantize" in source  # a generated kernel computes the quantization
    assert source.count("extern_kernels._int_mm(") == 14
    torch.testing.assert_close(out.logits, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", ["nvfp4", "mxfp6"])
def test_inductor_generates_the_dequantization_of_packed_block_formats(preset):
    """A packed NVFP4 or MX weight is dequantized on every call (no CPU kernel reads it): inductor
    generates that dequantization (E2M1 / E2M3 codes decoded arithmetically,
    `SmallFloatCodec.decode`; MX's E8M0 scales from their uint8 bits, `MXPackedTensor`) instead of
    calling the opaque op, which ran the table decode as a dozen eager passes (a decode step 2.9x
    slower for NVFP4, 4.8x for MXFP8, docs/deploy.md); the dequantized weight is eager's bit for bit."""
    m, eager, out, source = _with_inductor(preset)
    # MX activations stay opaque: their E8M0 scales are made in the graph (14 linear layers).
    assert source.count("torch.ops.tqcompile.dequantize.default(") == (14 if preset.startswith("mx") else 0)
    assert "Original ATen: [tqcompile.dequantize" in source
    # fp32: inductor's own norms and attention move the logits within 1e-4. (In bf16 they move the
    # activations' NVFP4 codes too: 0.10 of 0.88 before and after this decomposition, measured.)
    torch.testing.assert_close(out.logits, eager, rtol=1e-4, atol=1e-4)
    for model in (m, tq.compress(calibrated(preset, torch.bfloat16))):
        w = model.model.layers[0].mlp.down_proj.weight
        torch._dynamo.reset()
        assert torch.equal(torch.compile(lambda t: t.dequantize(), fullgraph=True)(w), w.dequantize())


MX_ELEMENTS = [tq.Format.E4M3, tq.Format.E5M2, tq.Format.E2M3, tq.Format.E3M2, tq.Format.E2M1]


@pytest.mark.parametrize("fmt", MX_ELEMENTS, ids=str)
def test_inductor_dequantizes_every_mx_element_format_bit_for_bit(fmt):
    """Every MX element format's deployed weight (`MXPackedTensor`, E8M0 scales as bits) dequantizes
    under inductor to eager's tensor bit for bit, with no opaque op, on values spanning the scales'
    range (blocks from 2**-100 to 2**100), zeros, subnormal codes and negative zeros included."""
    from torch._inductor.utils import run_and_get_code

    from tqcompile.tensor import quantize_usages

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-100, 100, (64, 8), generator=g).float()).repeat_interleave(
        32, 1
    )
    w[0, :32] = 0.0
    w[1, :32] = -0.0
    w[2, :32] = torch.linspace(-1e-3, 1e-3, 32)  # one block of small values next to 0: subnormal codes
    qt = quantize_usages(w.bfloat16(), None, tq.MXQuantizer(fmt), rowwise=True, columnwise=False, seed=None, group_name=None)
    mt = tq.deploy.MXPackedTensor.from_quantized(qt)
    assert mt._scale_inv.dtype == torch.uint8 and torch.equal(mt.scale_e8m0.view(torch.uint8), qt._scale_inv.view(torch.uint8))
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(lambda t: t.dequantize(torch.float32), fullgraph=True), mt)
    assert "torch.ops.tqcompile.dequantize" not in "\n".join(code)
    want = qt.dequantize(torch.float32)
    assert torch.equal(out, want) and torch.equal(torch.signbit(out), torch.signbit(want))


@pytest.mark.parametrize("preset", ["int8_dynamic", "int4_weight_only"])
def test_generate_compiled_with_a_static_cache(preset):
    """HF generate with a static cache through the compiled (fullgraph, aot_eager) forward: the
    tokens the eager deployed model generates."""
    m = tq.compress(calibrated(preset))
    ids = IDS[:1, :6]
    want = m.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    m.forward = torch.compile(m.forward, backend="aot_eager", fullgraph=True)
    got = m.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)


@pytest.mark.parametrize("preset", ["int4_g16", "fp8", "int8", "nvfp4", "mxfp4_weight_only"])
def test_inductor_generates_the_dequantization_of_packed_experts(preset):
    """A deployed experts weight the CPU's integer kernels do not take (FP8, MX, NVFP4; INT4 in
    blocks of 16) is dequantized on every call, whole or at the routed experts (decoding): inductor generates it, with no
    opaque `tqcompile` op, for integer groups (W4A16's codes and fp32 group scales) and for the
    grouped layout of per-expert tensor scales (FP8, INT8, NVFP4: `tqcompile::grouped_dequantize`);
    the weights are eager's bit for bit. Measured before: a decode step of 32-expert packed INT4 or
    FP8 experts ran the opaque ops eagerly, compiled as slow as eager (docs/deploy.md)."""
    from moe_models import tiny_hf_moe
    from torch._inductor.utils import run_and_get_code

    from tqcompile.deploy.modules import _dequantized_gemm_weight, _routed_gemm_weight

    config = tq.configs.int_weight_only(4, 16) if preset == "int4_g16" else getattr(tq.configs, preset)()
    keep = tq.calibration.QuantRule.disable(module_types=(torch.nn.Linear,), must_match=False)
    m = tiny_hf_moe("gpt_oss", num_experts=8, layers=1)
    tq.calibrate(m, config.with_rules(keep), lambda mm: mm(IDS % 128), progress=False)
    tq.compress(m)
    w = m.model.layers[0].mlp.experts._parameters["down_proj"]
    ids = torch.tensor([1, 1, 6])
    for fn, args in ((_dequantized_gemm_weight, (w,)), (_routed_gemm_weight, (w, ids))):
        torch._dynamo.reset()
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
        assert "torch.ops.tqcompile" not in "\n".join(code), fn.__name__
        assert torch.equal(out, fn(*args)), fn.__name__


@pytest.mark.parametrize("preset", ["int8", "int8_dynamic", "fp8"])
def test_inductor_generates_the_grouped_input_quantization_of_experts(preset):
    """An experts GEMM's input is quantized per call (W8A8 experts: their codes for `_int_mm`; FP8:
    fake-quantized as calibrated): inductor generates `tqcompile::grouped_amax` and
    `grouped_quantize` (per-expert static or dynamic tensor scales, or one per token) with no opaque
    op left, bit for bit eager, also where no other `tqcompile` op registered the decompositions
    first (an experts-only model traces grouped ops alone: they were left opaque, W8A8 experts'
    compiled prefill 0.68x bf16 -> 1.0x, docs/deploy.md). The registration is undone first."""
    from moe_models import tiny_hf_moe
    from torch._inductor import decomposition
    from torch._inductor.utils import run_and_get_code

    from tqcompile.deploy.modules import _grouped_input_codes
    from tqcompile.ops.inductor import register_inductor_decompositions

    keep = tq.calibration.QuantRule.disable(module_types=(torch.nn.Linear,), must_match=False)
    m = tiny_hf_moe("mixtral", num_experts=8, layers=1)
    tq.calibrate(m, getattr(tq.configs, preset)().with_rules(keep), lambda mm: mm(IDS % 128), progress=False)
    unit = m.model.layers[0].mlp.experts._modules["down_proj_gemm"]
    x = torch.randn(40, unit.weight.shape[-1], generator=torch.Generator().manual_seed(0))
    ends = torch.tensor([3, 3, 10, 11, 25, 25, 33, 40])
    fn = (lambda x, ends: _grouped_input_codes(unit.input_quantizer, x * 1.5, ends)) if preset != "fp8" else (
        lambda x, ends: unit.input_quantizer(x * 1.5, ends=ends))
    ops = torch.ops.tqcompile
    for op in (ops.amax, ops.quantize, ops.dequantize, ops.gemm_tn, ops.grouped_amax, ops.grouped_quantize, ops.grouped_dequantize):
        decomposition.decompositions.pop(op.default, None)
    register_inductor_decompositions.cache_clear()
    decomposition.fast_random_decomps.cache_clear()
    torch._dynamo.reset()
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), x, ends)
        eager = fn(x, ends)
    assert "torch.ops.tqcompile" not in "\n".join(code)
    for a, b in zip(out if isinstance(out, tuple) else (out,), eager if isinstance(eager, tuple) else (eager,)):
        assert torch.equal(a, b)
