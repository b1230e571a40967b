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


def test_inductor_generates_the_dequantization_of_packed_nvfp4():
    """A packed NVFP4 weight is dequantized on every call (no CPU kernel reads it): inductor
    generates that dequantization (E2M1 codes decoded arithmetically, `SmallFloatCodec.decode`)
    instead of calling the opaque op, which ran the table decode as a dozen eager passes (a decode
    step 2.9x slower, docs/deploy.md); the dequantized weight is eager's bit for bit."""
    m, eager, out, source = _with_inductor("nvfp4")
    assert "torch.ops.tqcompile.dequantize" not in source
    assert "Original ATen: [tqcompile.dequantize" in source
    # fp32: inductor's own norms and attention move the logits within 1e-4. (In bf16 they move the
    # activations' NVFP4 codes too: 0.10 of 0.88 before and after this decomposition, measured.)
    torch.testing.assert_close(out.logits, eager, rtol=1e-4, atol=1e-4)
    for model in (m, tq.compress(calibrated("nvfp4", torch.bfloat16))):
        w = model.model.layers[0].mlp.down_proj.weight
        torch._dynamo.reset()
        assert torch.equal(torch.compile(lambda t: t.dequantize(), fullgraph=True)(w), w.dequantize())


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
