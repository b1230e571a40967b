"""The library on a CUDA GPU (every test here skips without one; run on the lent H100/H200).

- The FP8 GEMM: `tqcompile::gemm_tn` through ``torch._scaled_mm`` against the exact product.
- Deployment (`tq.compress`): the CUDA rows of `tqcompile.deploy.linear_kernel` on one layer
  (``_int_mm``, tinygemm ``_weight_int4pack_mm``, ``_scaled_mm``, the dequantize path) within
  their rounding bounds of the exact product, every preset on a bf16 Llama, inductor's generated
  code calling the kernels, a static-cache ``generate`` compiled, the INT4 tensor's state_dict.
- The FP8 KV cache (and query quantizer) on CUDA: bit for bit the calibrated model's logits.

Elsewhere, on CUDA too: the Triton quantize kernels against the CPU reference
(tests/test_triton_kernels.py, ``test_cuda_op_matches_cpu_reference``) and every recipe's training
step compiled with inductor (compile_tests/test_training_compile.py); benchmarks/gpu_checks.sh
runs them all.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
transformers = pytest.importorskip("transformers")

CUDA_KERNEL = {
    "int8": "int_mm",
    "int8_dynamic": "int_mm",
    "int8_weight_only": "dequantize",
    "int4_weight_only": "int4pack_mm",
    "fp8": "scaled_mm",
    "mxfp8": "dequantize",
    "mxfp6": "dequantize",
    "mxfp4_weight_only": "dequantize",
    "nvfp4": "dequantize",
}
# 2 x 16 tokens: M = 32 > 16 (CUDA's _int_mm) and a multiple of 16 (_scaled_mm).
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


# --- the FP8 GEMM -------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", [tq.Granularity.TENSORWISE, tq.Granularity.ROWWISE])
def test_fp8_gemm_runs_scaled_mm_within_its_rounding(granularity):
    from tqcompile import ops
    from tqcompile.ops.gemm import _scaled_mm_applies

    q = tq.Float8Quantizer(tq.Format.E4M3, granularity)
    torch.manual_seed(0)
    a = tq.quantize(torch.randn(256, 512, device="cuda"), q)
    b = tq.quantize(torch.randn(384, 512, device="cuda"), q)
    assert _scaled_mm_applies(a._data, a._scale_inv, q, b._data, b._scale_inv, q, torch.bfloat16)
    got = ops.gemm_tn(a._data, a._scale_inv, a._amax, q, b._data, b._scale_inv, b._amax, q, torch.bfloat16).double()
    da, db = a.dequantize(torch.float32).double(), b.dequantize(torch.float32).double()
    exact, magnitude = da @ db.t(), da.abs() @ db.abs().t()
    # The bf16 output rounds to nearest (half an ulp: at most 2**-8 relative). The sum is not
    # fp32's: Hopper's FP8 tensor cores accumulate each 32-deep MMA into a narrower accumulator
    # (about 14 bits, DeepSeek-V3's report; cuBLAS with use_fast_accum=False promotes it to fp32
    # between MMAs), so each of the K / 32 partial sums may lose 2**-14 of its magnitude. Measured
    # on an H200 (torch 2.11): max |error| / sum |a||b| = 8.7e-4 (tensorwise), 8.0e-4 (rowwise),
    # against 2**-10 = 9.8e-4 here; an fp32 sum would stay below 512 * 2**-24 = 3.1e-5.
    err = (got - exact).abs()
    bound = 2.0**-8 * exact.abs() + (512 // 32) * 2.0**-14 * magnitude
    assert bool((err <= bound).all()), float((err / magnitude).max())


# --- deployment: one layer, the kernels' bounds -----------------------------------------------------
@pytest.mark.parametrize("m", [1, 32, 300])
@pytest.mark.parametrize("preset", ["int8", "int8_dynamic", "int8_weight_only", "int4_weight_only"])
def test_integer_kernels_are_within_rounding_of_the_exact_product_on_cuda(preset, m):
    """As tests/test_deploy.py on the CPU. `_int_mm` sums the codes exactly (M <= 16: padded with
    zero rows to the 17 it needs at least). INT8 weight-only dequantizes (exact: the calibrated
    layer's computation). A bf16 rounding is within 2**-8 relative (half an ulp of 8 significant
    bits): tinygemm dequantizes each weight to bf16 from a bf16 scale (two roundings), then rounds
    an fp32-summed tensor-core product to bf16; above M = 256 the same weight
    (`Int4PackedCUDATensor.dequantize`) goes through F.linear."""
    from tqcompile.tensor import quantize_usages

    torch.manual_seed(1)
    layer = nn.Sequential(nn.Linear(256, 128)).to("cuda", torch.bfloat16)
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    tq.calibrate(layer, getattr(tq.configs, preset)(), lambda mod: mod(torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)), progress=False)
    lin = layer[0]

    def exact_operand(t, tensor_quantizer):
        if not tensor_quantizer.enabled:
            return t.double()
        qt = quantize_usages(t, None, tensor_quantizer.quantizer, rowwise=True, columnwise=False, seed=None, group_name=None, amax=tensor_quantizer.amax)
        return qt.dequantize(torch.float32).double()

    with torch.no_grad():
        xq, wq, b = exact_operand(x, lin.input_quantizer), exact_operand(lin.weight, lin.weight_quantizer), lin.bias.double()
        exact, magnitude = xq @ wq.t() + b, xq.abs() @ wq.abs().t() + b.abs()
        calibrated = layer(x)
        tq.compress(layer)
        assert lin.tq_kernel == CUDA_KERNEL[preset], lin.tq_kernel_reason
        deployed = layer(x)
    err = (deployed.double() - exact).abs()
    if lin.tq_kernel == "dequantize":
        assert torch.equal(deployed, calibrated)
    elif lin.tq_kernel == "int_mm":
        assert bool((err <= 2.0**-8 * ((exact - b).abs() + exact.abs()) * (1 + 2.0**-7)).all())
    else:
        assert bool((err <= 2.0**-7 * magnitude + 2.0**-8 * exact.abs()).all())


# --- deployment: the whole model ----------------------------------------------------------------------
def _llama():
    cfg = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval().to("cuda", torch.bfloat16)


def _calibrated(preset):
    m = _llama()
    tq.calibrate(m, getattr(tq.configs, preset)(), lambda mod: mod(IDS.cuda()), progress=False)
    return m


@pytest.mark.parametrize("preset", list(CUDA_KERNEL))
def test_every_preset_compresses_on_cuda(preset):
    m = _calibrated(preset)
    with torch.no_grad():
        ref = m(IDS.cuda()).logits.float()
    tq.compress(m)
    rows = tq.deploy.deployed_layers(m)
    assert {r.kernel for r in rows} == {CUDA_KERNEL[preset]}, {r.reason for r in rows}
    with torch.no_grad():
        out = m(IDS.cuda()).logits.float()
    if CUDA_KERNEL[preset] == "dequantize":
        assert torch.equal(out, ref)
    else:
        # bf16 logits through 2 layers whose GEMMs round (and int_mm sums) differently: each layer
        # within its bound above; the logits within 2**-5 relative (a few bf16 ulps per layer).
        assert float((out - ref).norm() / ref.norm()) < 2.0**-5


@pytest.mark.parametrize("preset", ["int8_dynamic", "int8_weight_only", "int4_weight_only", "fp8"])
def test_inductor_calls_the_kernels_and_generates_with_a_static_cache(preset):
    from torch._inductor.utils import run_and_get_code

    m = tq.compress(_calibrated(preset))
    ids = IDS.cuda()
    with torch.no_grad():
        eager = m(ids).logits.float()
        unquantized = _llama()(ids).logits.float()
        torch._dynamo.reset()
        out, code = run_and_get_code(torch.compile(m, fullgraph=True), ids)
    source = "\n".join(code)
    call = {"int_mm": "_int_mm", "dequantize": "mm", "int4pack_mm": "_weight_int4pack_mm", "scaled_mm": "tqcompile.gemm_tn"}
    assert call[CUDA_KERNEL[preset]] in source
    # INT dequantize is generated code on CUDA too (tqcompile.ops.inductor): no opaque dequantize.
    assert "torch.ops.tqcompile.dequantize" not in source  # (inductor names the op it decomposed in comments)
    # Inductor's fused bf16 element-wise code rounds otherwise than eager, and a different bf16
    # activation can take another FP8 / INT8 code: the compiled model must be as close to the eager
    # one as the eager one is to the unquantized model (its quantization error), or closer.
    assert float((out.logits.float() - eager).norm()) <= float((eager - unquantized).norm())
    prompt = ids[:1, :6]
    # disable_compile: transformers would compile static-cache decoding on CUDA itself.
    want = m.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="static", disable_compile=True)
    counter = CompileCounter("inductor")
    torch._dynamo.reset()
    m.forward = torch.compile(m.forward, backend=counter, fullgraph=True, dynamic=False)  # prefill and decode: a graph each
    got = m.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="static", disable_compile=True)
    assert counter.graph_breaks == 0, counter.break_reasons
    if preset == "fp8":  # FP8 activations: a compiled rounding can flip a code, and a near-tie token (above)
        assert got.shape == want.shape
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(64, 128), (96, 256), (128, 96), (4096, 512)])
def test_int4_cuda_layout_is_the_kernels(shape):
    """`int4_cuda.pack_words` (torch ops) writes the words `torch._convert_weight_to_int4pack`
    writes, for every inner-K-tile count the shape allows; `unpack` inverts them."""
    from tqcompile.deploy import int4_cuda

    n, k = shape
    pairs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    for ikt in (2, 4, 8):
        if k % (16 * ikt) == 0:
            assert torch.equal(int4_cuda.pack_words(pairs, ikt), torch._convert_weight_to_int4pack(pairs, ikt)), ikt
    q = tq.IntQuantizer(tq.Format.INT4, tq.Granularity.BLOCKWISE_1D, block_size=32, grid=tq.IntGrid.FULL)
    payload = tq.quantize(torch.randn(n, k, device="cuda"), q)._data
    assert torch.equal(int4_cuda.unpack(int4_cuda.pack(payload, q), q), payload)


def test_int4_cuda_tensor_dequantizes_saves_loads_and_refuses_other_devices():
    m = _calibrated("int4_weight_only")
    lin = m.model.layers[0].mlp.down_proj
    with torch.no_grad():
        fake = lin.weight_quantizer(lin.weight).float()  # c * fp32 scale, rounded to bf16
    tq.compress(m)
    w = lin.weight
    assert isinstance(w, tq.deploy.Int4PackedCUDATensor) and w.block_size == 128
    # dequantize (torch ops on tq's codes) is the weight the kernel computes with, bit for bit:
    # the identity matrix through the kernel gives each weight times 1.0.
    eye = torch.eye(w.shape[1], dtype=torch.bfloat16, device="cuda")
    assert torch.equal(w.dequantize(), torch._weight_int4pack_mm(eye, w._data, w.block_size, w._scale_inv).t())
    deq = w.dequantize(torch.float32)
    # The kernel's weight c * bf16(scale), rounded to bf16, against the calibrated bf16(c * scale):
    # three roundings to bf16 (the scale, the kernel's product, the calibrated product), each
    # within 2**-8 relative. Measured on an H200: 5.95e-3 at most (this bound: 1.17e-2).
    assert bool(((deq - fake).abs() <= 3 * 2.0**-8 * fake.abs()).all()), float(((deq - fake).abs() / fake.abs()).nan_to_num().max())
    with torch.no_grad():
        ref = m(IDS.cuda()).logits
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    other = tq.compress(_calibrated("int4_weight_only"))
    with torch.no_grad():
        for p in other.parameters():
            if not isinstance(p, tq.QuantizedTensor):
                p.mul_(0.5)
    other.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(other(IDS.cuda()).logits, ref)
    with pytest.raises(NotImplementedError, match="CUDA kernel"):
        w.to("cpu")


# --- the FP8 KV cache ----------------------------------------------------------------------------------
@pytest.mark.parametrize("query", [False, True], ids=["kv", "kv+query"])
@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
def test_fp8_kv_cache_on_cuda_computes_what_the_calibrated_model_computes(per_head, query):
    from tqcompile.calibration import QuantConfig

    def calibrated():
        model = _llama()
        rule = tq.configs.fp8_kv_cache(per_head=per_head, query=query) if query else tq.configs.fp8_kv_cache(per_head=per_head)
        tq.calibrate(model, QuantConfig((rule,)), lambda mod: mod(IDS.cuda()), progress=False)
        return model

    def generate(model):
        with torch.no_grad():
            return model.generate(
                IDS[:1, :8].cuda(), max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
                cache_implementation="static", disable_compile=True,  # eager: transformers compiles static-cache decoding on CUDA
            )

    ref = generate(calibrated())
    out = generate(tq.compress(calibrated()))
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits, strict=True):
        assert torch.equal(a, b)
    layers = out.past_key_values.layers
    assert all(layer.keys.dtype == layer.values.dtype == torch.float8_e4m3fn for layer in layers)


# --- MoE experts --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("preset", ["int8", "int4_weight_only", "fp8", "mxfp4_weight_only", "nvfp4"])
def test_moe_experts_compress_and_compile_on_cuda(kind, preset):
    """bf16 MoE experts on CUDA: FP8 runs one `torch._scaled_grouped_mm` a GEMM (within 2^-5 of
    the calibrated logits, whose operands are rounded to bf16 first; the GEMM's own bound:
    `test_fp8_experts_gemm_is_within_its_rounding_on_cuda`), every other format its packed weights
    dequantized per call (whole at prefill, the routed experts' at decode; the GEMM bf16
    `torch._grouped_mm`, as the calibrated model's): the calibrated logits bit for bit, prefill and
    decode steps (1 and 3 tokens); compiled with inductor, one graph, within 2^-5 of eager."""
    from moe_models import tiny_hf_moe

    def model():
        return tiny_hf_moe(kind, num_experts=8, layers=1, hidden=128, intermediate=128).to("cuda", torch.bfloat16)

    keep = tq.calibration.QuantRule.disable(module_types=(nn.Linear,), must_match=False)  # the experts alone
    m = model()
    tq.calibrate(m, getattr(tq.configs, preset)().with_rules(keep), lambda mm: mm(IDS.cuda() % 128), progress=False)
    steps = [IDS.cuda() % 128, torch.tensor([[5]], device="cuda"), torch.tensor([[5], [9], [77]], device="cuda")]
    with torch.no_grad():
        refs = [m(ids).logits for ids in steps]
    tq.compress(m)
    rows = [r for r in tq.deploy.deployed_layers(m) if r.name.endswith("_gemm")]
    kernel = "scaled_grouped_mm" if preset == "fp8" else "dequantize"
    assert len(rows) == 2 and {r.kernel for r in rows} == {kernel}, {r.reason for r in rows}
    with torch.no_grad():
        for ids, ref in zip(steps, refs):
            out = m(ids).logits
            if kernel == "dequantize":
                assert torch.equal(out, ref)
            else:
                assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2.0**-5
        counter = CompileCounter("inductor")
        torch._dynamo.reset()
        out = torch.compile(m, backend=counter, fullgraph=True)(steps[0])
    assert counter.frame_count == 1 and counter.graph_breaks == 0, counter.break_reasons
    # Inductor's fused bf16 element-wise code rounds otherwise than eager, and a bf16 ulp of an
    # activation near its amax is half an INT8 step: W8A8's codes move (measured on the H200:
    # compiled - eager 0.0765 in L2, the quantization error 0.0755, int8 Mixtral). The bound of
    # bf16 kernels against the calibrated logits (test_every_preset_compresses_on_cuda): 2^-5.
    eager = refs[0].float()
    assert float((out.logits.float() - eager).norm() / eager.norm()) < 2.0**-5


@pytest.mark.parametrize("weight_rows", [False, True], ids=["per-tensor", "per-row"])
@pytest.mark.parametrize("counts", [[3, 0, 1, 7, 15, 2, 0, 4], [0, 0, 1, 0, 0, 1, 0, 0], [40, 0, 0, 0, 0, 0, 0, 33]], ids=["uneven", "decode", "two"])
def test_fp8_experts_gemm_is_within_its_rounding_on_cuda(counts, weight_rows):
    """A deployed FP8 experts GEMM (`scaled_grouped_mm`: one `torch._scaled_grouped_mm`, segments of
    any length, empty ones too) against the exact product of each row's expert's quantized
    operands: the dense FP8 GEMM's bound (bf16 rounding plus Hopper's FP8 accumulation, K / 32
    partial sums each losing 2^-14; `test_fp8_gemm_runs_scaled_mm_within_its_rounding`)."""
    from moe_models import tiny_hf_moe
    from test_deploy_experts import exact_input, exact_weight

    from tqcompile.calibration import QuantConfig, QuantRule
    from tqcompile.ops import grouped_gemm as gops

    q = tq.Float8Quantizer(tq.Format.E4M3, tq.Granularity.ROWWISE if weight_rows else tq.Granularity.TENSORWISE)
    fp8 = QuantRule(module_types=tq.configs.GEMM_LAYERS, input=tq.Float8Quantizer(tq.Format.E4M3), weight=q)
    keep = QuantRule.disable(module_types=(nn.Linear,), must_match=False)
    m = tiny_hf_moe("mixtral", num_experts=8, layers=1, hidden=128, intermediate=128).to("cuda", torch.bfloat16)
    tq.calibrate(m, QuantConfig((fp8, keep)), lambda mm: mm(IDS.cuda() % 128), progress=False)
    ex = m.model.layers[0].mlp.experts
    unit = ex._modules["gate_up_proj_gemm"]
    counts = torch.tensor(counts, device="cuda")
    ends = torch.cumsum(counts, 0)
    x = torch.randn(int(counts.sum()), 128, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        xq, wq = exact_input(unit.input_quantizer, x, ends), exact_weight(unit.weight_quantizer, unit.weight)
        ids = gops.expert_ids(ends, x.shape[0])
        exact = torch.einsum("rk,rnk->rn", xq, wq[ids])
        magnitude = torch.einsum("rk,rnk->rn", xq.abs(), wq[ids].abs())
        tq.compress(m)
        assert unit.tq_kernel == "scaled_grouped_mm"
        got = ex._expert_gemm(0, x, counts).double()
    bound = 2.0**-8 * exact.abs() + (128 // 32) * 2.0**-14 * magnitude
    assert bool(((got - exact).abs() <= bound).all()), float(((got - exact).abs() / magnitude).max())


@pytest.mark.parametrize("name", ["fp8_rowwise", "fp8_tensorwise"])
def test_fp8_experts_train_on_cuda_with_the_grouped_gemm(name, monkeypatch):
    """FP8 experts training on CUDA (`tq.nn.GroupedLinear`, bf16 autocast): fprop (and dgrad with
    E4M3 gradients) run `torch._scaled_grouped_mm`; y, dx and dW against the CPU's per-expert
    loop of the same layer within the FP8 GEMM's bound (relative L2 2^-7), uneven counts."""
    calls, real = [], torch._scaled_grouped_mm

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    torch.manual_seed(0)
    e, k, n = 4, 128, 256
    layer = tq.nn.GroupedLinear(e, k, n, recipe=tq.recipes.get(name), dtype=torch.bfloat16)
    counts = torch.tensor([32, 0, 5, 27])
    g = torch.Generator().manual_seed(9)
    x, dy = torch.randn(64, k, generator=g).bfloat16(), torch.randn(64, n, generator=g).bfloat16()

    def step(layer, device):
        xr = x.to(device).detach().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = layer(xr, counts.to(device))
        y.backward(dy.to(device))
        out = (y.detach().cpu().double(), xr.grad.cpu().double(), layer.weight.grad.cpu().double())
        layer.zero_grad()
        return out

    ref = step(layer, "cpu")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", counted)
    got = step(layer.to("cuda"), "cuda")
    assert calls == ([64, 64] if name == "fp8_rowwise" else [64])
    for what, a, b in zip(("y", "dx", "dW"), got, ref):
        assert float((a - b).norm() / b.norm()) < 2.0**-7, what


