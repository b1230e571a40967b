"""PTQ: configs, calibration, fake-quant numerics, summary, quant_state/restore, bad input."""

from __future__ import annotations

import copy
import dataclasses
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile import ops
from tqcompile.calibration import CalibrationWarning, ConfigError, QuantConfig, QuantRule
from tqcompile.kernels.reference import unit_amax
from tqcompile.testing import assert_bitwise_equal

QUANTIZERS_STATIC = [
    tq.IntQuantizer(),
    tq.IntQuantizer(granularity=tq.Granularity.ROWWISE),
    tq.IntQuantizer(tq.Format.INT4, tq.Granularity.BLOCKWISE_1D, block_size=32),
    tq.Float8Quantizer(),
    tq.Float8Quantizer(tq.Format.E5M2, tq.Granularity.ROWWISE),
    tq.Float8Quantizer(granularity=tq.Granularity.BLOCKWISE_2D, block_size=16),
    tq.NVFP4Quantizer(),
    tq.NVFP4Quantizer(hadamard=True),
]


def _calib_loop(batches):
    def loop(model):
        for x in batches:
            model(x)

    return loop


class MLP(nn.Module):
    def __init__(self, d=64, h=128, out=32):
        super().__init__()
        self.fc1, self.norm, self.fc2, self.head = nn.Linear(d, h), nn.LayerNorm(h), nn.Linear(h, h), nn.Linear(h, out)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


# ---------------------------------------------------------------------------------------------
# Numerics: fake quant is tq.quantize(...).dequantize(), bit for bit
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", QUANTIZERS_STATIC, ids=repr)
def test_static_amax_from_the_data_reproduces_dynamic_quantize(q):
    torch.manual_seed(0)
    x = torch.randn(64, 128) * 3
    dynamic = tq.quantize(x, q)
    amax = ops.amax(x, q) if q.uses_tensor_amax() else unit_amax(x, q)
    static = tq.quantize(x, q, amax=amax)
    assert_bitwise_equal(static._data.view(torch.uint8), dynamic._data.view(torch.uint8))
    assert_bitwise_equal(static._scale_inv, dynamic._scale_inv)
    fq = tq.calibration.fake_quantize(x, q, amax)
    assert_bitwise_equal(fq, dynamic.dequantize())


