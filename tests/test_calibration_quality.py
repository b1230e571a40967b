"""PTQ quality: calibrated models stay within a stated SQNR of the float model; percentile and
MSE calibration beat max calibration on data with planted outliers; MoE per-expert amaxes.

SQNR floors (dB, output of the quantized model vs the float model, random weights and data):

- INT8 W8A8 (per-channel weights, per-tensor static activations): one INT8 operand whose amax is
  about 4.5 sigma has a uniform rounding error of step^2/12 with step = amax/127, i.e.
  10 log10(127^2 * 12 / 4.5^2) ~ 40 dB; a 3-layer MLP has 6 quantized operands, whose errors add:
  ~40 - 10 log10(6) ~ 32 dB (measured 32.0). Floor: 28 dB.
- FP8 E4M3 per tensor: 3 mantissa bits give a relative rounding error uniform in +-2^-4, i.e.
  10 log10(3 * 2^8) ~ 29 dB per operand, ~21 dB for 6 operands (measured 24.4: GELU/ReLU
  zeroes part of the signal exactly). Floor: 21 dB.
- ResNet-18 (20 convs + 1 linear quantized: 42 operands, BatchNorm between them, eval mode with
  running statistics from data, torchvision's initialisation): the per-operand figures are the
  same (~40 dB INT8, ~29 dB FP8) and the 42 errors add: ~40 - 10 log10(42) ~ 24 dB INT8,
  ~29 - 16 ~ 13 dB FP8 (measured 22.7 / 22.9 dB INT8 and 13.9 / 13.1 dB FP8 for seeds 0 / 1).
  Floors: 20 dB INT8, 11 dB FP8. (PyTorch's default initialisation, whose convs shrink the
  residual branches, gives 34 / 25 dB: the identity paths then carry most of the signal.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning, QuantConfig, QuantRule
from tqcompile.testing import sqnr


class MLP(nn.Module):
    def __init__(self, d=256, h=512):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


# ResNet-18 (He et al. 2015) with the layout and module names of torchvision's resnet18, used where
# torchvision cannot load (the package index's torchvision 0.28.0 is a CUDA build, which fails to
# load with a CPU-only torch 2.13); where it can, the tests use torchvision's own model.
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        chans, cin = (64, 128, 256, 512), 64
        for i, c in enumerate(chans):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, c, stride), BasicBlock(c, c, 1)))
            cin = c
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _torchvision_resnet18():
    try:
        from torchvision.models import resnet18
    except Exception:  # not installed, or a build for another torch (a CUDA torchvision fails to load on CPU torch)
        return None
    return resnet18()


def test_local_resnet18_is_torchvisions_layout():
    tv = _torchvision_resnet18()
    if tv is None:
        pytest.skip("torchvision is not installed for this torch build")
    ours = ResNet18()
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [(k, v.shape) for k, v in tv.state_dict().items()]


def _calibrated(model, cfg, batches, **kw):
    model = copy.deepcopy(model)
    return tq.calibrate(model, cfg, lambda m: [m(x) for x in batches], progress=False, **kw)


@pytest.mark.parametrize(("config", "floor"), [("int8", 28.0), ("fp8", 21.0)])
def test_mlp_sqnr(config, floor):
    torch.manual_seed(0)
    model = MLP()
    cal, test = [torch.randn(64, 256) for _ in range(4)], torch.randn(256, 256)
    q = _calibrated(model, getattr(tq.configs, config)(), cal)
    with torch.no_grad():
        got = sqnr(model(test), q(test))
    assert got >= floor, f"{config}: {got:.2f} dB < {floor} dB"


def test_resnet18_sqnr():
    torch.manual_seed(0)
    model = _torchvision_resnet18() or ResNet18()
    model.train()
    with torch.no_grad():  # running statistics from data, as a trained model has them
        for _ in range(2):
            model(torch.randn(8, 3, 32, 32))
    model.eval()
    cal, test = [torch.randn(4, 3, 32, 32)], torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        ref = model(test)
        quantized = {c: _calibrated(model, getattr(tq.configs, c)(), cal) for c in ("int8", "fp8")}
        results = {c: sqnr(ref, q(test)) for c, q in quantized.items()}
    assert results["int8"] >= 20.0 and results["fp8"] >= 11.0, results
    summary = tq.summary(quantized["int8"])
    assert sum(r.kind == "Conv2d" for r in summary.rows) == 20 and sum(r.kind == "BatchNorm" for r in summary.rows) == 20


def test_percentile_and_mse_beat_max_on_planted_outliers():
    # Activations with rare, large outliers. INT4 per-tensor activations (7 levels a side): with
    # max calibration the outliers set the step and most values round to zero; percentile and MSE
    # clip them. (With INT8, MSE keeps isolated outliers: clipping one costs more squared error
    # than the finer step saves; see docs/ptq.md.)
    torch.manual_seed(1)
    cfg = QuantConfig(
        (
            QuantRule(
                module_types=(nn.Linear,),
                input=tq.IntQuantizer(tq.Format.INT4),
                weight=tq.IntQuantizer(granularity=tq.Granularity.ROWWISE),
            ),
        )
    )

    def data(n):
        x = torch.randn(n, 64)
        idx = torch.randint(0, x.numel(), (n // 100,))
        x.view(-1)[idx] = 20.0 * torch.sign(torch.randn(idx.shape))
        return x

    layer = nn.Linear(64, 64)
    cal, test = [data(512) for _ in range(2)], data(1024)
    with torch.no_grad():
        ref = layer(test)
        got = {}
        for algorithm in ("max", "percentile", "mse"):
            q = _calibrated(layer, cfg, cal, algorithm=algorithm, percentile=99.9)
            got[algorithm] = (sqnr(ref, q(test)), float(q.input_quantizer.amax))
    assert got["max"][1] == 20.0
    assert got["percentile"][0] > got["max"][0] + 6 and got["mse"][0] > got["max"][0] + 6, got


def test_percentile_is_the_percentile_of_the_union_of_batches():
    layer = nn.Linear(4, 4)
    batches = [torch.arange(1.0, 1001.0).reshape(250, 4), torch.zeros(250, 4)]  # |x|: 1000 zeros and 1..1000
    q = _calibrated(layer, tq.configs.int8(), batches, algorithm="percentile", percentile=75.0)
    # The 75th percentile of the 2000 values is 500; histogram bins over [0, 1000] are 1000/2048 wide.
    assert abs(float(q.input_quantizer.amax) - 500.0) <= 1000 / 2048


# ---------------------------------------------------------------------------------------------
# MoE: per-expert amaxes
# ---------------------------------------------------------------------------------------------
class MoE(nn.Module):
    def __init__(self, experts=4, d=32, h=64):
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = tq.nn.GroupedLinear(experts, d, h, recipe=tq.recipes.fp8_tensorwise())

    def forward(self, x, m_splits=None):
        return self.experts(x, m_splits)


def test_grouped_linear_gets_one_amax_per_expert():
    torch.manual_seed(2)
    moe = MoE()
    with torch.no_grad():
        moe.experts.weight[2] *= 10  # one expert with larger weights
    x = torch.randn(4, 8, 32) * torch.tensor([1.0, 2.0, 3.0, 4.0]).view(4, 1, 1)
    tq.calibrate(moe, tq.configs.fp8(), lambda m: m(x), progress=False)
    e = moe.experts
    assert e.weight_quantizer.amax.shape == (4, 1, 1)
    for i in range(4):
        assert torch.equal(e.weight_quantizer.amax[i, 0, 0], e.weight[i].abs().amax())
        assert torch.equal(e.input_quantizer.amax[i], x[i].abs().amax())
    assert not e.output_quantizer.enabled and not moe.router.input_quantizer.enabled  # the router is left alone
    # Each expert's product uses its own scales: the same as quantizing expert by expert.
    y = moe(x)
    for i in range(4):
        xq = tq.quantize(x[i], tq.Float8Quantizer(), amax=e.input_quantizer.amax[i]).dequantize()
        wq = tq.quantize(e.weight[i], tq.Float8Quantizer()).dequantize()
        assert torch.equal(y[i], F.linear(xq, wq))


def test_grouped_linear_per_expert_and_channel_and_token_splits():
    torch.manual_seed(3)
    moe = MoE()
    x = torch.randn(24, 32)
    tq.calibrate(moe, tq.configs.int8(), lambda m: m(x, [6, 6, 6, 6]), progress=False)
    amax = moe.experts.weight_quantizer.amax
    assert amax.shape == (4, 64, 1) and torch.equal(amax, moe.experts.weight.abs().amax(-1, keepdim=True))
    y = moe(x, [6, 6, 6, 6])
    assert y.shape == (24, 64)
    assert torch.equal(moe(x, torch.tensor([6, 6, 6, 6])), y)  # counts as a tensor, as tq.nn.GroupedLinear takes them


def test_an_expert_without_tokens_gets_the_max_of_the_others():
    torch.manual_seed(4)
    moe = MoE()
    x = torch.randn(20, 32)
    with pytest.warns(CalibrationWarning, match=r"experts \[1\] of 'experts' received no tokens.*max over the other experts"):
        tq.calibrate(moe, tq.configs.fp8(), lambda m: m(x, [5, 0, 10, 5]), progress=False)
    amax = moe.experts.input_quantizer.amax
    parts = x.split([5, 0, 10, 5])
    assert torch.equal(amax[1], x.abs().amax()) and torch.equal(amax[2], parts[2].abs().amax())
    with pytest.raises(RuntimeError, match="input quantizer of 'experts' saw no data"):
        tq.calibrate(MoE(), tq.configs.fp8(), lambda m: m(torch.randn(0, 32), [0, 0, 0, 0]), progress=False)


def test_prepare_gives_a_template_whose_buffers_a_state_loads_into():
    torch.manual_seed(5)
    moe = MoE()
    x = torch.randn(24, 32)
    tq.calibrate(moe, tq.configs.int8(), lambda m: m(x, [6, 6, 6, 6]), progress=False)
    saved = tq.quant_state(moe)
    template = tq.calibration.prepare(MoE(), tq.configs.int8())
    target = tq.quant_state(template)
    assert [(n, s) for n, e in target["modules"].items() for s in ("input", "weight", "output") if e[s]["amax"] is not None] == [
        ("experts", "input"),
        ("experts", "weight"),
    ]
    for name, entry in saved["modules"].items():  # what DCP's load does: copy into the template's tensors
        for s in ("input", "weight", "output"):
            if entry[s]["amax"] is not None:
                target["modules"][name][s]["amax"].copy_(entry[s]["amax"])
    template.load_state_dict(moe.state_dict())
    assert torch.equal(template(x, [6, 6, 6, 6]), moe(x, [6, 6, 6, 6]))
    # A state whose experts are another rank's share does not restore silently.
    half = MoE(experts=2)
    with pytest.raises(ValueError, match="input amax of 'experts' holds 4 experts; the model's module has 2"):
        tq.restore(half, saved)
