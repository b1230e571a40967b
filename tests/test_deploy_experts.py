"""tq.compress on MoE experts with the CPU's integer kernels (tqcompile.deploy.experts_mm).

INT8 weight-only, INT4 weight-only and W8A8 experts GEMMs call the dense layers' CPU kernels once
per expert that has rows: the numerics of those kernels (the bound of
tests/test_deploy.py::test_integer_kernels_are_within_rounding_of_the_exact_product, per expert),
a decoding step calls only the routed experts, the same on every routing under fullgraph compile,
and the packed bytes are what the model holds.
"""

from __future__ import annotations

import io

import pytest
import torch
from moe_models import tiny_hf_moe
from torch import nn

import tqcompile as tq
from tqcompile.deploy import experts_mm
from tqcompile.deploy.kernels import experts_kernel
from tqcompile.ops import grouped_gemm as gops

pytest.importorskip("transformers")

KERNEL = {"int8_weight_only": "int8pack_mm", "int4_weight_only": "int4pack_mm", "int8": "int_mm", "int8_dynamic": "int_mm"}
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def experts_only(preset: str):
    keep = tq.calibration.QuantRule.disable(module_types=(nn.Linear,), must_match=False)  # the experts alone
    return getattr(tq.configs, preset)().with_rules(keep)


def calibrated_moe(kind: str, preset: str, dtype=torch.float32) -> nn.Module:
    # hidden and intermediate 128: the INT4 kernel's blocks of 128 along K, N % 64 == 0
    m = tiny_hf_moe(kind, num_experts=8, layers=1, hidden=128, intermediate=128).to(dtype)
    tq.calibrate(m, experts_only(preset), lambda mm: mm(IDS), progress=False)
    return m


def experts_of(m: nn.Module) -> nn.Module:
    return m.model.layers[0].mlp.experts


def exact_input(tensor_quantizer, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The experts input's codes as the calibrated model quantizes them (`fake_quantize_grouped`:
    from the bf16 rows), times their fp32 scales, in fp64; weight-only: the input itself."""
    q, amax = tensor_quantizer.quantizer, tensor_quantizer.amax
    if q is None:
        return x.double()
    if amax is None and q.uses_tensor_amax():
        amax = gops.grouped_amax(x, q, ends, False)
    data, scale_inv = gops.grouped_quantize(x, q, ends, amax, None, False)
    return gops.grouped_dequantize(data, scale_inv, amax, q, ends, torch.float32).double()


def exact_weight(tensor_quantizer, w: torch.Tensor) -> torch.Tensor:
    """The (E, N, K) weight's codes times their fp32 scales, in fp64."""
    from tqcompile.tensor import quantize_usages

    q, amax = tensor_quantizer.quantizer, tensor_quantizer.amax
    qt = quantize_usages(w.contiguous(), None, q, rowwise=True, columnwise=False, seed=None, group_name=None, amax=amax)
    return qt.dequantize(torch.float32).double()


