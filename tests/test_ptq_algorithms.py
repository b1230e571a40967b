"""GPTQ, AWQ and SmoothQuant through `tq.calibrate(algorithm=...)` (issue 18).

- the algorithm argument: strings, value objects, ordered combinations; bad ones refused;
- smoothing folds leave the float model's output unchanged: bit for bit with power-of-two scales
  (the fold itself is exact), within a stated bound with real scales; where no op folds exactly
  (a norm's output read twice, a GELU MLP), the layer is reported and left unsmoothed;
- GPTQ and AWQ lower the model's error against round to nearest;
- every algorithm x format exports (compressed-tensors decompresses each weight bit for bit equal
  to what the model computes with) and restores (`tq.quant_state` / `tq.restore`, methods kept);
- MoE experts: per-expert Hessians, the router compensated for the fold, an expert with no tokens
  rounded to nearest with a warning;
- QAT continues from a transformed model; a failing calibration leaves the weights untouched.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import transformers
from moe_models import tiny_hf_moe
from torch import nn

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning, QuantRule
from tqcompile.calibration import smoothing as sm
from tqcompile.calibration.layer_stats import weight_of
from tqcompile.configs import GEMM_LAYERS, default_disabled
from tqcompile.formats import Format
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer

VOCAB = 96


def tiny_llama(kv_heads: int = 4, seed: int = 0, hidden: int = 64, inter: int = 128) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _ids(seed: int, n: int = 3, shape: tuple[int, int] = (2, 24)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, shape, generator=g) for _ in range(n)]


CALIB, TEST = _ids(1), _ids(2, 2)
# GPTQ needs well more tokens than a layer has inputs (128), or it fits the calibration set: 1024.
CALIB_GPTQ, TEST_GPTQ = _ids(1, 8, (4, 32)), _ids(2, 2, (4, 32))


def _loop(m, batches=CALIB):
    for x in batches:
        m(x)


def _logits(model, batches=TEST) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(x).logits for x in batches])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _float_copy(model: nn.Module, build) -> nn.Module:
    """A fresh float model holding `model`'s (transformed) weights: the float model after the folds."""
    fresh = build()
    fresh.load_state_dict(model.state_dict())
    return fresh


