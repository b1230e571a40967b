"""PTQ of MoE experts as users' models hold them (fused 3-D weights): tiny Mixtral, Qwen3-MoE and
GPT-OSS built from configs, and a torchtitan-style MoE (tests/moe_models.py).

Every preset calibrates them with per-expert amaxes (weights `[E, 1, 1]` or per expert and unit,
inputs `[E]`), lists each expert GEMM in `tq.summary`, round-trips `tq.quant_state`/`tq.restore`
(loaded with weights_only=True) bit for bit, and keeps the logits within a stated SQNR of the
float model. Calibration runs the experts' routing itself, so it sees every expert's tokens
whatever `experts_implementation` the model uses; an expert no token reached gets a finite amax
and a `CalibrationWarning`.

SQNR floors (dB, logits of the fake-quantized model against the float model, 2 calibration
batches of 2x16 tokens, `max`, another test batch; benchmarks/bench_moe_ptq.py prints the table):

| model | int8 | fp8 | int4_weight_only(32) | mxfp8 | nvfp4 |
|---|---|---|---|---|---|
| Mixtral | 34.7 | 26.9 | 17.7 | 25.7 | 17.0 |
| Qwen3-MoE | 34.6 | 25.9 | 16.8 | 25.3 | 15.2 |
| GPT-OSS | 40.2 | 30.5 | 15.6 | 18.1 | 18.7 |
| torchtitan-style | 29.6 | 24.0 | 18.9 | 20.6 | 13.2 |
| Llama, dense, same sizes | 35.4 | 27.5 | 19.8 | 27.4 | 16.8 |
| Qwen3, dense, same sizes | 34.9 | 24.7 | 17.0 | 24.4 | 15.0 |

The MoE models sit where the dense ones do (the dense models of tests/test_ptq_newuser.py have
floors int8 30, fp8 24, int4 20, mxfp8 22, nvfp4 12; the 3-layer MLP of docs/ptq.md gives 32.0,
24.4, 18.7, 21.7, 12.8). Floors: 3 dB under the lowest figure of each preset.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from moe_models import HF_MOE_KINDS, TitanMoEModel, tiny_hf_moe

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning, ExpertGemmQuantizers, QuantConfig
from tqcompile.testing import sqnr

pytest.importorskip("transformers")

KINDS = (*HF_MOE_KINDS, "titan")
EXPERTS_CLASS = {"mixtral": "MixtralExperts", "qwen3_moe": "Qwen3MoeExperts", "gpt_oss": "GptOssExperts", "titan": "GroupedExperts"}
PRESETS = {
    "int8": (tq.configs.int8, 26.5),
    "fp8": (tq.configs.fp8, 21.0),
    "int4_weight_only": (lambda: tq.configs.int4_weight_only(32), 12.5),
    "mxfp8": (tq.configs.mxfp8, 15.0),
    "nvfp4": (tq.configs.nvfp4, 10.0),
}


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    return TitanMoEModel(seed=seed).eval() if kind == "titan" else tiny_hf_moe(kind, seed=seed)


def batches(kind: str, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "titan":
        return [torch.randn(2, 16, 64, generator=g) for _ in range(n)]
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def run(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def experts_units(model) -> dict[str, ExpertGemmQuantizers]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ExpertGemmQuantizers)}


def calibrate(model, config, data, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)  # GPT-OSS leaves an expert unrouted: tested below
        return tq.calibrate(model, config, lambda m: [m(x) for x in data], progress=False, **kw)


def expected_weight_amax_shape(unit: ExpertGemmQuantizers, q) -> tuple[int, ...] | None:
    e, n, k = unit.weight.shape
    if isinstance(q, tq.MXQuantizer):
        return None  # block scales from each block
    if q.uses_tensor_amax():
        return (e, 1, 1)
    return tuple(q.scale_shape((e, n, k)))


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("kind", KINDS)
def test_presets_quantize_fused_experts_per_expert_and_round_trip(kind, preset):
    make_config, floor = PRESETS[preset]
    model = build(kind)
    float_keys = list(model.state_dict())
    cal, test = batches(kind, 2, 1), batches(kind, 1, 7)[0]
    with torch.no_grad():
        ref = run(model, test)
    calibrate(model, make_config(), cal)

    units = experts_units(model)
    gemms = 3 if kind == "titan" else 2
    assert len(units) == 2 * gemms, sorted(units)  # two MoE layers
    rows = {r.name: r for r in tq.summary(model).rows}
    for name, unit in units.items():
        assert rows[name].kind == "Experts" and rows[name].module_class == EXPERTS_CLASS[kind]
        wq, iq = unit.weight_quantizer, unit.input_quantizer
        assert wq.enabled and rows[name].weight != "off"
        want = expected_weight_amax_shape(unit, wq.quantizer)
        assert (None if wq.amax is None else tuple(wq.amax.shape)) == want, (name, wq)
        if iq.enabled and iq.static_kind == "tensor":
            assert iq.amax.shape == (4,) and bool(torch.isfinite(iq.amax).all()) and bool((iq.amax > 0).all())
        assert iq.enabled == (preset != "int4_weight_only")
    assert list(model.state_dict()) == float_keys  # the quantizers hold no persistent state

    with torch.no_grad():
        out = run(model, test)
    got = sqnr(ref, out)
    assert got >= floor, f"{kind} {preset}: {got:.1f} dB < {floor}"

    buf = io.BytesIO()
    torch.save({"quant": tq.quant_state(model), "weights": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = tq.restore(build(kind, seed=1), saved["quant"])
    fresh.load_state_dict(saved["weights"])
    with torch.no_grad():
        assert torch.equal(run(fresh, test), out)
    for name, unit in experts_units(fresh).items():
        for slot, t in unit.quantizers().items():
            mine = units[name].quantizers()[slot]
            assert t.quantizer == mine.quantizer and (t.amax is None) == (mine.amax is None)


def test_gpt_oss_transposed_weights_get_per_expert_units_in_the_gemm_view():
    """GPT-OSS stores (E, in, out): the amax is per expert on dim 0 and the per-channel units are
    the GEMM's output channels (out), not the storage's last dim."""
    model = tiny_hf_moe("gpt_oss")
    calibrate(model, tq.configs.int8(), batches("gpt_oss", 1, 0))
    unit = experts_units(model)["model.layers.0.mlp.experts.gate_up_proj_gemm"]
    stored = unit.owner.gate_up_proj
    e, h, two_i = stored.shape
    assert unit.weight.shape == (e, two_i, h) and unit.weight_quantizer.amax.shape == (e, two_i, 1)
    assert torch.equal(unit.weight_quantizer.amax.flatten(1), stored.detach().abs().amax(1))


def _routed_input_amax(model: torch.nn.Module, experts_name: str, ids: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert max |x| of the tokens HF's own forward routes to each expert (-1: none)."""
    experts = model.get_submodule(experts_name)
    amax = torch.full((4,), -1.0)

    def hook(_, args):
        x, top_k_index = args[0], args[1]
        for e in range(4):
            routed = (top_k_index == e).any(-1)
            if routed.any():
                amax[e] = torch.maximum(amax[e], x[routed].abs().max())

    h = experts.register_forward_pre_hook(hook)
    with torch.no_grad():
        for x in ids:
            model(x)
    h.remove()
    return amax


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_calibration_sees_every_experts_tokens_whatever_the_implementation(implementation):
    """The per-expert input amaxes equal the max over the tokens the float model routes to each
    expert: calibration goes through the routing, not around it (hooks on a module that calls
    `torch._grouped_mm` itself see nothing per expert)."""
    model = tiny_hf_moe("mixtral", experts_implementation=implementation)
    data = batches("mixtral", 2, 3)
    want = _routed_input_amax(model, "model.layers.0.mlp.experts", data)
    with torch.no_grad():
        ref = run(model, data[0])
    calibrate(model, tq.configs.fp8(), data)
    got = model.get_submodule("model.layers.0.mlp.experts.gate_up_proj_gemm").input_quantizer.amax
    assert bool((want > 0).all())
    assert torch.equal(got, want)

    # With every quantizer disabled, the fake-quant model is the float model (its routing
    # reimplemented, summed in fp32 as transformers does).
    plain = tiny_hf_moe("mixtral", experts_implementation=implementation)
    calibrate(plain, QuantConfig(()), data)
    with torch.no_grad():
        assert sqnr(ref, run(plain, data[0])) > 100