# --- one experts GEMM against the exact product ------------------------------------------------
@pytest.mark.parametrize("preset", list(KERNEL))
def test_each_expert_is_within_the_dense_kernels_bound(preset):
    """bf16 Mixtral experts, the gate/up GEMM, rows routed 3 / 0 / 1 / 70 / 150 / ...: each row
    against the exact (fp64) product of its expert's quantized operands (codes times fp32 scales),
    within the dense kernels' bound: weight-only 2^-9 (sum |x||w| + |y|) through the kernel, a
    segment above its token bound (70 rows INT8, 150 INT4) the dequantized expert's GEMM (INT8:
    the calibrated rows bit for bit; INT4 the kernel's weight, 2^-8 sum |x||w| + 2^-9 |y|); W8A8
    the bf16 output's rounding, 2^-8 (2 |y|)(1 + 2^-7), and an L2 error at most the calibrated GEMM's."""
    m = calibrated_moe("mixtral", preset, torch.bfloat16)
    ex = experts_of(m)
    unit = ex._modules["gate_up_proj_gemm"]
    counts = torch.tensor([3, 0, 1, 70, 150, 2, 0, 4])
    ends = torch.cumsum(counts, 0)
    x = torch.randn(int(counts.sum()), 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        xq, wq = exact_input(unit.input_quantizer, x, ends), exact_weight(unit.weight_quantizer, unit.weight)
        ids = gops.expert_ids(ends, x.shape[0])
        exact = torch.einsum("rk,rnk->rn", xq, wq[ids])
        magnitude = torch.einsum("rk,rnk->rn", xq.abs(), wq[ids].abs())
        calibrated = ex._expert_gemm(0, x, counts)
        tq.compress(m)
        assert unit.tq_kernel == KERNEL[preset]
        deployed = ex._expert_gemm(0, x, counts)
    err, cal_err = (deployed.double() - exact).abs(), (calibrated.double() - exact).abs()
    if KERNEL[preset] == "int_mm":
        # + 2^-22 sum |x||w|: the reference's operands are codes times scales rounded to fp32 (a
        # row whose integer sum is 0 gives exactly 0 here and 1e-9 there).
        assert bool((err <= 2.0**-8 * 2 * exact.abs() * (1 + 2.0**-7) + 2.0**-22 * magnitude).all())
        assert float(err.norm()) <= float(cal_err.norm())
        return
    big = (ids == 3) | (ids == 4)  # the 70- and 150-row segments
    small = ~big
    assert bool((err[small] <= 2.0**-9 * (magnitude[small] + exact.abs()[small])).all())
    if preset == "int8_weight_only":
        assert torch.equal(deployed[big], calibrated[big])
    else:  # 70 rows: the kernel (bound 128); 150: the kernel's weight in a GEMM
        assert bool((err[ids == 3] <= 2.0**-9 * (magnitude + exact.abs())[ids == 3]).all())
        assert bool((err[ids == 4] <= 2.0**-8 * magnitude[ids == 4] + 2.0**-9 * exact.abs()[ids == 4]).all())


# --- whole models -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("preset", list(KERNEL))
def test_moe_models_run_the_kernels_on_the_routed_experts(kind, preset, monkeypatch):
    """float32 (the kernels' scales exact): prefill, one token and three tokens decode to the
    calibrated logits within 1e-5; a decoding step calls each GEMM's kernel for its routed experts
    only; compiled fullgraph (aot_eager) computes the eager logits bit for bit with one graph."""
    m = calibrated_moe(kind, preset)
    steps = [IDS, torch.tensor([[5]]), torch.tensor([[5], [9], [77]])]
    with torch.no_grad():
        refs = [m(ids).logits for ids in steps]
    tq.compress(m)
    rows = [r for r in tq.deploy.deployed_layers(m) if r.name.endswith("_gemm")]
    assert [r.kernel for r in rows] == [KERNEL[preset]] * 2
    kernel_fn = {"int8pack_mm": "_weight_int8pack_mm", "int4pack_mm": "_weight_int4pack_mm_for_cpu", "int_mm": "_int_mm"}[KERNEL[preset]]
    rows_per_call, real = [], getattr(torch, kernel_fn)
    monkeypatch.setattr(torch, kernel_fn, lambda a, *rest: rows_per_call.append(a.shape[0]) or real(a, *rest))
    monkeypatch.setattr(experts_mm, "_expert_dequantized", lambda *a: pytest.fail("no segment is above the kernels' bound here"))
    with torch.no_grad():
        outs = []
        for ids, ref in zip(steps, refs):
            rows_per_call.clear()
            outs.append(m(ids).logits)
            assert float((outs[-1] - ref).norm() / ref.norm()) < 1e-5
            # Two GEMMs, each a call per expert with rows: top 2 of 8 experts for each token.
            assert sum(rows_per_call) == 2 * 2 * ids.numel() and len(rows_per_call) <= 2 * min(8, 2 * ids.numel())
            if ids.numel() == 1:  # one token: its two experts, a row each, in both GEMMs
                assert rows_per_call == [1, 1, 1, 1]
        monkeypatch.undo()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(m)(steps[2])
        assert explained.graph_count == 1 and explained.graph_break_count == 0
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
        for ids, out in zip(steps, outs):
            assert torch.equal(compiled(ids).logits, out)


@pytest.mark.parametrize("preset", ["int4_weight_only", "int8_weight_only"])
def test_state_dict_of_packed_experts_loads(preset):
    """The packed experts (INT4 in the kernel's layout, (E, N, K / 2); INT8 codes and the kernel's
    (E, N) scales) save and load into another compressed model of the same calibration."""
    m = calibrated_moe("gpt_oss", preset)
    amaxes = tq.quant_state(m)
    tq.compress(m)
    w = experts_of(m)._parameters["down_proj"]
    if preset == "int4_weight_only":
        assert isinstance(w, tq.deploy.Int4PackedCPUTensor) and tuple(w._data.shape) == (8, 128, 64)
        assert tuple(w._scale_inv.shape) == (8, 1, 128, 2)  # K / 128 blocks, N, scale and zero
    else:
        assert tuple(experts_of(m).down_proj_kernel_scale.shape) == (8, 128)
    with torch.no_grad():
        ref = m(IDS).logits
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    other = tiny_hf_moe("gpt_oss", num_experts=8, layers=1, hidden=128, intermediate=128, seed=5)
    tq.compress(tq.restore(other, amaxes))
    with torch.no_grad():
        assert not torch.equal(other(IDS).logits, ref)  # other weights until the state_dict brings ours
    other.load_state_dict(torch.load(buf, weights_only=True))
    with torch.no_grad():
        assert torch.equal(other(IDS).logits, ref)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])  # GPT-OSS's transposed experts export as MXFP4 only
