"""Quantized modules and model conversion."""

from tqcompile.nn import specs as _specs  # noqa: F401  (registers how tqcompile.surgery.layer_specs reads converted layers)
from tqcompile.nn.base import QuantizedModule, is_converted
from tqcompile.nn.convert import ConversionWarning, PlannedConversion, conversion_plan, register_converter
from tqcompile.nn.functional import linear, qgemm
from tqcompile.nn.grouped import GroupedLinear, grouped_linear
from tqcompile.nn.quantized_linear import Linear

__all__ = [
    "Linear",
    "GroupedLinear",
    "conversion_plan",
    "register_converter",
    "ConversionWarning",
]