def test_qat_experts_backward_through_the_bf16_grouped_gemm_on_cuda(monkeypatch):
    """QAT of fake-quantized MoE experts on CUDA (Hopper/Blackwell: `cuda_grouped_gemms`): the
    forward and the dgrad of each expert GEMM one real `torch._grouped_mm` (2 layers x 2 GEMMs x 2
    = 8 calls), logits and every expert weight's gradient against the CPU's per-expert loop of the
    same calibrated model within one bf16 ulp (relative L2 2^-7)."""
    from moe_models import tiny_hf_moe

    from tqcompile.ops import grouped_gemm as gops

    if not gops.cuda_grouped_gemms(torch.device("cuda")):
        pytest.skip("torch._grouped_mm needs sm_90 or sm_100")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    keep = tq.calibration.QuantRule.disable(module_types=(nn.Linear,), must_match=False)  # the experts alone
    m = tiny_hf_moe("mixtral", num_experts=4, hidden=128, intermediate=128).to(torch.bfloat16)
    tq.calibrate(m, tq.configs.int8_weight_only().with_rules(keep), lambda mm: mm(ids), progress=False)
    m.train()

    def step(device):
        m.zero_grad()
        out = m(ids.to(device)).logits.float()
        out.square().mean().backward()
        return out.detach().cpu(), {n: p.grad.float().cpu() for n, p in m.named_parameters() if "experts" in n and p.grad is not None}

    ref = step("cpu")
    m.to("cuda")
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    got = step("cuda")
    assert len(calls) == 8, calls
    assert ref[1].keys() == got[1].keys() and len(ref[1]) == 4
    for what, a, b in [("logits", got[0], ref[0]), *((k, got[1][k], ref[1][k]) for k in ref[1])]:
        assert float((a - b).norm() / b.norm()) <= 2.0**-7, what