def test_exported_experts_load_and_run_the_kernels(kind, tmp_path):
    """A W4A16 MoE checkpoint (compressed-tensors) read back by `tq.load_exported` compresses to
    the INT4 experts kernel and computes the loaded model's logits (float32: within 1e-5)."""
    tq.export(calibrated_moe(kind, "int4_weight_only"), tmp_path)
    loaded = tq.load_exported(tmp_path)
    with torch.no_grad():
        ref = loaded(IDS).logits
    tq.compress(loaded)
    assert [r.kernel for r in tq.deploy.deployed_layers(loaded)] == ["int4pack_mm"] * 2
    with torch.no_grad():
        out = loaded(IDS).logits
    assert float((out - ref).norm() / ref.norm()) < 1e-5


def test_int4_experts_dequantize_to_each_experts_kernel_weight():
    """An (E, N, K) INT4 kernel tensor's `dequantize` is, expert by expert, the 2-D kernel
    tensor's, which the kernel computes with."""
    q = tq.IntQuantizer(tq.Format.INT4, tq.Granularity.BLOCKWISE_1D, block_size=64)
    w = torch.randn(3, 64, 128)
    from tqcompile.tensor import quantize_usages

    qt = quantize_usages(w, None, q, rowwise=True, columnwise=False, seed=None, group_name=None, amax=None)
    packed = tq.deploy.Int4PackedCPUTensor.from_quantized(qt, 64)
    x = torch.randn(5, 128)
    for e in range(3):
        one = tq.deploy.Int4PackedCPUTensor.from_quantized(quantize_usages(w[e], None, q, rowwise=True, columnwise=False, seed=None, group_name=None, amax=None), 64)
        assert torch.equal(packed._data[e], one._data) and torch.equal(packed._scale_inv[e], one._scale_inv)
        assert torch.equal(packed.dequantize()[e], one.dequantize())
        torch.testing.assert_close(x @ one.dequantize().t(), torch._weight_int4pack_mm_for_cpu(x, one._data, 64, one._scale_inv), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.dequantize(), qt.dequantize())  # fp32 scales: the kernel's weight is the calibrated one


def test_the_experts_kernel_rule():
    int8 = tq.IntQuantizer(tq.Format.INT8, tq.Granularity.ROWWISE)
    int4 = tq.IntQuantizer(tq.Format.INT4, tq.Granularity.BLOCKWISE_1D, block_size=128)
    assert experts_kernel(int8, None, (8, 128, 256), "cpu")[0] == "int8pack_mm"
    assert experts_kernel(int8, int8, (8, 128, 256), "cpu")[0] == "int_mm"
    assert experts_kernel(int4, None, (8, 128, 256), "cpu")[0] == "int4pack_mm"
    kernel, why = experts_kernel(int4, None, (8, 96, 256), "cpu")  # the INT4 kernel wants N % 64
    assert kernel == "dequantize" and "no per-expert kernel" in why
    assert experts_kernel(int4, None, (8, 128, 256), "cuda")[0] == "dequantize"  # CPU only (no grouped CUDA path yet)
    assert experts_kernel(tq.Float8Quantizer(), tq.Float8Quantizer(), (8, 128, 256), "cpu")[0] == "dequantize"
    with pytest.raises(ValueError, match="kernel='int_mm'; allowed"):
        experts_mm.experts_weight_only_mm(torch.randn(2, 8), torch.zeros(1, 4, 8, dtype=torch.int8), torch.ones(1, 4), torch.ones(1, 4, 1), int8, torch.tensor([2]), "int_mm", 64)


@pytest.mark.parametrize("preset, algorithm", [("int4_weight_only", "gptq"), ("int4_weight_only", "awq"), ("int8", "smoothquant")])
def test_experts_made_by_the_ptq_algorithms_run_the_kernels(preset, algorithm):
    """GPTQ's rounded expert weights, AWQ's and SmoothQuant's folded scales: the compressed experts
    run the integer kernels and compute the calibrated logits (float32: within 1e-5)."""
    m = tiny_hf_moe("mixtral", num_experts=8, layers=1, hidden=128, intermediate=128)
    tq.calibrate(m, experts_only(preset), lambda mm: mm(IDS), algorithm=algorithm, progress=False)
    with torch.no_grad():
        ref = m(IDS).logits
        tq.compress(m)
        out = m(IDS).logits
    assert [r.kernel for r in tq.deploy.deployed_layers(m)] == [KERNEL[preset]] * 2
    assert float((out - ref).norm() / ref.norm()) < 1e-5