def _calibrate(model, config, algorithm, batches=CALIB, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.calibrate(model, config, lambda m: _loop(m, batches), algorithm=algorithm, progress=False, **kw)
    return [str(w.message) for w in caught if issubclass(w.category, CalibrationWarning)]


def _methods(model) -> dict[str, str]:
    return {r.name: r.method for r in tq.summary(model).rows if r.weight != "off"}


# ------------------------------------------------------------------------------------------------
# The argument
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "algorithm, match",
    [
        ("gptq2", "algorithm='gptq2' is not allowed; allowed: 'max'"),
        (("max", "mse"), "two scale searches"),
        (("gptq", "awq"), "puts AWQ after GPTQ"),
        (("awq", "smoothquant"), "two smoothing transforms"),
        (("gptq", tq.GPTQ()), "GPTQ twice"),
        ((), "is empty"),
        (3, "algorithm=3 is not allowed"),
    ],
)
def test_bad_algorithm_is_refused_before_anything_changes(algorithm, match):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        tq.calibrate(model, tq.configs.int8(), _loop, algorithm=algorithm, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, tq.calibration.FakeQuantModule) for m in model.modules())


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: tq.GPTQ(block_size=0), "block_size=0"),
        (lambda: tq.GPTQ(dampening=0.0), "dampening=0.0"),
        (lambda: tq.GPTQ(act_order="yes"), "act_order='yes'"),
        (lambda: tq.AWQ(grid=0), "grid=0"),
        (lambda: tq.AWQ(max_shrink=1.0), "max_shrink=1.0"),
        (lambda: tq.SmoothQuant(alpha=1.5), r"alpha=1.5 is not allowed; allowed: a number in \[0.0, 1.0\]"),
    ],
)
def test_bad_knobs_name_the_value_and_the_range(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_value_objects_are_frozen_and_hashable():
    a = tq.GPTQ(block_size=64)
    assert a == tq.GPTQ(block_size=64) and hash(a) == hash(tq.GPTQ(block_size=64))
    with pytest.raises(AttributeError):
        a.block_size = 32
    with pytest.raises(ValueError, match="sequential='no'"):
        tq.calibrate(tiny_llama(), tq.configs.int8(), _loop, algorithm="gptq", sequential="no", progress=False)


# ------------------------------------------------------------------------------------------------
# Folds
# ------------------------------------------------------------------------------------------------
def _power_of_two_scales(monkeypatch):
    """SmoothQuant's scales rounded to powers of two (2^-2 .. 2^2, seeded): the fold is then exact."""
    g = torch.Generator().manual_seed(5)

    def scales(fold, stats, algo):
        n = weight_of(fold.consumers[0]).shape[-1]
        return 2.0 ** torch.randint(-2, 3, (n,), generator=g).float()

    monkeypatch.setattr(sm, "_smoothquant_scales", scales)


def test_smoothing_fold_is_bit_exact_with_power_of_two_scales(monkeypatch):
    _power_of_two_scales(monkeypatch)
    ref = _logits(tiny_llama())
    model = tiny_llama()
    caught = _calibrate(model, tq.configs.int8(), tq.SmoothQuant(linear_folds=True))
    assert not caught, caught
    # Every layer folded: q/k/v and gate/up into the norms, o into v (4 kv heads), down into up.
    methods = _methods(model)
    assert set(methods.values()) == {"smoothquant+max"} and len(methods) == 14, methods
    smoothed = _float_copy(model, tiny_llama)
    assert not torch.equal(smoothed.model.layers[0].input_layernorm.weight, tiny_llama().model.layers[0].input_layernorm.weight)
    assert torch.equal(_logits(smoothed), ref)


def test_smoothquant_smooths_only_what_a_norm_produces_by_default(monkeypatch):
    """SmoothQuant's default, as the paper's code and llmcompressor's mappings: q/k/v and gate/up
    (their inputs come from the norms); o_proj and down_proj keep their weights, by choice (no
    warning); `linear_folds=True` folds those into v_proj's and up_proj's rows too."""
    _power_of_two_scales(monkeypatch)
    ref = _logits(tiny_llama())
    model = tiny_llama()
    assert _calibrate(model, tq.configs.int8(), "smoothquant") == []
    methods = _methods(model)
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        assert {methods[prefix + n] for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")} == {
            "smoothquant+max"
        }
        assert methods[prefix + "self_attn.o_proj"] == methods[prefix + "mlp.down_proj"] == ""
    smoothed = _float_copy(model, tiny_llama)
    assert not torch.equal(smoothed.model.layers[0].mlp.up_proj.weight, tiny_llama().model.layers[0].mlp.up_proj.weight)
    assert torch.equal(_logits(smoothed), ref)
    with pytest.raises(ValueError, match=r"linear_folds=1 is not allowed"):
        tq.SmoothQuant(linear_folds=1)


def test_awq_fold_is_bit_exact_with_power_of_two_scales(monkeypatch):
    g = torch.Generator().manual_seed(6)
    monkeypatch.setattr(sm, "_awq_scales", lambda fold, stats, algo, loss_fn=None: 2.0 ** torch.randint(-2, 3, (_weight_in(fold),), generator=g).float())
    ref = _logits(tiny_llama())
    model = tiny_llama()
    _calibrate(model, tq.configs.int4_weight_only(32), tq.AWQ(clip=False))
    assert set(_methods(model).values()) == {"awq+max"} and len(_methods(model)) == 14
    assert torch.equal(_logits(_float_copy(model, tiny_llama)), ref)


def _weight_in(fold) -> int:
    return weight_of(fold.consumers[0]).shape[-1]


def test_smoothing_fold_with_real_scales_is_within_float_rounding():
    ref = _logits(tiny_llama())
    model = tiny_llama()
    _calibrate(model, tq.configs.int8(), tq.SmoothQuant(alpha=0.8))
    err = (_logits(_float_copy(model, tiny_llama)) - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err  # each fold rounds a weight twice (divide, multiply): a few fp32 ulps


def test_grouped_query_attention_leaves_o_proj_unsmoothed_and_says_so():
    model = tiny_llama(kv_heads=2)  # v_proj has 32 outputs, o_proj 64 inputs: nothing folds into o_proj
    caught = _calibrate(model, tq.configs.int8(), tq.SmoothQuant(linear_folds=True))
    assert len(caught) == 1 and "model.layers.0.self_attn.o_proj" in caught[0] and "model.layers.1.self_attn.o_proj" in caught[0]
    methods = _methods(model)
    assert methods["model.layers.0.self_attn.o_proj"] == "" and methods["model.layers.0.mlp.down_proj"] == "smoothquant+max"


class _NormReadTwice(nn.Module):
    """A norm whose output feeds a linear *and* the residual: a fold would change the residual."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)
        self.act = nn.GELU()

    def forward(self, x):
        h = self.norm(x)
        return self.fc2(self.act(self.fc1(h))) + h


def test_no_fold_where_the_model_reads_the_output_elsewhere():
    torch.manual_seed(0)
    model = _NormReadTwice().eval()
    x = torch.randn(4, 8, 32)
    with torch.no_grad():
        ref = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.calibrate(model, tq.configs.int8(), lambda m: m(x), algorithm=tq.SmoothQuant(linear_folds=True), progress=False)
    (msg,) = [str(w.message) for w in caught if issubclass(w.category, CalibrationWarning)]
    assert "fc1" in msg and "fc2" in msg  # fc1: the norm's output is read twice; fc2: after a GELU
    fresh = _NormReadTwice().eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(x), ref)  # nothing was folded


# ------------------------------------------------------------------------------------------------
# Quality
# ------------------------------------------------------------------------------------------------
def test_gptq_lowers_the_error_of_round_to_nearest():
    """On held-out data of a random tiny Llama, INT4 g32: measured 0.088 (GPTQ) against 0.104 (max)."""
    ref = _logits(tiny_llama(), TEST_GPTQ)
    errors = {}
    for algo in ("max", "gptq", tq.GPTQ(act_order=True)):
        model = tiny_llama()
        _calibrate(model, tq.configs.int4_weight_only(32), algo, CALIB_GPTQ)
        errors[repr(algo)] = _rel(_logits(model, TEST_GPTQ), ref)
    assert errors["'gptq'"] < 0.9 * errors["'max'"], errors
    assert errors[repr(tq.GPTQ(act_order=True))] < 0.9 * errors["'max'"], errors


def test_awq_lowers_the_error_of_round_to_nearest():
    """INT4 g32 on held-out data: measured 0.091 (AWQ), 0.090 (AWQ then GPTQ) against 0.104 (max)."""
    ref = _logits(tiny_llama(), TEST_GPTQ)
    errors = {}
    for algo in ("max", "awq", ("awq", "gptq")):
        model = tiny_llama()
        _calibrate(model, tq.configs.int4_weight_only(32), algo, CALIB_GPTQ)
        errors[str(algo)] = _rel(_logits(model, TEST_GPTQ), ref)
    assert errors["awq"] < 0.92 * errors["max"] and errors["('awq', 'gptq')"] < 0.92 * errors["max"], errors
    assert set(_methods(model).values()) == {"awq+gptq"}


def test_smoothquant_then_gptq_runs_in_that_order():
    model = tiny_llama()
    _calibrate(model, tq.configs.int8(), ("smoothquant", "gptq"))
    # SmoothQuant's default smooths what the norms feed; GPTQ then rounds every layer.
    methods = _methods(model)
    assert {m for n, m in methods.items() if n.endswith(("o_proj", "down_proj"))} == {"gptq"}
    assert {m for n, m in methods.items() if not n.endswith(("o_proj", "down_proj"))} == {"smoothquant+gptq"}
    rec = tq.quant_state(model)["algorithm"]
    assert rec == "SmoothQuant(alpha=0.5, linear_folds=False) + GPTQ(block_size=128, dampening=0.01, act_order=True) + max"


def test_sequential_and_single_pass_both_work():
    """One pass for the model (later layers see float inputs) or one per layer (they see the rounded
    earlier layers): different Hessians, so different weights; both beat round to nearest."""
    ref = _logits(tiny_llama(), TEST_GPTQ)
    rtn = tiny_llama()
    _calibrate(rtn, tq.configs.int4_weight_only(32), "max", CALIB_GPTQ)
    a, b = tiny_llama(), tiny_llama()
    _calibrate(a, tq.configs.int4_weight_only(32), "gptq", CALIB_GPTQ, sequential=True)
    _calibrate(b, tq.configs.int4_weight_only(32), "gptq", CALIB_GPTQ, sequential=False)
    first = "model.layers.0.self_attn.q_proj.weight"
    last = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(a.state_dict()[first], b.state_dict()[first])  # the first layer sees the same inputs
    assert not torch.equal(a.state_dict()[last], b.state_dict()[last])
    for m in (a, b):
        assert _rel(_logits(m, TEST_GPTQ), ref) < 0.95 * _rel(_logits(rtn, TEST_GPTQ), ref)


# ------------------------------------------------------------------------------------------------
# Export and restore
# ------------------------------------------------------------------------------------------------
def _gemm_config(weight, inputs=False):
    return tq.calibration.QuantConfig((QuantRule(module_types=GEMM_LAYERS, input=inputs, weight=weight, must_match=False), *default_disabled()))


_CASES = {
    "gptq-int4g32": ("gptq", lambda: tq.configs.int4_weight_only(32)),
    "gptq-int8-w8a8": (("smoothquant", "gptq"), tq.configs.int8),
    "gptq-int8-token": (
        ("smoothquant", "gptq"),
        lambda: _gemm_config(IntQuantizer(Format.INT8, Granularity.ROWWISE), IntQuantizer(Format.INT8, Granularity.ROWWISE)),
    ),
    "gptq-fp8-channel": ("gptq", lambda: _gemm_config(Float8Quantizer(granularity=Granularity.ROWWISE))),
    "smoothquant-gptq-fp8": (("smoothquant", "gptq"), tq.configs.fp8),
    "smoothquant-int8": ("smoothquant", tq.configs.int8),
    "gptq-mxfp8": ("gptq", tq.configs.mxfp8),
    "gptq-nvfp4": ("gptq", tq.configs.nvfp4),  # q/k/v and gate/up rounded under their shared global scale
    "awq-int4g32": ("awq", lambda: tq.configs.int4_weight_only(32)),
    "awq-gptq-int4g32": (("awq", "gptq"), lambda: tq.configs.int4_weight_only(32)),
    "awq-nvfp4": ("awq", tq.configs.nvfp4),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_transformed_model_exports_and_restores(tmp_path, case):
    from test_export import _assert_bits, _decompress, _read

    algo, make = _CASES[case]
    model = tiny_llama()
    _calibrate(model, make(), algo)
    tq.export(model, str(tmp_path / "ckpt"))
    tensors = _read(str(tmp_path / "ckpt"))
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            with torch.no_grad():
                want = m.weight_quantizer(m.weight)
            if "gptq" in algo:
                assert torch.equal(want, m.weight.float()), f"{name}: GPTQ's weight is not on its grid"
            _assert_bits(_decompress(str(tmp_path / "ckpt"), tensors, name), want, f"{case} {name}")
    # quant_state + the model's state_dict rebuild it exactly, with how each weight was made.
    state = tq.quant_state(model)
    torch.save(state, tmp_path / "q.pt")
    fresh = tq.restore(tiny_llama(), torch.load(tmp_path / "q.pt", weights_only=True))
    fresh.load_state_dict(model.state_dict())
    assert tq.summary(fresh).rows == tq.summary(model).rows
    assert torch.equal(_logits(fresh), _logits(model))


def test_qat_continues_from_gptq():
    model = tiny_llama()
    _calibrate(model, tq.configs.int4_weight_only(32), "gptq")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    x = CALIB[0]
    losses = []
    for _ in range(4):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("replay, failing_call", [(True, 2), (False, 3)])
def test_failed_calibration_puts_the_weights_back(replay, failing_call, monkeypatch):
    # Replaying layers on cached inputs (tqcompile.calibration.replay), forward_loop runs twice: the
    # capture, then the activation amaxes, after every group is transformed; a pass per group
    # (REPLAY off): its third call comes after two groups are transformed.
    from tqcompile.calibration import transforms

    monkeypatch.setattr(transforms, "REPLAY", replay)
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def loop(m):
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("data loader died")
        _loop(m)

    with pytest.raises(RuntimeError, match="data loader died"):
        tq.calibrate(model, tq.configs.int8(), loop, algorithm=("smoothquant", "gptq"), progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, tq.calibration.FakeQuantModule) for m in model.modules())


# ------------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------------
def _moe_ids() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]


def test_moe_experts_smooth_with_the_router_compensated_and_gptq_per_expert(monkeypatch):
    _power_of_two_scales(monkeypatch)
    ids = _moe_ids()
    build = lambda: tiny_hf_moe("qwen3_moe", layers=1)  # noqa: E731
    with torch.no_grad():
        ref = torch.cat([build()(x).logits for x in ids])
    model = build()
    config = tq.configs.int8()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        tq.calibrate(model, config, lambda m: [m(x) for x in ids], algorithm="smoothquant", progress=False)
    methods = _methods(model)
    assert methods["model.layers.0.mlp.experts.gate_up_proj_gemm"] == "smoothquant+max"
    fresh = build()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(torch.cat([fresh(x).logits for x in ids]), ref)  # router and experts both folded exactly

    model = build()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        tq.calibrate(model, config, lambda m: [m(x) for x in ids], algorithm=("smoothquant", "gptq"), progress=False)
    assert _methods(model)["model.layers.0.mlp.experts.down_proj_gemm"] == "gptq"
    assert _methods(model)["model.layers.0.mlp.experts.gate_up_proj_gemm"] == "smoothquant+gptq"


def test_expert_without_tokens_is_rounded_to_nearest_with_a_warning():
    model = tiny_hf_moe("qwen3_moe", layers=1)

    def never_expert_3(_module, _args, out):
        logits, scores, idx = out
        return logits, scores, torch.where(idx == 3, torch.zeros_like(idx), idx)

    model.model.layers[0].mlp.gate.register_forward_hook(never_expert_3)
    ids = _moe_ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.calibrate(model, tq.configs.int4_weight_only(32), lambda m: [m(x) for x in ids], algorithm="gptq", progress=False)
    msgs = "\n".join(str(w.message) for w in caught)
    assert "experts.gate_up_proj_gemm expert 3: received no tokens" in msgs, msgs
    w = model.model.layers[0].mlp.experts.gate_up_proj_gemm
    with torch.no_grad():
        assert torch.equal(w.weight_quantizer(w.weight)[3], w.weight[3].float())


# ------------------------------------------------------------------------------------------------
# Found by review: folds and weights that must not move
# ------------------------------------------------------------------------------------------------
class _SharedNormHeads(nn.Module):
    """One norm read by linears in different ModuleList elements (different sequential groups)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(64)
        self.heads = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])

    def forward(self, x):
        h = self.norm(x)
        return sum(torch.relu(p(h)) for p in self.heads)


