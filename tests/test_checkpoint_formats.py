"""Checkpoint formats are classes (issue 26): a third format is one `CheckpointFormat` subclass and
one registration, exported and loaded back bit for bit; an MX element maps to a compressed-tensors
format with one call made from outside `tqcompile.export`; the engines' facts live in one module;
and export branches on no quantizer class and imports no private name of another package."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

import tqcompile as tq
from tqcompile.engines import fused_sibling_groups
from tqcompile.export import FORMATS, ExportError
from tqcompile.export import compressed_tensors as ct
from tqcompile.export.checkpoint_format import CheckpointFormat, LayerScheme, register_format
from tqcompile.export.decode import invert
from tqcompile.export.scales import GlobalScaleTensor
from tqcompile.formats import Format
from tqcompile.quantizers import Float8Quantizer, MXQuantizer
from tqcompile.quantizers.base import quantizer_families

transformers = pytest.importorskip("transformers")
from test_export import _calibrated, _config, tiny_llama  # noqa: E402

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
EXPORT = Path(__file__).resolve().parents[1] / "tqcompile" / "export"


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@dataclasses.dataclass(frozen=True)
class TinyScheme:
    def describe(self) -> str:
        return "tiny-fp8 W8A8 per tensor"


class TinyFP8(CheckpointFormat):
    """A third format, as docs/adding_a_checkpoint_format.md describes it: FP8 E4M3 per tensor with
    static inputs, the scales as they are, the config a single JSON object."""

    NAME = QUANT_METHOD = "tiny-fp8"
    IGNORE_EXPERTS = "per_expert"
    WEIGHT_GLOBAL_SCALE = GlobalScaleTensor("weight_global_scale", reciprocal=False)  # no family here has one
    INPUT_GLOBAL_SCALE = GlobalScaleTensor("input_global_scale", reciprocal=False)
    LAYER_TENSORS = ("weight", "weight_scale", "input_scale")

    def scheme_of(self, unit):
        if unit.weight_q != Float8Quantizer() or unit.input_q != Float8Quantizer() or unit.input_amax is None or unit.experts:
            raise ExportError(f"tq.export: layer {unit.name!r} has no tiny-fp8 form; it holds FP8 E4M3 per tensor with static inputs")
        return TinyScheme()

    def layer_tensors(self, unit, scheme, qw, out_rows, in_features):
        name, scale = self.input_scale(unit)
        return {"weight": (qw.data, "rows"), "weight_scale": (qw.scale_inv.float().reshape(()), "tensor"), name: (scale.reshape(()), "tensor")}

    def quantization_config(self, groups, ignore, extra_targets=()):
        return {"quant_method": self.QUANT_METHOD, "ignore": sorted(ignore)}

    def check_targets(self, extra_targets):
        if extra_targets:
            raise ExportError(f"tq.export: tiny-fp8 cannot name {sorted(extra_targets)}")

    def scheme_resolver(self, qc, model):
        found = invert(self.scheme_of, lambda scheme: True, group_size=None, block=None, input_group_size=None)
        scheme = dataclasses.replace(found, text="tiny-fp8")
        return lambda prefix: scheme


@pytest.fixture
def tiny_format():
    fmt = register_format(TinyFP8())
    try:
        yield fmt
    finally:
        del FORMATS[fmt.NAME]


def test_a_third_format_is_one_class_and_one_registration(tmp_path, tiny_format):
    model = _calibrated("fp8_tensor")
    path = str(tmp_path / "tiny")
    report = tq.export(model, path, format="tiny-fp8")
    assert {r.scheme for r in report.rows} == {"tiny-fp8 W8A8 per tensor"} and report.ignored == ["lm_head"]
    assert json.load(open(os.path.join(path, "config.json")))["quantization_config"] == {"quant_method": "tiny-fp8", "ignore": ["lm_head"]}
    loaded = tq.load_exported(path)
    unit = loaded.get_submodule("model.layers.0.self_attn.q_proj")
    assert unit.weight_quantizer.quantizer == Float8Quantizer() and unit.input_quantizer.amax is not None
    assert torch.equal(_logits(loaded), _logits(model))
    again = str(tmp_path / "again")
    tq.export(loaded, again, format="tiny-fp8")
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == open(os.path.join(again, "model.safetensors"), "rb").read()
    with pytest.raises(ExportError, match="has no tiny-fp8 form"):
        tq.export(_calibrated("int8_static"), str(tmp_path / "int8"), format="tiny-fp8")


def test_format_names_come_from_the_registry(tmp_path, tiny_format):
    with pytest.raises(ValueError, match=r"allowed: 'compressed-tensors', 'modelopt', 'mxfp4', 'tiny-fp8'"):
        tq.export(tiny_llama(), str(tmp_path / "x"), format="gguf")


def test_an_mx_element_registers_from_outside_export(tmp_path, monkeypatch):
    """What adding an MX element takes in export: one `register_mx_element` call. Shown with E5M2
    in place of E4M3 (compressed-tensors names MX elements by width: both would be 8 bits)."""
    with pytest.raises(ValueError, match="num_bits=8"):
        ct.register_mx_element(Format.E5M2, "mxfp8-quantized")
    monkeypatch.setattr(ct, "_MX_ELEMENTS", {})
    ct.register_mx_element(Format.E5M2, "mxfp8-quantized")
    mx = MXQuantizer(Format.E5M2)
    model = tiny_llama()
    tq.calibrate(model, _config(mx, mx), lambda m: m(IDS), progress=False)
    path = str(tmp_path / "e5m2")
    tq.export(model, path)
    (group,) = json.load(open(os.path.join(path, "config.json")))["quantization_config"]["config_groups"].values()
    assert group["format"] == "mxfp8-quantized" and group["weights"]["num_bits"] == 8 and group["weights"]["group_size"] == 32
    loaded = tq.load_exported(path)
    assert loaded.get_submodule("model.layers.0.mlp.up_proj").weight_quantizer.quantizer == mx
    assert torch.equal(_logits(loaded), _logits(model))
    with pytest.raises(ExportError, match=r"MXQuantizer E5M2 and NVFP4Quantizer"):  # what exports, as registered
        tq.export(_calibrated("mxfp8"), str(tmp_path / "e4m3"))


def test_fused_siblings_are_one_engine_fact():
    names = ["m.q_proj", "m.k_proj", "m.v_proj", "m.o_proj", "n.k_proj", "n.v_proj", "gate_proj", "up_proj", "w1"]
    assert fused_sibling_groups(names) == [["m.q_proj", "m.k_proj", "m.v_proj"], ["m.k_proj", "m.v_proj"], ["n.k_proj", "n.v_proj"], ["gate_proj", "up_proj"]]
    from tqcompile.calibration.fused import FUSED_SIBLINGS
    from tqcompile.engines import FUSED_SIBLINGS as ENGINE_FACT

    assert FUSED_SIBLINGS is ENGINE_FACT


def test_export_branches_on_no_quantizer_class_and_reaches_into_no_other_package():
    classes = {c.__name__ for c in quantizer_families()} | {"Quantizer"}
    branches, private = [], []
    for path in sorted(EXPORT.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tqcompile"):
                for a in node.names:
                    imported[a.asname or a.name] = node.module
                    if a.name.startswith("_"):
                        private.append(f"{path.name}:{node.lineno} {node.module}.{a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                branches += [f"{path.name}:{node.lineno}" for k in kinds if getattr(k, "id", None) in classes]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in imported:
                    private.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    assert not branches, f"isinstance on a quantizer class in tqcompile/export (register per family instead): {branches}"
    assert not private, f"tqcompile/export reaches into private names: {private}"


def test_no_isinstance_on_a_concrete_quantizer_class_outside_the_quantizers():
    # Issue 26: layers above tqcompile/quantizers ask a quantizer's capabilities (element_format,
    # layout, has_global_scale, ...) or compare values; the class of a family is the family's business.
    classes = {c.__name__ for c in quantizer_families()}
    package = EXPORT.parent
    branches = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "quantizers":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                names = [getattr(k, "id", None) or getattr(k, "attr", None) for k in kinds]
                branches += [f"{path.relative_to(package)}:{node.lineno} {n}" for n in names if n in classes]
    assert not branches, f"isinstance on a concrete quantizer class outside tqcompile/quantizers: {branches}"


def test_load_candidates_follow_the_registries():
    # Every MX element format is a candidate: a checkpoint scheme resolves through the families.
    scheme = ct.COMPRESSED_TENSORS.group_scheme(
        {"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"}, "format": "mxfp4-pack-quantized"},
        "layer", "group_0", None,
    )
    assert isinstance(scheme, LayerScheme) and scheme.weight_q == MXQuantizer(Format.E2M1) and scheme.input_q is None
