"""The `LayerSpec`s of layers `tq.convert` converted (`tqcompile.surgery.specs`): a converted
layer quantizes its weight with the recipe's ``fprop_weight`` quantizer and its input with
``fprop_input``, both computed from each tensor (no static amax), as training does."""

from __future__ import annotations

from torch import nn

from tqcompile.nn.base import is_converted
from tqcompile.nn.experts import QuantizedExperts
from tqcompile.nn.grouped import GroupedLinear
from tqcompile.nn.quantized_linear import Linear
from tqcompile.surgery.classes import original_class
from tqcompile.surgery.specs import LayerSpec, OperandSpec, register_spec_reader

__all__ = ["converted_specs"]


def _key(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


@register_spec_reader
def converted_specs(name: str, module: nn.Module) -> list[LayerSpec] | None:
    """The specs of `module` (named `name`) if `tq.convert` converted it: one per GEMM weight (an
    experts module: one per expert GEMM, named ``<experts>.<weight>_gemm``); one without operands for
    a converted module that holds no linear-layer weight of its own (attention, encoder layers)."""
    if not is_converted(module):
        return None
    recipe = module.recipe
    cls = original_class(type(module))
    common = dict(
        module_class=cls.__name__,
        layer=name,
        input=OperandSpec(recipe.fprop_input),
        weight=OperandSpec(recipe.fprop_weight),
        output=None,
        source=f"recipe {recipe.name}",
        recipe=recipe,
        unit=module,
    )
    if isinstance(module, QuantizedExperts):
        return [
            LayerSpec(
                _key(name, f"{g.weight}_gemm"),
                "Experts",
                weight_key=_key(name, g.weight),
                bias_key=None if g.bias is None else _key(name, g.bias),
                experts=True,
                transposed=g.transposed,
                **common,
            )
            for g in module.tq_experts_layout.gemms
        ]
    if isinstance(module, (Linear, GroupedLinear)):
        grouped = isinstance(module, GroupedLinear)
        bias = _key(name, "bias") if module.bias is not None else None
        kind = "GroupedLinear" if grouped else "Linear"
        return [LayerSpec(name, kind, weight_key=_key(name, "weight"), bias_key=bias, experts=grouped, **common)]
    common.update(input=None, weight=None)
    return [LayerSpec(name, type(module).__name__, weight_key=None, bias_key=None, **common)]