def test_a_later_fold_never_moves_a_weight_an_earlier_group_rounded():
    xs = [torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) * torch.linspace(0.1, 8, 64) for i in range(3)]
    for algo in (("smoothquant", "gptq"), ("awq", "gptq")):
        model = _SharedNormHeads().eval()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            tq.calibrate(model, tq.configs.int8(), lambda m: [m(x) for x in xs], algorithm=algo, progress=False)
        for i, head in enumerate(model.heads):
            with torch.no_grad():
                assert torch.equal(head.weight_quantizer(head.weight), head.weight), f"{algo}: heads.{i} is off its grid"


class _Clamped(nn.Module):
    """fc1 -> clamp -> fc2: linear only inside the clamp, which small probe scales may never reach."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64)
        with torch.no_grad():
            self.fc1.weight.mul_(0.15)
            self.fc1.bias.zero_()
            self.fc2.weight.mul_(200.0)

    def forward(self, x):
        return self.fc2(torch.clamp(self.fc1(x), -1.0, 1.0))


def test_no_fold_through_a_clamp():
    xs = [torch.randn(128, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = _Clamped().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.calibrate(model, tq.configs.int8(), lambda m: [m(x) for x in xs], algorithm=tq.SmoothQuant(linear_folds=True), progress=False)
    assert any("fc2" in str(w.message) for w in caught)
    fresh = _Clamped().eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(xs[0]), _Clamped().eval()(xs[0]))


class _NormThenClamped(nn.Module):
    """norm -> fc1 -> clamp(±30) -> fc2: the fold into the norm holds with any scales; fc1's into fc2
    holds with the probe's (fc1's outputs times 2^6 stay inside the clamp) but not with SmoothQuant's
    (fc2's columns are so large that its scales divide fc1's rows by more than 2^6)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(64)
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64)
        with torch.no_grad():
            self.fc1.weight.mul_(0.15)
            self.fc1.bias.zero_()
            self.fc2.weight.mul_(1e5)

    def forward(self, x):
        return self.fc2(torch.clamp(self.fc1(self.norm(x)), -30.0, 30.0))


