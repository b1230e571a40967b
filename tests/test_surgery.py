"""The surgery layer (`tqcompile.surgery`): one naming, one plan/apply/undo, one class factory,
one registry of modules that read a child's weight, and `LayerSpec`s that both configuration
languages resolve to."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning
from tqcompile.calibration.modules import _LinearFQ
from tqcompile.distributed.checkpoint import quantization_metadata
from tqcompile.surgery import canonical_modules, layer_specs, unwrap
from tqcompile.surgery.classes import generated_class
from tqcompile.surgery.names import canonical_renamer
from tqcompile.surgery.plan import Decision, apply


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(32, 32)  # a user's own component named like DDP's: it stays in names
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        return self.out(self.module(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.ReLU(), nn.Linear(32, 16))
    return model


def test_canonical_names_drop_only_the_wrappers_own_components():
    model = _model()
    plain = [n for n, _ in model.named_modules()]
    model[0] = checkpoint_wrapper(model[0])
    wrapped = torch.compile(nn.DataParallel(model), backend="aot_eager")
    assert unwrap(wrapped) is model
    assert [n for n, _ in canonical_modules(wrapped)] == plain
    rename = canonical_renamer(wrapped)
    assert rename("_orig_mod.module.0._checkpoint_wrapped_module.module.weight") == "0.module.weight"
    assert rename("_orig_mod.module.2") == "2"


def test_convert_names_a_wrapped_models_layers_as_the_bare_model():
    seen = []
    model = torch.compile(_model(), backend="aot_eager")
    tq.convert(model, tq.recipes.fp8_tensorwise(), filter_fn=lambda m, fqn: seen.append(fqn) or True)
    assert seen == ["0.module", "0.out", "2"]
    assert unwrap(model)[2].tq_fqn == "2"
    assert set(quantization_metadata(model)) == {"0.module", "0.out", "2"}


def test_both_configuration_languages_resolve_to_layer_specs():
    x = torch.randn(8, 32)
    converted = tq.convert(_model(), tq.recipes.fp8_tensorwise())
    calibrated = tq.calibrate(_model(), tq.configs.fp8(), lambda m: m(x), progress=False)
    a, b = layer_specs(converted), layer_specs(torch.compile(calibrated, backend="aot_eager"))
    assert [(s.name, s.kind, s.weight_key) for s in a] == [(s.name, s.kind, s.weight_key) for s in b]
    assert {s.source for s in a} == {"recipe fp8_tensorwise"} and {s.source for s in b} == {"calibrated"}
    assert all(not s.weight.static and not s.input.static for s in a)
    assert all(s.input.static and s.input.amax is calibrated.get_submodule(s.name).input_quantizer.amax for s in b)


def test_apply_then_undo_puts_back_exactly_what_changed():
    class Mixin:
        tq_class_prefix = "Patched"

    model = _model()
    layer = model[2]
    weight, before = layer.weight, dict(layer.__dict__)

    def convert(d: Decision) -> None:
        d.module.__class__ = generated_class(type(d.module), Mixin)
        d.module.extra = nn.Linear(2, 2)
        d.module.weight = nn.Parameter(torch.zeros_like(d.module.weight))
        d.module.note = "converted"
        d.touches[0].flag = True

    undo = apply([Decision("2", "Linear", "convert", module=layer, touches=(model,)), Decision("0", "Block", "skip")], convert)
    assert type(layer).__name__ == "PatchedLinear" and layer.note == "converted" and model.flag
    undo.undo()
    assert type(layer) is nn.Linear and layer.weight is weight and "extra" not in layer._modules
    assert dict(layer.__dict__).keys() == before.keys() and not hasattr(model, "flag")


def test_a_conversion_that_fails_part_way_is_undone():
    layer = nn.Linear(4, 4)

    def convert(d: Decision) -> None:
        d.module.half_done = True
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        apply([Decision("", "Linear", "convert", module=layer)], convert)
    assert not hasattr(layer, "half_done")


def test_pickles_made_before_the_surgery_layer_still_load():
    # What pickle wrote for a converted nn.Linear subclass and a calibrated nn.Linear (their state left out).
    converted = (
        b"\x80\x02ctqcompile.nn.convert\n_new_converted\nctorch.nn.modules.linear\nNonDynamicallyQuantizableLinear\n"
        b"ctqcompile.nn.quantized_linear\nLinear\n\x86R."
    )
    calibrated = b"\x80\x02ctqcompile.calibration.modules\n_new_fake_quant\nctorch.nn.modules.linear\nLinear\nctqcompile.calibration.modules\n_LinearFQ\n\x86R."
    a, b = pickle.loads(converted), pickle.loads(calibrated)
    assert type(a) is generated_class(nn.modules.linear.NonDynamicallyQuantizableLinear, tq.nn.Linear)
    assert type(a).__name__ == "QuantizedNonDynamicallyQuantizableLinear"
    assert type(b) is generated_class(nn.Linear, _LinearFQ) and type(b).__name__ == "FakeQuantLinear"


class Reader(nn.Module):
    """Computes with its child's weight without calling the child."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        return F.linear(x, self.proj.weight, self.proj.bias)


@tq.nn.register_converter(Reader, unsupported_reason=lambda m, r: "no converter for it", reads_weights_of=lambda m: {"proj": "Reader.forward reads proj.weight"})
def _never(module, recipe):
    raise AssertionError("refused by unsupported_reason")


def test_one_registry_of_weight_readers_serves_convert_and_calibrate():
    with pytest.warns(tq.nn.ConversionWarning, match=r"proj \(Linear\): <root> \(Reader\) is not converted .*Reader.forward reads"):
        tq.convert(Reader(), tq.recipes.fp8_tensorwise())
    model, x = Reader(), torch.randn(4, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.calibrate(model, tq.configs.fp8(), lambda m: m(x), progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, CalibrationWarning)]
    assert any("proj (Linear): its parent Reader.forward reads proj.weight and never calls it" in s for s in said), said
    assert not hasattr(model.proj, "weight_quantizer")
