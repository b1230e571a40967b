"""PTQ/QAT as a new user meets them: models the other calibration tests never saw (depthwise and
grouped convs with residuals, a tied-embedding transformer LM, Conv1d + GroupNorm, dense MoE
experts), and the mistakes and habits users bring (casting to bf16 after calibration, pickling a
whole model, custom wrappers, lists where varargs are expected, calibrating in training mode).
"""

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning, ConfigError, QuantRule
from tqcompile.calibration import modules as fq_modules
from tqcompile.surgery import classes as surgery_classes
from tqcompile.testing import sqnr


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.dw, self.bn1 = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c)
        self.pw, self.bn2 = nn.Conv2d(c, c, 1, groups=2, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.pw(F.relu(self.bn1(self.dw(x))))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.b1, self.b2, self.fc = ResBlock(32), ResBlock(32), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(self.b2(self.b1(F.relu(self.bn(self.stem(x))))).mean((2, 3)))


class TinyLM(nn.Module):
    """Embedding, pre-norm attention from nn.Linear projections, MLP, lm_head tied to the embedding."""

    def __init__(self, vocab: int = 64, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.emb, self.ln1, self.ln2, self.ln_f = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return self.lm_head(self.ln_f(x))


class AudioNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.gn, self.c2, self.fc = (
            nn.Conv1d(16, 64, 5, padding=2),
            nn.GroupNorm(8, 64),
            nn.Conv1d(64, 64, 3, padding=1),
            nn.Linear(64, 8),
        )

    def forward(self, x):
        return self.fc(F.silu(self.c2(F.silu(self.gn(self.c1(x))))).mean(-1))


class DenseMoE(nn.Module):
    """Experts fed in the dense (experts, tokens, features) form (what compiled QAT needs)."""

    def __init__(self, experts: int = 4, d: int = 32, f: int = 64):
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.up = tq.nn.GroupedLinear(experts, d, f, recipe=tq.recipes.fp8_tensorwise())
        self.down = tq.nn.GroupedLinear(experts, f, d, recipe=tq.recipes.fp8_tensorwise())

    def forward(self, x):  # x: (experts, tokens, d), already dispatched
        gate = torch.softmax(self.router(x), -1).amax(-1, keepdim=True)
        return gate * self.down(F.gelu(self.up(x)))


def moe_float(m: DenseMoE, x: torch.Tensor) -> torch.Tensor:
    """The float reference of DenseMoE (a calibrated GroupedLinear computes per-expert F.linear, not its recipe)."""
    gate = torch.softmax(m.router(x), -1).amax(-1, keepdim=True)
    return gate * torch.einsum("etf,edf->etd", F.gelu(torch.einsum("etd,efd->etf", x, m.up.weight)), m.down.weight)


def batches(kind: str, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = {"cnn": (4, 3, 8, 8), "audio": (4, 16, 32), "moe": (4, 64, 32)}
    if kind == "lm":
        return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]
    return [torch.randn(shape[kind], generator=g) for _ in range(n)]


MODELS = {"cnn": CNN, "lm": TinyLM, "audio": AudioNet, "moe": DenseMoE}
PRESETS = {
    "int8": (tq.configs.int8, 30.0),
    "fp8": (tq.configs.fp8, 24.0),
    "int4_weight_only": (lambda: tq.configs.int4_weight_only(32), 20.0),
    "mxfp8": (tq.configs.mxfp8, 22.0),
    "nvfp4": (tq.configs.nvfp4, 12.0),  # 4 bits on weights and activations: ~13-26 dB measured
}
# Every model, preset and algorithm appears, in few enough pairs to keep the sweep fast.
CASES = [
    ("cnn", "int8", "percentile"),
    ("cnn", "nvfp4", "max"),
    ("lm", "fp8", "mse"),
    ("lm", "mxfp8", "max"),
    ("lm", "int4_weight_only", "max"),
    ("audio", "int4_weight_only", "mse"),
    ("audio", "nvfp4", "percentile"),
    ("moe", "int8", "max"),
    ("moe", "fp8", "percentile"),
    ("moe", "nvfp4", "mse"),
]


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]().eval()


def run(kind: str, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return moe_float(m, x) if kind == "moe" and not isinstance(m.up, tq.calibration.FakeQuantModule) else m(x)


@pytest.mark.parametrize("kind,preset,algorithm", CASES)
def test_unseen_models_calibrate_save_and_restore(kind, preset, algorithm):
    model, (make_config, min_db) = build(kind), PRESETS[preset]
    cal, test = batches(kind, 2, 1), batches(kind, 2, 7)
    with torch.no_grad():
        ref = [run(kind, model, x) for x in test]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)  # layers a format cannot serve (27-wide stem for MX)
        tq.calibrate(model, make_config(), lambda m: [m(x) for x in cal], algorithm=algorithm, progress=False)
    with torch.no_grad():
        out = [model(x) for x in test]
    for r, o in zip(ref, out):
        assert sqnr(r, o) >= min_db, f"{kind} {preset} {algorithm}: {sqnr(r, o):.1f} dB < {min_db}"
    table = str(tq.summary(model))
    names = [n for n, m in model.named_modules() if isinstance(m, tq.calibration.FakeQuantModule)]
    assert all(n in table for n in names) and f"{len(names)} quantizable modules" in table

    buf = io.BytesIO()
    torch.save({"quant": tq.quant_state(model), "weights": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = tq.restore(MODELS[kind]().eval(), saved["quant"])
    fresh.load_state_dict(saved["weights"])
    with torch.no_grad():
        for x, o in zip(test, out):
            assert torch.equal(fresh(x), o)


# --------------------------------------------------------------------------------------------
# Defects found as a new user (each test failed before its fix)
# --------------------------------------------------------------------------------------------
def test_casting_calibrated_model_to_bf16_keeps_float32_amaxes():
    """model.to(torch.bfloat16) after calibration cast the amax buffers too, and every forward then
    raised "tq.quantize: amax must be a float32 tensor, got torch.bfloat16"."""
    model, x = build("lm"), batches("lm", 2, 1)
    tq.calibrate(model, tq.configs.fp8(), lambda m: [m(t) for t in x], progress=False)
    amax = model.up.input_quantizer.amax.clone()
    model.to(torch.bfloat16)
    assert model.up.input_quantizer.amax.dtype == torch.float32 and torch.equal(model.up.input_quantizer.amax, amax)
    assert model(x[1]).dtype == torch.bfloat16
    model.half().float()
    assert torch.equal(model.up.input_quantizer.amax, amax)  # the calibrated value, not a bf16/fp16 rounding


def test_pickling_a_whole_calibrated_model():
    """torch.save(model) (and multiprocessing) failed: "Can't pickle <class '...FakeQuantEmbedding'>:
    attribute lookup FakeQuantEmbedding on torch.nn.modules.sparse failed"."""
    model, x = build("lm"), batches("lm", 2, 1)
    tq.calibrate(model, tq.configs.int8(), lambda m: [m(t) for t in x], progress=False)
    buf = io.BytesIO()
    torch.save(model, buf)
    surgery_classes._GENERATED.clear()  # as in a new process, where the fake-quant classes do not exist yet
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.up).__name__ == "FakeQuantLinear" and isinstance(loaded.up, nn.Linear)
    assert torch.equal(loaded(x[1]), model(x[1]))
    assert tq.summary(loaded).rows == tq.summary(model).rows


class MyWrapper(nn.Module):
    """A wrapper tqcompile does not know (like DeepSpeed's engine): it adds 'module.' to every name."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def test_unknown_wrapper_restore_names_the_prefix_and_inner_state_works():
    """quant_state(wrapper.module) raised "the model is not calibrated" (the record lived only on the
    wrapper), and restoring a wrapped state into the bare model gave no clue about the prefix."""
    x = batches("audio", 2, 1)
    inner = build("audio")
    wrapped = MyWrapper(inner)
    tq.calibrate(wrapped, tq.configs.int8(), lambda m: [m(t) for t in x], progress=False)
    with pytest.raises(ValueError, match=r"differs only by the leading 'module\.'.*tq\.quant_state\(wrapper\.module\)"):
        tq.restore(AudioNet(), tq.quant_state(wrapped))
    fresh = tq.restore(AudioNet(), tq.quant_state(inner))  # the inner model's state has bare names
    fresh.load_state_dict(inner.state_dict())
    assert torch.equal(fresh(x[1]), wrapped(x[1]))
    with pytest.raises(ValueError, match=r"differs only by the leading 'module\.': the model is a wrapper"):
        tq.restore(MyWrapper(AudioNet()), tq.quant_state(inner))


def test_config_errors_name_the_bad_element():
    """with_rules([...]) (a list, not varargs) raised with the repr of every preset rule: pages of text."""
    rule = QuantRule.disable("fc")
    with pytest.raises(ConfigError, match=r"with_rules: \[QuantRule.*separate arguments") as e:
        tq.configs.int8().with_rules([rule])
    assert "IntQuantizer" not in str(e.value)
    with pytest.raises(ConfigError, match=r"rules\[1\]='fc' is not allowed"):
        tq.calibration.QuantConfig((rule, "fc"))
    assert tq.configs.int8().with_rules(*[rule]).rules[-1] == rule


def test_calibrating_in_training_mode_warns():
    """Calibrating a BatchNorm/Dropout model left in training mode silently changed its running
    statistics and calibrated on batch statistics; now it says so (and eval mode stays quiet)."""
    x = batches("cnn", 2, 1)
    model = build("cnn").train()
    with pytest.warns(CalibrationWarning, match=r"bn \(BatchNorm2d\).*training mode.*model\.eval\(\)"):
        tq.calibrate(model, tq.configs.int8(), lambda m: [m(t) for t in x], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)
        tq.calibrate(build("cnn"), tq.configs.int8(), lambda m: [m(t) for t in x], progress=False)
        tq.calibrate(build("lm").train(), tq.configs.int8(), lambda m: m(batches("lm", 1, 1)[0]), progress=False)  # no BN/dropout


def test_restore_with_a_rule_naming_a_local_class():
    """A rule naming a class defined inside a function (or another script's __main__) made tq.restore
    raise "cannot import '...<locals>'", though restoring needs only each module's saved quantizers."""

    class Proj(nn.Linear):
        pass

    def build_local() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(Proj(32, 32), nn.ReLU(), nn.Linear(32, 32))

    model, x = build_local(), torch.randn(8, 32)
    tq.calibrate(
        model, tq.configs.int8().with_rules(QuantRule(module_types=(Proj,), input=False)), lambda m: m(x), progress=False
    )
    buf = io.BytesIO()
    torch.save(tq.quant_state(model), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = tq.restore(build_local(), state)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(x), model(x)) and not fresh[0].input_quantizer.enabled
    assert tq.quant_state(fresh)["config"] == state["config"]  # kept as saved
    with pytest.raises(ConfigError, match="ste='sideways'"):
        tq.restore(build_local(), {**state, "config": {**state["config"], "ste": "sideways"}})


def test_nan_weights_raise_naming_the_module():
    """A NaN weight was silently turned into a finite fake-quantized value (the amax ignores NaN), so
    the quantized model hid a broken float model; activations already raised."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with torch.no_grad():
        model[1].weight[3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"weight of module '1' holds NaN"):
        tq.calibrate(model, tq.configs.int8(), lambda m: m(torch.randn(4, 32)), progress=False)
    assert type(model[0]) is nn.Linear  # left as it was


def test_unmatched_rule_with_a_wrapper_prefix_explains_canonical_names():
    model = nn.DataParallel(nn.Sequential(nn.Linear(32, 32)))
    with pytest.warns(CalibrationWarning, match=r"'module\.0'\) matches no module.*without DDP's/DataParallel's 'module\.'"):
        tq.calibrate(
            model, tq.configs.int8().with_rules(QuantRule.disable("module.0")), lambda m: m(torch.randn(4, 32)), progress=False
        )


def test_percentile_with_a_loop_that_runs_other_data_each_pass():
    """A forward_loop drawing fresh random batches (or augmenting) ran other data in the histogram
    pass; torch.histc silently dropped every value beyond the first pass's max, so the percentile
    came out lower than the data's. Now they count at the top of the range, with a warning."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 64)
    first, second = torch.randn(512, 64), 10 * torch.randn(512, 64)  # the second pass is much wider
    passes = iter([first, second])
    with pytest.warns(CalibrationWarning, match=r"histogram pass of forward_loop ran other data.*reached <root>\.input"):
        tq.calibrate(layer, tq.configs.int8(), lambda m: m(next(passes)), algorithm="percentile", percentile=99.0, progress=False)
    # Most of the second pass lies beyond the first pass's max: its 99th percentile is that max (the top bin's edge).
    assert float(layer.input_quantizer.amax) == pytest.approx(float(first.abs().max()), rel=1e-6)


class ViTBlock(nn.Module):
    """A ViT block built on nn.MultiheadAttention, whose forward reads out_proj.weight itself."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), nn.MultiheadAttention(d, 4, batch_first=True), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


@pytest.mark.parametrize("config", [tq.configs.int8(), tq.configs.mxfp8()], ids=["int8", "mxfp8"])
def test_multihead_attention_out_proj_is_left_out_and_said_so(config):
    # out_proj used to be converted although MultiheadAttention never calls it: a static config
    # (int8) failed calibration ("saw no data"), a dynamic one (mxfp8) listed it as quantized while
    # it ran in high precision.
    torch.manual_seed(0)
    model, data = ViTBlock().eval(), torch.randn(4, 8, 32)
    with pytest.warns(
        CalibrationWarning, match=r"attn\.out_proj \(NonDynamicallyQuantizableLinear\): its parent nn\.MultiheadAttention"
    ):
        tq.calibrate(model, config, lambda m: m(data), progress=False)
    names = [r.name for r in tq.summary(model).rows]
    assert "attn.out_proj" not in names and "fc1" in names
    assert not isinstance(model.attn.out_proj, fq_modules.FakeQuantModule)
    fresh = tq.restore(ViTBlock().eval(), tq.quant_state(model))  # restore skips it the same way
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(data), model(data))