def test_static_amax_saturates_beyond_it_and_rejects_bad_shapes():
    x = torch.tensor([[-4.0, -1.0, 0.5, 1.0, 3.0, 8.0]])
    y = tq.quantize(x, tq.IntQuantizer(), amax=torch.tensor(1.0)).dequantize()
    assert y.tolist() == [[-1.0, -1.0, 0.5039370059967041, 1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="must be 0-dim"):
        tq.quantize(x, tq.IntQuantizer(), amax=torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"must have shape \(1, 1\)"):
        tq.quantize(x, tq.IntQuantizer(granularity=tq.Granularity.ROWWISE), amax=torch.ones(()))
    with pytest.raises(ValueError, match="takes no static amax"):
        tq.quantize(torch.randn(2, 32), tq.MXQuantizer(), amax=torch.ones(()))
    with pytest.raises(TypeError, match="float32"):
        tq.quantize(x, tq.IntQuantizer(), amax=torch.ones((), dtype=torch.float64))


@pytest.mark.parametrize("config", ["int8", "fp8", "nvfp4", "mxfp8", "int4_weight_only"])
def test_calibrated_linear_equals_tq_quantize_of_its_operands(config):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    batches = [torch.randn(8, 64) for _ in range(3)]
    cfg = tq.configs.int4_weight_only(block_size=32) if config == "int4_weight_only" else getattr(tq.configs, config)()
    tq.calibrate(model, cfg, _calib_loop(batches), progress=False)
    lin = model[0]
    qi, qw = lin.input_quantizer.quantizer, lin.weight_quantizer.quantizer
    x = torch.randn(5, 64) * 2
    # The weight's static amax came from the weight itself: it equals a dynamic quantize of it.
    w_ref = tq.quantize(lin.weight, qw).dequantize()
    if qi is None:
        x_ref = x
    else:
        amax = lin.input_quantizer.amax
        if amax is not None:  # static: the max over the calibration batches, through the same op
            assert torch.equal(amax, torch.stack([ops.amax(b, qi) for b in batches]).amax())
        x_ref = tq.quantize(x, qi, amax=amax).dequantize()
    assert_bitwise_equal(lin(x), F.linear(x_ref, w_ref, lin.bias))


def test_conv_weight_is_quantized_per_output_channel_as_its_gemm_matrix():
    torch.manual_seed(2)
    model = SmallCNN().eval()
    tq.calibrate(model, tq.configs.int8(), _calib_loop([torch.randn(2, 3, 8, 8)]), progress=False)
    conv = model.conv2
    assert conv.weight_quantizer.amax.shape == (32, 1)
    w2 = conv.weight.flatten(1)
    assert torch.equal(conv.weight_quantizer.amax, w2.abs().amax(1, keepdim=True))
    x = torch.randn(2, 16, 8, 8)
    w_ref = tq.quantize(w2, conv.weight_quantizer.quantizer).dequantize().view_as(conv.weight)
    x_ref = tq.quantize(x, conv.input_quantizer.quantizer, amax=conv.input_quantizer.amax).dequantize()
    assert_bitwise_equal(conv(x), F.conv2d(x_ref, w_ref, conv.bias, padding=1))


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------
def test_later_rules_override_and_default_disables():
    cfg = tq.configs.int8().with_rules(
        QuantRule(name="fc2", weight=tq.IntQuantizer(tq.Format.INT4, tq.Granularity.BLOCKWISE_1D, block_size=32))
    )
    model = MLP()
    tq.calibrate(model, cfg, _calib_loop([torch.randn(4, 64)]), progress=False)
    full = tq.IntGrid.FULL  # the presets' integer grid
    assert model.fc1.weight_quantizer.quantizer == tq.IntQuantizer(granularity=tq.Granularity.ROWWISE, grid=full)
    assert model.fc2.weight_quantizer.quantizer.format is tq.Format.INT4
    assert model.fc2.input_quantizer.quantizer == tq.IntQuantizer(grid=full)  # not touched by the later rule
    assert not any(q.enabled for q in model.head.quantizers().values())  # the output head
    assert not any(q.enabled for q in model.norm.quantizers().values())  # norms appear, disabled


def test_rules_match_subclasses_routers_and_the_batch_norm_family():
    class MyLinear(nn.Linear):
        pass

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.proj, self.bn = nn.Linear(32, 4), MyLinear(32, 32), nn.SyncBatchNorm(4)

    cfg = tq.configs.fp8()
    m = MoE()
    assert cfg.resolve("proj", m.proj)["weight"] == tq.Float8Quantizer()  # a subclass of nn.Linear
    assert cfg.resolve("moe.gate", m.gate)["input"] is None  # a router
    rule = QuantRule(module_types=(nn.BatchNorm2d,), output=tq.Float8Quantizer())
    assert rule.matches("bn", m.bn)  # SyncBatchNorm stands for any batch norm
    assert QuantRule(module_types=(nn.SyncBatchNorm,)).matches("bn", nn.BatchNorm1d(3))
    assert not QuantRule(module_types=(nn.LayerNorm,)).matches("bn", m.bn)


def test_config_is_a_frozen_comparable_serialisable_value():
    cfg = tq.configs.nvfp4().with_rules(QuantRule(name="*.attn.*", module_types=(nn.Linear,), input=False))
    assert cfg == tq.configs.nvfp4().with_rules(QuantRule(name="*.attn.*", module_types=(nn.Linear,), input=False))
    assert hash(cfg) == hash(QuantConfig.from_dict(cfg.to_dict()))
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg != tq.configs.nvfp4()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ste = "plain"
    buf = io.BytesIO()
    torch.save(cfg.to_dict(), buf)
    buf.seek(0)
    assert QuantConfig.from_dict(torch.load(buf, weights_only=True)) == cfg


def test_config_errors_name_the_field_and_what_is_allowed():
    d = tq.configs.int8().to_dict()
    d["rules"][0]["weight"]["granularty"] = "ROWWISE"
    with pytest.raises(ConfigError, match=r"unknown IntQuantizer fields \['granularty'\]; allowed: .*granularity"):
        QuantConfig.from_dict(d)
    with pytest.raises(ConfigError, match=r"unknown fields \['inputs'\]"):
        QuantRule.from_dict({"inputs": None})
    with pytest.raises(ConfigError, match="format='INT9' is not allowed; allowed: E4M3"):
        QuantRule.from_dict({"weight": {"type": "IntQuantizer", "format": "INT9"}})
    with pytest.raises(ConfigError, match="ste='straight' is not allowed"):
        QuantConfig(ste="straight")
    with pytest.raises(ConfigError, match="is a class; pass an instance"):
        QuantRule(input=tq.IntQuantizer)
    with pytest.raises(ConfigError, match="module_types=.*tuple of nn.Module subclasses"):
        QuantRule(module_types=nn.Linear)
    with pytest.raises(ConfigError, match="has only input, output quantizers"):
        tq.calibrate(
            MLP(),
            QuantConfig((QuantRule(name="norm", weight=tq.IntQuantizer()),)),
            _calib_loop([torch.randn(2, 64)]),
            progress=False,
        )


def test_a_rule_matching_no_module_warns_with_its_pattern():
    cfg = tq.configs.int8().with_rules(QuantRule.disable("encoder.*"))
    with pytest.warns(CalibrationWarning, match=r"QuantRule\(name='encoder\.\*'\) matches no module"):
        tq.calibrate(MLP(), cfg, _calib_loop([torch.randn(2, 64)]), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the presets' default rules never warn
        tq.calibrate(MLP(), tq.configs.int8(), _calib_loop([torch.randn(2, 64)]), progress=False)


# ---------------------------------------------------------------------------------------------
# Bad input: the model is left as it was
# ---------------------------------------------------------------------------------------------
def _snapshot(model):
    return [type(m) for m in model.modules()], copy.deepcopy(model.state_dict()), [n for n, _ in model.named_modules()]


@pytest.mark.parametrize(("value", "name"), [(float("nan"), "NaN"), (float("-inf"), "Inf")])
def test_nonfinite_activation_names_the_module_and_leaves_the_model_unchanged(value, name):
    model = SmallCNN().train()
    before = _snapshot(model)
    x = torch.randn(2, 3, 8, 8)

    def loop(m):
        m(x)
        bad = torch.randn(2, 32)
        bad[1, 3] = value
        m.fc(bad)

    # Training mode on purpose (the BatchNorm statistics it updates must be put back): it warns so.
    with (
        pytest.warns(CalibrationWarning, match="in training mode"),
        pytest.raises(ValueError, match=f"input of module 'fc' holds {name} values"),
    ):
        tq.calibrate(model, tq.configs.int8(), loop, progress=False)
    after = _snapshot(model)
    assert before[0] == after[0] and before[2] == after[2]
    for k, v in before[1].items():  # BatchNorm running statistics put back too
        assert torch.equal(v, after[1][k]), k


def test_forward_loop_that_raises_or_never_calls_the_model():
    model = MLP()
    before = _snapshot(model)

    def bad(m):
        m(torch.randn(2, 64))
        raise KeyError("data loader broke")

    with pytest.raises(KeyError, match="data loader broke"):
        tq.calibrate(model, tq.configs.fp8(), bad, progress=False)
    assert _snapshot(model)[0] == before[0] and not hasattr(model.fc1, "input_quantizer")
    with pytest.raises(RuntimeError, match="forward_loop .* called neither the model"):
        tq.calibrate(model, tq.configs.fp8(), lambda m: None, progress=False)
    assert _snapshot(model)[0] == before[0]
    with pytest.raises(ValueError, match="algorithm='minmax' is not allowed"):
        tq.calibrate(model, tq.configs.fp8(), bad, algorithm="minmax")
    with pytest.raises(ValueError, match="percentile=101 is not allowed"):
        tq.calibrate(model, tq.configs.fp8(), bad, algorithm="percentile", percentile=101)
    with pytest.raises(TypeError, match="config must be a tq.calibration.QuantConfig"):
        tq.calibrate(model, tq.recipes.mxfp8(), bad)


def test_a_module_that_never_runs_is_an_error_naming_it():
    model = MLP()
    with pytest.raises(RuntimeError, match="input quantizer of 'fc1' saw no data"):
        tq.calibrate(model, tq.configs.int8(), lambda m: m(torch.randn(0, 64)), progress=False)  # called, but with no rows
    assert not hasattr(model.fc1, "input_quantizer")


# ---------------------------------------------------------------------------------------------
# Summary, quant_state, restore
# ---------------------------------------------------------------------------------------------
def test_summary_lists_every_quantizable_module():
    model = SmallCNN().eval()
    tq.calibrate(model, tq.configs.int8(), _calib_loop([torch.randn(2, 3, 8, 8)]), progress=False)
    s = tq.summary(model)
    assert [r.name for r in s.rows] == ["conv1", "bn1", "conv2", "bn2", "fc"]
    bn = s.rows[1]
    assert (bn.module_class, bn.kind, bn.input, bn.weight, bn.output) == ("BatchNorm2d", "BatchNorm", "off", "off", "off")
    assert s.rows[2].weight.startswith("INT8 per-channel full amax(32, 1)∈[")
    text = str(s)
    assert "conv2" in text and "5 quantizable modules, 6 quantizers enabled" in text


def _save_load(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("algorithm", ["max", "mse"])
def test_quant_state_restores_on_a_fresh_model_bit_for_bit(algorithm):
    torch.manual_seed(3)
    model = SmallCNN().eval()
    tq.calibrate(
        model, tq.configs.int8(), _calib_loop([torch.randn(4, 3, 8, 8) for _ in range(2)]), algorithm=algorithm, progress=False
    )
    state = _save_load(tq.quant_state(model))
    weights = _save_load(model.state_dict())
    assert set(weights) == set(SmallCNN().state_dict())  # amaxes are not in the state_dict
    fresh = tq.restore(SmallCNN().eval(), state)
    fresh.load_state_dict(weights)
    x = torch.randn(3, 3, 8, 8)
    assert_bitwise_equal(fresh(x), model(x))
    assert tq.summary(fresh).rows == tq.summary(model).rows
    assert state["config"] == tq.configs.int8().to_dict() and state["algorithm"] == algorithm


def test_restore_into_another_architecture_names_missing_and_extra_modules():
    model = MLP()
    tq.calibrate(model, tq.configs.int8(), _calib_loop([torch.randn(2, 64)]), progress=False)
    state = tq.quant_state(model)
    other = MLP()
    other.fc3 = nn.Linear(4, 4)
    del other.fc2
    with pytest.raises(
        ValueError, match=r"in the state but not in the model: \['fc2'\]; modules in the model but not in the state: \['fc3'\]"
    ):
        tq.restore(other, state)
    assert not hasattr(other.fc1, "input_quantizer")  # checked before anything changed
    with pytest.raises(ValueError, match="already fake-quantized"):
        tq.restore(model, state)
    with pytest.raises(ValueError, match="not a tq.quant_state dict"):
        tq.restore(MLP(), {"modules": {}})
    narrow = MLP(h=96)
    with pytest.raises(ValueError, match=r"weight amax of 'fc1' has shape \(128, 1\); the model's weight needs \(96, 1\)"):
        tq.restore(narrow, state)


def test_wrapper_prefixes_do_not_change_names_or_state():
    torch.manual_seed(4)
    plain = MLP()
    compiled_then_calibrated = torch.compile(copy.deepcopy(plain), backend="eager")
    batches = [torch.randn(4, 64)]
    tq.calibrate(plain, tq.configs.int8(), _calib_loop(batches), progress=False)
    tq.calibrate(compiled_then_calibrated, tq.configs.int8(), lambda m: [m._orig_mod(x) for x in batches], progress=False)
    a, b = tq.quant_state(plain), tq.quant_state(compiled_then_calibrated)
    assert list(a["modules"]) == list(b["modules"]) == ["fc1", "norm", "fc2", "head"]
    for name in a["modules"]:
        for slot in ("input", "weight", "output"):
            x, y = a["modules"][name][slot]["amax"], b["modules"][name][slot]["amax"]
            assert (x is None and y is None) or torch.equal(x, y)
    # A submodule the user named "module" is not a wrapper: it keeps its name.
    holder = nn.Sequential()
    holder.module = nn.Linear(8, 8)
    tq.calibrate(holder, tq.configs.int8(), _calib_loop([torch.randn(2, 8)]), progress=False)
    assert list(tq.quant_state(holder)["modules"]) == ["module"]


def test_sync_batchnorm_converted_after_quantization_keeps_its_state():
    torch.manual_seed(5)
    model = SmallCNN().eval()
    tq.calibrate(model, tq.configs.int8(), _calib_loop([torch.randn(2, 3, 8, 8)]), progress=False)
    ref_rows = tq.summary(model).rows
    x = torch.randn(2, 3, 8, 8)
    y = model(x)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # no process group: runs on CPU in eval mode
    assert type(synced.bn1) is nn.SyncBatchNorm
    rows = tq.summary(synced).rows
    assert [r.module_class for r in rows] == ["Conv2d", "SyncBatchNorm", "Conv2d", "SyncBatchNorm", "Linear"]
    assert [dataclasses.replace(r, module_class="") for r in rows] == [dataclasses.replace(r, module_class="") for r in ref_rows]
    assert_bitwise_equal(synced(x), y)
    fresh = tq.restore(SmallCNN().eval(), tq.quant_state(synced))
    fresh.load_state_dict(synced.state_dict())
    assert_bitwise_equal(fresh(x), y)


def test_an_enabled_norm_quantizer_warns_once_detached_and_reattach_restores_it():
    torch.manual_seed(6)
    cfg = tq.configs.fp8().with_rules(QuantRule(name="bn2", output=tq.Float8Quantizer()))
    model = SmallCNN().eval()
    tq.calibrate(model, cfg, _calib_loop([torch.randn(2, 3, 8, 8)]), progress=False)
    x = torch.randn(2, 3, 8, 8)
    y = model(x)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    with pytest.warns(CalibrationWarning, match=r"'bn2' \(SyncBatchNorm\) was replaced after quantization"):
        tq.summary(synced)
    tq.calibration.reattach(synced)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tq.summary(synced)
    assert_bitwise_equal(synced(x), y)


def test_quantizers_that_cannot_serve_a_shape_are_disabled_and_reported():
    model = SmallCNN().eval()  # conv1's 3 input channels cannot form MX 32-blocks; its (16, 27) weight neither
    with pytest.warns(CalibrationWarning) as record:
        tq.calibrate(model, tq.configs.mxfp8(), _calib_loop([torch.randn(2, 3, 8, 8)]), progress=False)
    messages = "\n".join(str(w.message) for w in record)
    assert "conv1 (Conv2d): weight quantizer disabled, its (16, 27) weight does not fit" in messages
    assert "conv1 (Conv2d): input quantizer disabled, its (2, 8, 8, 3) input does not fit" in messages
    assert not model.conv1.input_quantizer.enabled and not model.conv1.weight_quantizer.enabled
    assert model.fc.weight_quantizer.enabled and model.conv2.weight_quantizer.enabled is False  # (32, 144): 144 % 32 != 0
    model(torch.randn(1, 3, 8, 8))  # runs: nothing left enabled that cannot serve its tensor


def test_norms_without_parameters_and_an_enabled_norm_output():
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32, elementwise_affine=False), nn.Linear(32, 8))
    cfg = tq.configs.fp8().with_rules(QuantRule(module_types=(nn.LayerNorm,), output=tq.Float8Quantizer()))
    x = torch.randn(4, 16)
    with torch.no_grad():
        h_float = model[0](x)  # what the norm sees while calibrating: the model computes in high precision
    tq.calibrate(model, cfg, lambda m: m(x), progress=False)
    norm = model[1]
    assert torch.equal(norm.output_quantizer.amax, F.layer_norm(h_float, (32,)).abs().amax())
    h = model[0](x)
    assert_bitwise_equal(
        norm(h), tq.quantize(F.layer_norm(h, (32,)), tq.Float8Quantizer(), amax=norm.output_quantizer.amax).dequantize()
    )
    fresh = tq.restore(
        nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32, elementwise_affine=False), nn.Linear(32, 8)), tq.quant_state(model)
    )
    fresh.load_state_dict(model.state_dict())
    assert_bitwise_equal(fresh(x), model(x))