@pytest.mark.parametrize("kind", ["mixtral", "titan"])
def test_an_expert_without_tokens_gets_a_finite_amax_and_a_warning(kind):
    model = build(kind)
    # Expert 3 of the first MoE layer never gets a token while calibrating.
    if kind == "mixtral":
        hook = model.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, a: (a[0], a[1].clamp(max=2), a[2]))
    else:
        hook = model.blocks[0].router.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([3]), -1e4))
    data = batches(kind, 2, 0)
    with pytest.warns(CalibrationWarning, match=r"experts \[3\] of '"):
        tq.calibrate(model, tq.configs.nvfp4(), lambda m: [m(x) for x in data], progress=False)
    name = "model.layers.0.mlp.experts" if kind == "mixtral" else "blocks.0.experts"
    for unit_name, unit in experts_units(model).items():
        if unit_name.startswith(name):
            amax = unit.input_quantizer.amax
            assert bool(torch.isfinite(amax).all()) and float(amax[3]) == float(amax[:3].max())
    # Tokens routed to the expert later are quantized with that amax: finite.
    hook.remove()
    with torch.no_grad():
        out = run(model, batches(kind, 1, 5)[0])
    assert bool(torch.isfinite(out).all())


def test_prepare_gives_experts_zero_amaxes_of_their_final_shapes():
    model = tq.calibration.prepare(build("titan"), tq.configs.fp8())
    unit = experts_units(model)["blocks.0.experts.w2_gemm"]
    assert unit.weight_quantizer.amax.shape == (4, 1, 1) and unit.input_quantizer.amax.shape == (4,)


