"""The `LayerSpec`s of fake-quantized layers (`tq.calibrate`, `tq.restore`, QAT;
`tqcompile.surgery.specs`): each slot's quantizer, its static amax (the model's own buffer) or
none (dynamic), and how a weight transform made the weight."""

from __future__ import annotations

from torch import nn

from tqcompile.calibration.algorithms import SCALE_SEARCH
from tqcompile.calibration.fake_quant import TensorQuantizer
from tqcompile.calibration.modules import ExpertGemmQuantizers, class_name, kind_of, slots_of
from tqcompile.surgery.specs import LayerSpec, OperandSpec, register_spec_reader

__all__ = ["calibrated_specs", "transformed"]


def transformed(q: TensorQuantizer) -> bool:
    """Whether a weight transform (GPTQ, AWQ, SmoothQuant) made this quantizer's weight."""
    return q.enabled and q.method is not None and q.method not in SCALE_SEARCH


def _operand(q: TensorQuantizer) -> OperandSpec | None:
    if not q.enabled:
        return None
    return OperandSpec(q.quantizer, q.amax, q.num_experts is not None, q.method if transformed(q) else None)


def _key(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


@register_spec_reader(first=True)
def calibrated_specs(name: str, module: nn.Module) -> list[LayerSpec] | None:
    """The spec of `module` (named `name`) if it holds fake quantizers (every quantizer off included)."""
    qs = slots_of(module)
    if qs is None:
        return None
    found = kind_of(module)
    kind = found[0] if found is not None else type(module).__name__
    ops = {s: _operand(q) for s, q in qs.items()}
    if isinstance(module, ExpertGemmQuantizers):
        layer, gemm = name.rpartition(".")[0], module.gemm
        keys = dict(weight_key=_key(layer, gemm.weight), bias_key=None if gemm.bias is None else _key(layer, gemm.bias))
        shape = dict(experts=True, transposed=gemm.transposed)
    else:
        layer = name
        has_weight, has_bias = module._parameters.get("weight") is not None, getattr(module, "bias", None) is not None
        keys = dict(weight_key=_key(name, "weight") if has_weight else None, bias_key=_key(name, "bias") if has_bias else None)
        shape = dict(experts=kind == "GroupedLinear")
    return [LayerSpec(name, kind, class_name(module), layer, **keys, **ops, source="calibrated", **shape, unit=module)]