# --- FP8 experts on CUDA's grouped FP8 GEMM (the op replaced by its exact product here) ----------
def _exact_scaled_grouped_mm(calls):
    """`torch._scaled_grouped_mm`'s contract, exactly: a (T, K) and b (E, K, N) E4M3 codes, scale_a
    (T,) and scale_b (E, N) fp32, token segments `offs`; the fp64 product rounded once."""

    def op(a, b, scale_a, scale_b, offs=None, out_dtype=None, **_):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and scale_a.shape == a.shape[:1] and scale_b.shape == (b.shape[0], b.shape[2])
        assert b.stride(-2) == 1  # column-major per expert, as CUDA's kernel wants
        calls.append(a.shape[0])
        ids = gops.expert_ids(offs.long(), a.shape[0])
        w = b.double() * scale_b.double()[:, None, :]
        return torch.einsum("tk,tkn->tn", a.double() * scale_a.double()[:, None], w[ids]).to(out_dtype)

    return op


@pytest.mark.parametrize("weight_rows", [False, True], ids=["per-tensor", "per-row"])
def test_fp8_experts_run_one_scaled_grouped_mm_on_hopper(weight_rows, monkeypatch):
    """Where CUDA's grouped FP8 GEMM runs (Hopper/Blackwell: `cuda_grouped_gemms`, patched true
    here, with the op as its exact contract), FP8 E4M3 experts take ``scaled_grouped_mm``: one call
    a GEMM, each row's input codes as calibrated times its expert's (or its own) scale and the
    weight's (E, N) scales; every row of a bf16 experts GEMM within the output's rounding (2^-8
    |y|) of the exact product of its expert's quantized operands, and the logits within 2^-5 of
    the calibrated model's (whose operands are rounded to bf16 first), compiled as eager. On the
    GPU: tests/test_cuda.py::test_moe_experts_compress_and_compile_on_cuda."""
    calls = []
    monkeypatch.setattr(gops, "cuda_grouped_gemms", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _exact_scaled_grouped_mm(calls), raising=False)
    from tqcompile.calibration import QuantConfig, QuantRule

    q = tq.Float8Quantizer(tq.Format.E4M3, tq.Granularity.ROWWISE if weight_rows else tq.Granularity.TENSORWISE)
    fp8 = QuantRule(module_types=tq.configs.GEMM_LAYERS, input=tq.Float8Quantizer(tq.Format.E4M3), weight=q)
    keep = QuantRule.disable(module_types=(nn.Linear,), must_match=False)  # the experts alone
    m = tiny_hf_moe("mixtral", num_experts=8, layers=1, hidden=128, intermediate=128).to(torch.bfloat16)
    tq.calibrate(m, QuantConfig((fp8, keep)), lambda mm: mm(IDS), progress=False)
    ex = experts_of(m)
    unit = ex._modules["gate_up_proj_gemm"]
    counts = torch.tensor([3, 0, 1, 7, 15, 2, 0, 4])
    ends = torch.cumsum(counts, 0)
    x = torch.randn(int(counts.sum()), 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    steps = [IDS, torch.tensor([[5]]), torch.tensor([[5], [9], [77]])]
    with torch.no_grad():
        xq, wq = exact_input(unit.input_quantizer, x, ends), exact_weight(unit.weight_quantizer, unit.weight)
        ids = gops.expert_ids(ends, x.shape[0])
        exact = torch.einsum("rk,rnk->rn", xq, wq[ids])
        refs = [m(i).logits.float() for i in steps]
        tq.compress(m)
        assert [r.kernel for r in tq.deploy.deployed_layers(m) if r.name.endswith("_gemm")] == ["scaled_grouped_mm"] * 2
        calls.clear()
        deployed = ex._expert_gemm(0, x, counts)
        assert calls == [x.shape[0]]
        assert bool(((deployed.double() - exact).abs() <= 2.0**-8 * exact.abs()).all())
        outs = [m(i).logits.float() for i in steps]
        for out, ref in zip(outs, refs):
            assert float((out - ref).norm() / ref.norm()) < 2.0**-5
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
        for i, out in zip(steps, outs):
            assert torch.equal(compiled(i).logits.float(), out)