def test_calibration_failure_leaves_the_experts_module_as_it_was():
    model = build("qwen3_moe")
    cls = type(model.model.layers[0].mlp.experts)

    def boom(m):
        raise RuntimeError("data loader failed")

    with pytest.raises(RuntimeError, match="data loader failed"):
        tq.calibrate(model, tq.configs.fp8(), boom, progress=False)
    experts = model.model.layers[0].mlp.experts
    assert type(experts) is cls and not hasattr(experts, "tq_experts_layout")
    assert not any(isinstance(c, ExpertGemmQuantizers) for c in experts.children())


def test_rules_select_experts_gemms_by_name_or_by_their_experts_module():
    from tqcompile.calibration import QuantRule

    model = build("mixtral")
    experts_cls = type(model.model.layers[0].mlp.experts)
    config = tq.configs.fp8().with_rules(
        QuantRule.disable("*.experts.down_proj_gemm"),
        QuantRule.disable("model.layers.0.mlp.experts"),  # the experts module: all its GEMMs
        QuantRule(module_types=(experts_cls,), name="model.layers.1.*", input=tq.Float8Quantizer(tq.Format.E5M2)),
    )
    calibrate(model, config, batches("mixtral", 1, 0))
    units = experts_units(model)
    enabled = {n: tuple(s for s, t in u.quantizers().items() if t.enabled) for n, u in units.items()}
    assert enabled == {
        "model.layers.0.mlp.experts.gate_up_proj_gemm": (),
        "model.layers.0.mlp.experts.down_proj_gemm": (),
        "model.layers.1.mlp.experts.gate_up_proj_gemm": ("input", "weight"),
        "model.layers.1.mlp.experts.down_proj_gemm": ("input",),
    }
    assert units["model.layers.1.mlp.experts.gate_up_proj_gemm"].input_quantizer.quantizer.format is tq.Format.E5M2


def test_deepcopy_and_pickle_keep_the_fake_quant_experts():
    import copy

    model = build("gpt_oss")
    calibrate(model, tq.configs.int8(), batches("gpt_oss", 1, 0))
    x = batches("gpt_oss", 1, 9)[0]
    with torch.no_grad():
        want = run(model, x)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
            unit = experts_units(other)["model.layers.0.mlp.experts.down_proj_gemm"]
            assert unit.owner is other.model.layers[0].mlp.experts
            assert torch.equal(run(other, x), want)