# --- a checkpoint loaded straight into its deployment form on the GPU ----------------------------
@pytest.mark.parametrize("preset", ["int4_weight_only", "int8_dynamic", "fp8", "moe fp8"])
def test_compressed_load_onto_the_gpu(preset, tmp_path):
    """`tq.load_exported(path, compress=True, device="cuda")`: the model made on the GPU layer by
    layer (never in float as a whole), packed for CUDA's kernels: the kernels and logits of a load,
    a move to the GPU and `tq.compress` there, bit for bit."""
    from moe_models import tiny_hf_moe

    if preset == "moe fp8":
        m = tiny_hf_moe("mixtral", num_experts=4, hidden=128, intermediate=128).to(torch.bfloat16)
        config = tq.configs.fp8()
    else:
        m, config = _llama().cpu(), getattr(tq.configs, preset)()
    tq.calibrate(m, config, lambda mm: mm(IDS % 128), progress=False)
    tq.export(m, str(tmp_path))
    ref = tq.compress(tq.load_exported(str(tmp_path), dtype=torch.bfloat16).to("cuda"))
    got = tq.load_exported(str(tmp_path), dtype=torch.bfloat16, compress=True, device="cuda")
    assert [(r.name, r.kernel) for r in tq.deploy.deployed_layers(got)] == [(r.name, r.kernel) for r in tq.deploy.deployed_layers(ref)]
    assert all(t.device.type == "cuda" for t in (*got.parameters(), *got.buffers()))
    with torch.no_grad():
        assert torch.equal(got(IDS.cuda() % 128).logits, ref(IDS.cuda() % 128).logits)
