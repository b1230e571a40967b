"""Inductor sees through the `tqcompile` ops where it can fuse them (`tqcompile.ops.inductor`).

For FP8 and INT quantizers with tensorwise or rowwise scales on CPU, inductor gets the reference
kernels of amax, quantize and dequantize as decompositions, and for FP8 pairs the GEMM's plain-torch
kernel (`fp8_gemm_cpu`): the generated code must call none of them (the amax, the scale, the cast
and the GEMM's upcast are generated code that inductor fuses with its neighbours; the matmul is
the same BLAS call) and still equal eager bit for bit. Quantizers inductor cannot compile
(MX's E8M0 scales, 1-D blocks: see the module) keep their opaque kernel, and also equal eager.
The traced interface does not change: `aot_eager` still sees one opaque node per op (the goldens
in test_compile_golden.py hold that).
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import tqcompile as tq
from tqcompile.testing import assert_bitwise_equal


def _linear_step(recipe: tq.Recipe):
    torch.manual_seed(0)
    layer = tq.nn.Linear(128, 256, recipe=recipe)
    x = torch.randn(256, 128, requires_grad=True)

    def fwd(x):
        # A producer and a consumer inductor may fuse with the quantize path. Both are exact in
        # forward and backward (a power-of-two multiply, relu), so fusing them cannot change a bit;
        # silu's backward would (inductor rounds its decomposition differently from eager).
        return torch.relu(layer(x * 0.5)) * 2.0

    def run(f):
        x.grad, layer.weight.grad = None, None
        y = f(x)
        y.backward(torch.ones_like(y))
        return y, x.grad, layer.weight.grad

    return fwd, run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "decomposed"),
    [("fp8_tensorwise", True), ("mxfp8", False)],
)
def test_inductor_decomposes_fusable_quantizers(name: str, decomposed: bool) -> None:
    torch.compiler.reset()
    fwd, run = _linear_step(tq.recipes.get(name))
    eager = run(fwd)
    compiled_fwd = torch.compile(fwd, fullgraph=True, backend="inductor")
    compiled, codes = run_and_get_code(run, compiled_fwd)
    assert_bitwise_equal(compiled, eager)
    code = "\n".join(codes)
    assert codes, "inductor generated no code"
    if decomposed:
        called = [op for op in ("amax", "quantize", "dequantize", "gemm_tn") if f"torch.ops.tqcompile.{op}." in code]
        assert not called, f"{name}: inductor left {called} opaque"
    else:
        for op in ("quantize", "gemm_tn"):
            assert f"torch.ops.tqcompile.{op}." in code, f"{name}: expected the opaque {op} kernel"


@pytest.mark.slow
def test_decomposed_after_another_inductor_compile() -> None:
    """The decompositions reach inductor even where something else was compiled with inductor
    before the first `tqcompile` op was traced: inductor caches its decomposition table at its
    first compile of a process (a benchmark compiling an unquantized model or torchao's first kept
    every `tqcompile` op opaque, its step 1.6x slower). The registration is undone first, so this test
    sees that order whatever ran before it in the process."""
    from torch._inductor import decomposition

    from tqcompile.ops.inductor import register_inductor_decompositions

    ops = torch.ops.tqcompile
    for op in (ops.amax, ops.quantize, ops.dequantize, ops.gemm_tn):
        decomposition.decompositions.pop(op.default, None)
    register_inductor_decompositions.cache_clear()
    decomposition.fast_random_decomps.cache_clear()
    torch.compiler.reset()
    plain = torch.compile(lambda x: torch.relu(x) * 2.0, fullgraph=True, backend="inductor")
    plain(torch.randn(8, 8))
    assert torch.ops.tqcompile.amax.default not in decomposition.select_decomp_table()

    fwd, run = _linear_step(tq.recipes.get("fp8_tensorwise"))
    eager = run(fwd)
    compiled, codes = run_and_get_code(run, torch.compile(fwd, fullgraph=True, backend="inductor"))
    assert_bitwise_equal(compiled, eager)
    code = "\n".join(codes)
    called = [op for op in ("amax", "quantize", "dequantize", "gemm_tn") if f"torch.ops.tqcompile.{op}." in code]
    assert not called, f"inductor left {called} opaque after an earlier inductor compile"


def test_aot_eager_keeps_the_ops_opaque() -> None:
    """The decompositions are inductor's alone: AOTAutograd with aot_eager records the op nodes."""
    from tqcompile.testing.compile import AotGraphRecorder, CompileCounter, graph_code

    torch.compiler.reset()
    recorder = AotGraphRecorder()
    fn = torch.compile(
        lambda x: tq.quantize(x, tq.Float8Quantizer()).dequantize(), backend=CompileCounter(recorder), fullgraph=True
    )
    fn(torch.randn(16, 32))
    code = graph_code(recorder.forward_graphs[0])
    for op in ("tqcompile.amax", "tqcompile.quantize", "tqcompile.dequantize"):
        assert op in code, code


def test_compile_caches_are_keyed_on_the_decompositions_source(tmp_path) -> None:
    """Inductor's FX graph cache keys a graph on torch's code, not on the decompositions tq hands
    it: a graph compiled by another tq came back from a warm cache (measured: the opaque NVFP4
    dequantize's 12 ms for the generated 2.4 ms). Registering the decompositions puts a digest of
    their sources into torch's cache key tag, after the user's own."""
    import shutil

    from tqcompile.ops import inductor

    torch.compiler.config.cache_key_tag = "mine"
    inductor.register_inductor_decompositions.cache_clear()
    try:
        inductor.register_inductor_decompositions()
        assert torch.compiler.config.cache_key_tag == f"mine|{inductor.numerics_key()}"
        inductor.register_inductor_decompositions.cache_clear()
        inductor.register_inductor_decompositions()  # once only
        assert torch.compiler.config.cache_key_tag.count("tqcompile-numerics-") == 1
    finally:
        torch.compiler.config.cache_key_tag = ""
    copy = tmp_path / "tqcompile"
    shutil.copytree(inductor._PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert inductor.numerics_key(copy) == inductor.numerics_key()
    reference = copy / "kernels" / "reference.py"
    reference.write_text(reference.read_text() + "\n# one more line\n")
    assert inductor.numerics_key(copy) != inductor.numerics_key()


def test_compile_caches_tell_quantizers_of_one_class_apart(tmp_path, monkeypatch) -> None:
    """AOTAutograd's cache key holds a tensor subclass's metadata, where torch (2.13, 2.14) hashes
    an opaque object by its type alone: an MXFP6 E3M2 weight got the graph compiled for an E2M3
    one (the same class, uint8 payloads of one shape) and dequantized with the wrong element
    format. `QuantizedTensor._stable_hash_for_caching` puts the quantizer's fields into the key."""
    from tqcompile.tensor import quantize_usages

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold cache, then warm for the second
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 3
    tensors = []
    for fmt in (tq.Format.E2M3, tq.Format.E3M2):
        qt = quantize_usages(x, None, tq.MXQuantizer(fmt), rowwise=True, columnwise=False, seed=None, group_name=None)
        tensors.append(tq.deploy.MXPackedTensor.from_quantized(qt))
    for t in tensors:
        torch.compiler.reset()
        assert torch.equal(torch.compile(lambda t: t.dequantize(), fullgraph=True)(t), t.dequantize()), t.quantizer
    assert tensors[0]._stable_hash_for_caching() != tensors[1]._stable_hash_for_caching()
    assert tensors[0]._stable_hash_for_caching() == tensors[0].detach()._stable_hash_for_caching()