def test_experts_converted_for_training_are_reported_not_silently_skipped():
    model = build("titan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tq.convert reports the routers it keeps float
        tq.convert(model, tq.recipes.fp8_tensorwise())
    with pytest.warns(CalibrationWarning, match=r"blocks\.0\.experts\.w1_gemm \(\w*GroupedExperts\): its experts module was converted"):
        calibrated = tq.calibrate(model, tq.configs.fp8(), lambda m: m(batches("titan", 1, 0)[0]), progress=False)
    assert not experts_units(calibrated)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process, on purpose
def test_experts_amaxes_load_with_dcp_into_a_prepared_model(tmp_path):
    """The expert-parallel checkpoint path (docs/ptq.md), in one process: `prepare` builds the
    experts units with placeholder amaxes of their final shapes and DCP fills them in place."""
    import torch.distributed.checkpoint as dcp

    model = build("qwen3_moe")
    calibrate(model, tq.configs.nvfp4(), batches("qwen3_moe", 1, 0))
    dcp.save({"quant": tq.quant_state(model)}, checkpoint_id=str(tmp_path))
    fresh = tq.calibration.prepare(build("qwen3_moe", seed=1), tq.configs.nvfp4())
    dcp.load({"quant": tq.quant_state(fresh)}, checkpoint_id=str(tmp_path))
    fresh.load_state_dict(model.state_dict())
    x = batches("qwen3_moe", 1, 4)[0]
    with torch.no_grad():
        assert torch.equal(run(fresh, x), run(model, x))


@pytest.mark.parametrize("kind,preset,algorithm", [("mixtral", "fp8", "mse"), ("titan", "int8", "percentile")])
def test_percentile_and_mse_calibrate_experts(kind, preset, algorithm):
    """Per-expert input amaxes use the max (as for GroupedLinear); "mse" searches each expert
    weight's clipping; the other layers use the algorithm. Measured 27.0 / 29.6 dB."""
    make_config, floor = PRESETS[preset]
    model = build(kind)
    cal, test = batches(kind, 2, 1), batches(kind, 1, 7)[0]
    with torch.no_grad():
        ref = run(model, test)
    calibrate(model, make_config(), cal, algorithm=algorithm)
    assert all(u.weight_quantizer.amax is not None for u in experts_units(model).values())
    with torch.no_grad():
        assert sqnr(ref, run(model, test)) >= floor


def test_bfloat16_experts_calibrate_and_keep_their_dtype():
    model = build("mixtral").to(torch.bfloat16)
    cal, test = batches("mixtral", 2, 1), batches("mixtral", 1, 7)[0]
    with torch.no_grad():
        ref = run(model, test)
    calibrate(model, tq.configs.fp8(), cal)
    with torch.no_grad():
        out = run(model, test)
    assert out.dtype == torch.bfloat16 and sqnr(ref.float(), out.float()) >= PRESETS["fp8"][1]  # measured 27.3
    unit = experts_units(model)["model.layers.0.mlp.experts.gate_up_proj_gemm"]
    assert unit.input_quantizer.amax.dtype == torch.float32


# --- The ops and the grouped fake quantizer behind fake-quantized experts --------------------------
_QUANTIZERS = {
    "int8": tq.IntQuantizer(tq.Format.INT8),
    "fp8": tq.Float8Quantizer(tq.Format.E4M3),
    "fp8_rowwise": tq.Float8Quantizer(tq.Format.E4M3, tq.Granularity.ROWWISE),
    "mxfp8": tq.MXQuantizer(tq.Format.E4M3),
    "nvfp4": tq.NVFP4Quantizer(),
    "nvfp4_hadamard": tq.NVFP4Quantizer(hadamard=True),
}
_ENDS = torch.tensor([5, 5, 22, 37])  # expert 1 has no token


@pytest.mark.parametrize("qname", list(_QUANTIZERS))
def test_opcheck_grouped_dequantize_and_grouped_mm(qname, float8_comparable):
    from tqcompile.ops import grouped_gemm as gops

    q = _QUANTIZERS[qname]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g)
    amax = gops.grouped_amax(x, q, _ENDS, False) if q.uses_tensor_amax() else None
    data, scale_inv = gops.grouped_quantize(x, q, _ENDS, amax, None, False)
    torch.library.opcheck(gops.grouped_dequantize, (data, scale_inv, amax, q, _ENDS, torch.float32))
    w = torch.randn(4, 48, 64, generator=g)
    torch.library.opcheck(gops.grouped_mm, (x.requires_grad_(), w.requires_grad_(), _ENDS))


