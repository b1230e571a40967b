"""The library on a CUDA GPU (every test here skips without one; run on the lent H100/H200).

- Training: every recipe's demo-GPT step under ``torch.compile(fullgraph=True)`` with inductor on
  CUDA (the Triton quantize kernels, ``torch._scaled_mm`` for FP8 per tensor / per row): one graph,
  no break or recompile, the loss goes down, and the first loss equals the CPU's within bf16
  rounding (the CPU runs the reference kernels the Triton ones match bit for bit).
- The FP8 GEMM: `tqcompile::gemm_tn` through ``torch._scaled_mm`` against the exact product.
- Deployment (`tq.compress`): the CUDA rows of `tqcompile.deploy.linear_kernel` on one layer
  (``_int_mm``, ``_weight_int8pack_mm``, tinygemm ``_weight_int4pack_mm``, ``_scaled_mm``) within
  their rounding bounds of the exact product, every preset on a bf16 Llama, inductor's generated
  code calling the kernels, a static-cache ``generate`` compiled, the INT4 tensor's state_dict.
- The FP8 KV cache (and query quantizer) on CUDA: bit for bit the calibrated model's logits.

The Triton quantize kernels against the CPU reference: tests/test_triton_kernels.py
(``test_cuda_op_matches_cpu_reference``).
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
    "int8_weight_only": "int8pack_mm",
    "int4_weight_only": "int4pack_mm",
    "fp8": "scaled_mm",
    "mxfp8": "dequantize",
    "mxfp6": "dequantize",
    "nvfp4": "dequantize",
}
# 2 x 16 tokens: M = 32 > 16 (CUDA's _int_mm) and a multiple of 16 (_scaled_mm).
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


# --- training -----------------------------------------------------------------------------------
def _gpt(recipe, device):
    from tqcompile.demo.model import GPT, GPTConfig, quantize_model

    cfg = GPTConfig(n_layer=1, d_model=128, n_head=4, mlp_hidden=512, seq_len=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    model = quantize_model(model, recipe) if recipe is not None else model
    return model.to(device), cfg


def _train(model, forward, cfg, device, steps=4):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(2)
    losses = []
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(tq.recipes.RECIPES))
def test_training_step_compiles_with_inductor_on_cuda(name):
    model, cfg = _gpt(tq.recipes.get(name), "cuda")
    counter = CompileCounter("inductor")
    losses = _train(model, torch.compile(model, backend=counter, fullgraph=True), cfg, "cuda")
    assert counter.graph_breaks == 0, counter.break_reasons
    assert counter.frame_count == 1 and counter.recompiles == 0, counter
    assert losses[-1] < losses[0] - 0.1, losses
    # The first loss (no update yet) against the CPU's eager step: the same quantized values (the
    # Triton kernels equal the reference bit for bit), GEMMs and element-wise work summed and
    # rounded in other orders; the loss is a mean of 128 cross-entropies, bf16's unit roundoff
    # (2**-8) bounds its relative difference.
    cpu_model, _ = _gpt(tq.recipes.get(name), "cpu")
    cpu_loss = _train(cpu_model, cpu_model, cfg, "cpu", steps=1)[0]
    torch.testing.assert_close(losses[0], cpu_loss, rtol=2.0**-8, atol=0.0)


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
    # bf16 output: 2**-9 relative (round to nearest; 2**-8 allowed); fp32 accumulation of 512 products.
    assert bool(((got - exact).abs() <= 2.0**-8 * exact.abs() + 2.0**-20 * magnitude).all())


# --- deployment: one layer, the kernels' bounds -----------------------------------------------------
@pytest.mark.parametrize("m", [1, 32])
@pytest.mark.parametrize("preset", ["int8", "int8_dynamic", "int8_weight_only", "int4_weight_only"])
def test_integer_kernels_are_within_rounding_of_the_exact_product_on_cuda(preset, m):
    """As tests/test_deploy.py on the CPU. `_int_mm` (M > 16) sums the codes exactly; M <= 16
    dequantizes (exact: the calibrated layer's computation). CUDA's `_weight_int8pack_mm` (M <= 16)
    takes the scales in bf16 (2**-9 relative each) and rounds its output to bf16 (2**-9). tinygemm
    dequantizes each weight to bf16 from a bf16 scale: two roundings (2**-8), then an fp32-summed
    tensor-core product rounded to bf16 (2**-9)."""
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
    if lin.tq_kernel == "int_mm" and m <= 16 or lin.tq_kernel == "int8pack_mm" and m > 16:
        assert torch.equal(deployed, calibrated)  # the dequantize path below the kernel's M
    elif lin.tq_kernel == "int_mm":
        assert bool((err <= 2.0**-8 * ((exact - b).abs() + exact.abs()) * (1 + 2.0**-7)).all())
    elif lin.tq_kernel == "int8pack_mm":
        assert bool((err <= 2.0**-9 * (magnitude + exact.abs())).all())
    else:
        assert bool((err <= 2.0**-8 * magnitude + 2.0**-9 * exact.abs()).all())


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
    if CUDA_KERNEL[preset] in ("dequantize", "int8pack_mm"):  # int8pack_mm: M = 32 dequantizes
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
        torch._dynamo.reset()
        out, code = run_and_get_code(torch.compile(m, fullgraph=True), ids)
    source = "\n".join(code)
    call = {"int_mm": "_int_mm(", "int8pack_mm": "tqcompile.dequantize", "int4pack_mm": "_weight_int4pack_mm(", "scaled_mm": "tqcompile.gemm_tn"}
    assert call[CUDA_KERNEL[preset]] in source  # int8pack_mm at M = 32: its dequantize path
    assert ("tqcompile.dequantize" in source) == (preset == "int8_weight_only")
    assert float((out.logits.float() - eager).norm() / eager.norm()) < 2.0**-6
    prompt = ids[:1, :6]
    want = m.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="static")
    counter = CompileCounter("inductor")
    torch._dynamo.reset()
    m.forward = torch.compile(m.forward, backend=counter, fullgraph=True)
    got = m.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert counter.graph_breaks == 0, counter.break_reasons
    assert torch.equal(got, want)


def test_int4_cuda_tensor_dequantizes_saves_loads_and_refuses_other_devices():
    m = _calibrated("int4_weight_only")
    lin = m.model.layers[0].mlp.down_proj
    with torch.no_grad():
        fake = lin.weight_quantizer(lin.weight).float()  # c * fp32 scale, rounded to bf16
    tq.compress(m)
    w = lin.weight
    assert isinstance(w, tq.deploy.Int4PackedCUDATensor) and w.block_size == 128
    deq = w.dequantize(torch.float32)
    # The kernel's weight: c * bf16(scale), rounded to bf16: within 2**-8 of the calibrated weight.
    assert bool(((deq - fake).abs() <= 2.0**-8 * fake.abs()).all())
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
                cache_implementation="static",
            )

    ref = generate(calibrated())
    out = generate(tq.compress(calibrated()))
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits, strict=True):
        assert torch.equal(a, b)
    layers = out.past_key_values.layers
    assert all(layer.keys.dtype == layer.values.dtype == torch.float8_e4m3fn for layer in layers)