def test_a_fold_the_scales_break_is_undone_and_the_others_kept():
    """The folds of a group are checked together with the scales found; where that fails each is
    checked on its own: the norm's fold into fc1 is kept, fc1's through the clamp into fc2 undone."""
    xs = [torch.randn(128, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = _NormThenClamped().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.calibrate(model, tq.configs.int8(), lambda m: [m(x) for x in xs], algorithm=tq.SmoothQuant(linear_folds=True), progress=False)
    left = [str(w.message) for w in caught if "unsmoothed" in str(w.message)]
    assert len(left) == 1 and "fc2: the fold into 'fc1' changed the model's output" in left[0] and "fc1:" not in left[0]
    assert model.fc1.weight_quantizer.method == "smoothquant+max" and model.fc2.weight_quantizer.method == "max"
    original, fresh = _NormThenClamped().eval(), _NormThenClamped().eval()
    fresh.load_state_dict(model.state_dict())  # the float weights as folded
    assert not torch.equal(fresh.norm.weight, original.norm.weight)
    with torch.no_grad():
        torch.testing.assert_close(fresh(xs[0]), original(xs[0]), rtol=1e-4, atol=1e-4 * float(original(xs[0]).abs().max()))


@dataclasses.dataclass
class _Out:
    y: torch.Tensor


class _DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32))

    def forward(self, x):
        return _Out(self.body(x))


def test_folds_are_proved_on_dataclass_outputs_and_a_loop_that_skips_the_model_is_named():
    x = torch.randn(16, 32)
    model = _DataclassOut().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.calibrate(model, tq.configs.int8(), lambda m: m(x), algorithm="smoothquant", progress=False)
    assert not [w for w in caught if issubclass(w.category, CalibrationWarning)]
    assert _methods(model)["body.1"] == "smoothquant+max"
    model = _DataclassOut().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.calibrate(model, tq.configs.int8(), lambda m: m.body(x), algorithm="smoothquant", progress=False)
    assert any("never called the model itself" in str(w.message) for w in caught)


def test_gptq_leaves_a_tied_weight_alone():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    embed = model.model.embed_tokens.weight.detach().clone()
    config = tq.configs.int4_weight_only(32).with_rules(QuantRule(name="lm_head", weight=IntQuantizer(Format.INT4, Granularity.BLOCKWISE_1D, block_size=32)))
    caught = _calibrate(model, config, "gptq")
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert any("lm_head: its weight is tied" in m for m in caught), caught