@pytest.mark.parametrize("qname", list(_QUANTIZERS))
def test_grouped_fake_quant_equals_per_expert_fake_quant_bit_for_bit(qname):
    """Each expert's rows, fake-quantized in one grouped call with static per-expert amaxes, equal
    `fake_quantize` of that expert's rows alone with its amax; so do the clipped-STE gradients."""
    from tqcompile.calibration import fake_quantize, fake_quantize_grouped

    q = _QUANTIZERS[qname]
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 64, generator=g) * torch.linspace(0.5, 4, 37).unsqueeze(1)).requires_grad_()
    amax = torch.tensor([1.0, 2.0, 3.0, 0.5]) if q.uses_tensor_amax() else None
    y = fake_quantize_grouped(x, q, _ENDS, amax)
    y.backward(torch.ones_like(y))
    bounds = [0, *_ENDS.tolist()]
    for e in range(4):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        xe = x.detach()[lo:hi].clone().requires_grad_()
        ye = fake_quantize(xe, q, None if amax is None else amax[e])
        ye.backward(torch.ones_like(ye))
        assert torch.equal(y[lo:hi], ye), e
        assert torch.equal(x.grad[lo:hi], xe.grad), e


def test_grouped_mm_equals_per_expert_matmuls_forward_and_backward():
    from tqcompile.ops import grouped_gemm as gops

    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 64, generator=g, requires_grad=True)
    w = torch.randn(4, 48, 64, generator=g, requires_grad=True)
    y = gops.grouped_mm(x, w, _ENDS)
    dy = torch.randn_like(y)
    y.backward(dy)
    bounds = [0, *_ENDS.tolist()]
    ref = torch.cat([x[lo:hi] @ w[e].t() for e, (lo, hi) in enumerate(zip(bounds, bounds[1:]))])
    dx, dw = torch.autograd.grad(ref, (x, w), dy)
    # torch._grouped_mm in fp32 on CPU is one matmul per expert, bit for bit; dgrad multiplies
    # by the transposed weight made contiguous, whose summation order differs from autograd's
    # dy @ w[e] in the last bits.
    assert torch.equal(y, ref) and torch.equal(w.grad, dw)
    torch.testing.assert_close(x.grad, dx, rtol=1e-6, atol=1e-5)
    assert torch.equal(w.grad[1], torch.zeros(48, 64))  # the expert without tokens


def test_qat_through_the_hopper_bf16_grouped_gemm(monkeypatch):
    """Where CUDA's bf16 grouped GEMM runs (`cuda_grouped_gemms`, patched true here; the CPU's
    `torch._grouped_mm` kernel stands in), a fake-quantized MoE's forward and its dgrad run one
    `torch._grouped_mm` per GEMM (the weight gradient keeps the loop): bf16 QAT logits and every
    expert weight's gradient within one bf16 ulp (relative L2 2^-7) of the per-expert loop's.
    (On the H200 the forward ran in tests/test_cuda.py's MoE tests.)"""
    from torch import nn

    from tqcompile.ops import grouped_gemm as gops

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    keep = tq.calibration.QuantRule.disable(module_types=(nn.Linear,), must_match=False)  # the experts alone
    m = tiny_hf_moe("mixtral", num_experts=4, hidden=128, intermediate=128).to(torch.bfloat16)
    tq.calibrate(m, tq.configs.int8_weight_only().with_rules(keep), lambda mm: mm(ids), progress=False)
    m.train()

    def step():
        m.zero_grad()
        out = m(ids).logits.float()
        out.square().mean().backward()
        return out.detach(), {n: p.grad.float().clone() for n, p in m.named_parameters() if "experts" in n and p.grad is not None}

    ref = step()
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(gops, "cuda_grouped_gemms", lambda device: True)
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    got = step()
    assert len(calls) == 2 * 2 * 2  # 2 layers x (gate_up, down) x (forward, dgrad)
    assert ref[1].keys() == got[1].keys() and len(ref[1]) == 4
    for what, a, b in [("logits", got[0], ref[0]), *((k, got[1][k], ref[1][k]) for k in ref[1])]:
        assert float((a - b).norm() / b.norm()) <= 2.0**-7, what