# --- data-free calibration (forward_loop=None) ---------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))


@pytest.mark.parametrize("preset", ["int4_weight_only", "int8_weight_only", "int8_dynamic", "mxfp8"])
def test_data_free_calibration_equals_calibration_with_data(preset):
    """Configs whose activations need no calibration: forward_loop=None runs no forward pass and
    gives the model calibration with data gives (weight amaxes come from the weights)."""
    calls = []
    free, with_data = _mlp(), _mlp()
    free.register_forward_pre_hook(lambda m, a: calls.append(1))
    tq.calibrate(free, getattr(tq.configs, preset)(), None, progress=False)
    assert not calls
    x = torch.randn(8, 128)
    tq.calibrate(with_data, getattr(tq.configs, preset)(), lambda m: m(x), progress=False)
    assert torch.equal(free(x), with_data(x))
    assert str(tq.summary(free)) == str(tq.summary(with_data))


def test_data_free_refuses_what_needs_data_and_leaves_the_model():
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"cannot calibrate the static activation amaxes of '0' \(input: IntQuantizer"):
        tq.calibrate(model, tq.configs.int8(), None, progress=False)
    assert type(model[0]) is nn.Linear and all(torch.equal(t, before[k]) for k, t in model.state_dict().items())
    with pytest.raises(ValueError, match="algorithm='GPTQ.*needs calibration data"):
        tq.calibrate(model, tq.configs.int4_weight_only(32), None, algorithm="gptq", progress=False)
    with pytest.raises(ValueError, match="needs calibration data"):
        tq.calibrate(model, tq.configs.int8_weight_only(), None, algorithm="percentile", progress=False)
    with pytest.raises(TypeError, match="forward_loop must be a callable taking the model, or None"):
        tq.calibrate(model, tq.configs.int8_weight_only(), 3, progress=False)
