"""Checkpoints you can trust (issue 25): a saved quantization state is data that `tq.restore`
checks before it changes anything, and never a reason to import code; checkpoint names keep the
user's own components; a model without data (meta device) is refused with a message that names
the tensor and what to do."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.calibration import ConfigError, QuantRule
from tqcompile.distributed.checkpoint import quantization_metadata


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))


def _meta_mlp() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))


def _state(config: tq.calibration.QuantConfig | None = None) -> dict:
    """A calibrated `_mlp`'s state, as `torch.load(..., weights_only=True)` reads it back."""
    model = _mlp()
    tq.calibrate(model, config or tq.configs.int8(), lambda m: m(torch.randn(16, 32)), progress=False)
    buf = io.BytesIO()
    torch.save(tq.quant_state(model), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _naming(state: dict, module_type: str) -> dict:
    """`state` with its config's first rule naming `module_type`."""
    rules = [dict(r) for r in state["config"]["rules"]]
    rules[0]["module_types"] = [module_type]
    return {**state, "config": {**state["config"], "rules": rules}}


# --------------------------------------------------------------------------------------------
# A state's module types are resolved, never imported
# --------------------------------------------------------------------------------------------
def test_restore_never_imports_what_a_state_names(tmp_path, monkeypatch, capsys):
    """A state naming ``"this.X"`` printed the Zen of Python: restore imported every module a rule's
    `module_types` named (and silently dropped the rules where the name was no class). It now
    resolves names only among the model's classes and those registered with tq, and refuses others."""
    (tmp_path / "tq_planted.py").write_text(
        "import pathlib\nfrom torch import nn\n"
        f"pathlib.Path({str(tmp_path / 'ran')!r}).write_text('imported')\n"
        "class Net(nn.Module):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "this", raising=False)
    state = _state()
    for name in ("this.X", "os.system", "tq_planted.Net"):
        model = _mlp()
        with pytest.raises(ConfigError, match=re.escape(repr(name)) + r".*never imports.*register_module_type"):
            tq.restore(model, _naming(state, name))
        assert type(model[0]) is nn.Linear  # refused before anything changed
    assert "this" not in sys.modules and "tq_planted" not in sys.modules
    assert not (tmp_path / "ran").exists()
    assert "Zen of Python" not in capsys.readouterr().out


def test_restore_resolves_module_types_among_the_models_and_registered_classes():
    """A rule naming a class the model does not contain restores once the class is registered; the
    presets' classes (LayerNorm, Embedding, ... absent from this model) are registered by tq."""

    class Absent(nn.Linear):
        pass

    rule = QuantRule(module_types=(Absent,), input=False, must_match=False)
    state = _state(tq.configs.int8().with_rules(rule))
    with pytest.raises(ConfigError, match=r"'[\w.]*<locals>\.Absent'.*not a class of the model"):
        tq.restore(_mlp(), state)
    tq.calibration.register_module_type(Absent)
    fresh = tq.restore(_mlp(), state)
    assert tq.quant_state(fresh)["config"] == state["config"]
    assert tq.calibration.QuantConfig.from_dict(state["config"]).rules[-1] == rule
    with pytest.raises(ConfigError, match=r"register_module_type: 'fc' is not allowed; allowed: nn.Module subclasses"):
        tq.calibration.register_module_type("fc")


# --------------------------------------------------------------------------------------------
# Amaxes are checked before the model changes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("slot", ["input", "weight"])
def test_restore_refuses_non_finite_amaxes(slot, value):
    state = _state()
    amax = state["modules"]["2"][slot]["amax"].clone()
    amax.view(-1)[0] = value
    state["modules"]["2"][slot]["amax"] = amax
    model = _mlp()
    bad = "NaN" if value != value else "inf"
    with pytest.raises(ValueError, match=rf"tq.restore: the {slot} amax of '2' holds {bad}; .*finite"):
        tq.restore(model, state)
    assert type(model[2]) is nn.Linear


@pytest.mark.parametrize(
    ("config", "slot", "shape", "want"),
    [
        (tq.configs.int8(), "input", (32,), ()),  # a tensor-level input amax
        (tq.configs.fp8(), "weight", (32, 1), ()),  # a tensor-level weight amax
    ],
)
def test_restore_refuses_an_amax_of_the_wrong_shape(config, slot, shape, want):
    state = _state(config)
    state["modules"]["0"][slot]["amax"] = torch.ones(shape)
    model = _mlp()
    with pytest.raises(ValueError, match=re.escape(f"the {slot} amax of '0' has shape {shape}; the model's {slot} needs {want}")):
        tq.restore(model, state)
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize(("amax", "got"), [(1.5, "float"), (torch.tensor(3), "a torch.int64 tensor")])
def test_restore_refuses_an_amax_that_is_no_float_tensor(amax, got):
    state = _state()
    state["modules"]["0"]["input"]["amax"] = amax
    with pytest.raises(ValueError, match=f"the input amax of '0' is {got}; allowed: a floating-point tensor"):
        tq.restore(_mlp(), state)


# --------------------------------------------------------------------------------------------
# Checkpoint names
# --------------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(32, 32)

    def forward(self, x):
        return self.mlp(x)


def test_checkpoint_names_strip_whole_wrapper_components():
    """Wrapper prefixes were removed with str.replace, inside components too:
    ``layers.0._checkpoint_wrapped_module.mlp.fc1`` became ``layers.0._checkpoint_wrapped_mlp.fc1``
    and a user's ``encoder.submodule.fc`` became ``encoder.subfc``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Module()
    model.layers = nn.ModuleList([_Block()])
    model.encoder = nn.Module()
    model.encoder.submodule = nn.Module()
    model.encoder.submodule.fc = nn.Linear(32, 32)
    tq.convert(model, tq.recipes.fp8_tensorwise())
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    names = set(quantization_metadata(torch.compile(model, backend="aot_eager")))
    assert names == {"layers.0.mlp.fc1", "encoder.submodule.fc"}


# --------------------------------------------------------------------------------------------
# Meta-device models
# --------------------------------------------------------------------------------------------
def test_meta_model_errors_name_the_tensor_and_the_fix(tmp_path):
    """A model built on the meta device failed with "Tensor.item() cannot be called on meta tensors"
    (calibrate, export) or was saved as a state of meta amaxes (quant_state)."""
    with pytest.raises(ValueError, match=r"tq.calibrate: parameter '0\.weight' is on the meta device.*load_state_dict"):
        tq.calibrate(_meta_mlp(), tq.configs.int8(), lambda m: m(torch.randn(4, 32)))
    prepared = tq.calibration.prepare(_meta_mlp(), tq.configs.int8())  # the structure only, as restore builds it
    assert prepared[0].weight_quantizer.amax.shape == (32, 1)
    converted = tq.convert(_meta_mlp(), tq.recipes.fp8_tensorwise())  # legitimate: export(checkpoint=...) reads such a skeleton
    with pytest.raises(ValueError, match=r"tq.export: .*'0\.weight' is on the meta device.*checkpoint="):
        tq.export(converted, str(tmp_path / "out"))
    restored = tq.restore(_meta_mlp(), _state())  # the structure only: restore and summary work on it
    assert "amax(32, 1) on meta" in str(tq.summary(restored))
    with pytest.raises(ValueError, match=r"tq.quant_state: the input amax of '0' is on the meta device"):
        tq.quant_state(restored)
    state = _state()
    state["modules"]["0"]["weight"]["amax"] = torch.ones(32, 1, device="meta")
    with pytest.raises(ValueError, match=r"tq.restore: the weight amax of '0' is on the meta device"):
        tq.restore(_mlp(), state)


def test_weights_offloaded_by_accelerate_name_the_offload_and_quantize_checkpoint():
    """A model loaded with `device_map="auto"` and too little memory holds meta placeholders whose
    values accelerate's hooks keep on the CPU or disk (checked with accelerate 1.15): the error said
    "built under torch.device('meta')" and advised `to_empty`, which would throw the weights away.
    The hook is stood in for here (accelerate is not a dependency): what tq reads is its `offload`."""

    class AlignDevicesHook:  # accelerate's, as tq sees it
        offload = True

    class SequentialHook:
        hooks = (AlignDevicesHook(),)

    for hook in (AlignDevicesHook(), SequentialHook()):
        model = _meta_mlp()
        model[0]._hf_hook = hook
        with pytest.raises(ValueError, match=r"'0\.weight' is offloaded by accelerate.*tq.quantize_checkpoint\(path, out, config\)"):
            tq.calibrate(model, tq.configs.int8(), lambda m: m(torch.randn(4, 32)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process, on purpose
def test_a_checkpoint_saved_with_the_old_names_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before the fix hold the cut names; `load` still matches them."""
    from tqcompile.distributed import checkpoint

    def build():
        torch.manual_seed(0)
        model = nn.Module()
        model.encoder = nn.Module()
        model.encoder.submodule = nn.Module()
        model.encoder.submodule.fc = nn.Linear(32, 32)
        return tq.convert(model, tq.recipes.fp8_tensorwise())

    saved = build()
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "quantization_metadata", lambda model: checkpoint._older_metadata(model, checkpoint._substrings_removed))
        checkpoint.save(saved, None, str(tmp_path))
    fresh = build()
    with torch.no_grad():
        fresh.encoder.submodule.fc.weight.zero_()
    checkpoint.load(fresh, None, str(tmp_path))
    assert torch.equal(fresh.encoder.submodule.fc.weight, saved.encoder.submodule.fc.weight)
