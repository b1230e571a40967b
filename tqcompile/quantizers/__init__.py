"""Quantizers: immutable value objects that say *how* to quantize.

A quantizer is a frozen, slotted dataclass whose fields are Python scalars and Enums only,
registered as a torch.compile *value* opaque type (`tqcompile.quantizers.base`). One module per
family holds its class and its reference numerics: `fp8` (`Float8Quantizer`), `integer`
(`IntQuantizer`), `mx` (`MXQuantizer`, generic over its element format), `nvfp4`
(`NVFP4Quantizer`). Which elements share a scale is the quantizer's layout
(`tqcompile.quantizers.geometry`, which also walks scaling units for every other layer).
Import quantizers from here (or from `tqcompile`).
"""

# The family classes keep this module as theirs (`base.PUBLIC_MODULE`), so their annotations
# (`format: Format`) resolve here for `typing.get_type_hints`.
from tqcompile.formats import Format  # noqa: F401
from tqcompile.quantizers.base import Quantizer
from tqcompile.quantizers.geometry import Granularity

# isort: off
# Importing a family registers it; this order (FP8, MX, NVFP4, INT) is the one config errors and
# the `torch.load` allow-list list them in, as before the families had modules of their own.
from tqcompile.quantizers.fp8 import Float8Quantizer
from tqcompile.quantizers.mx import MXQuantizer, ScaleRounding
from tqcompile.quantizers.nvfp4 import NVFP4Quantizer
from tqcompile.quantizers.integer import IntGrid, IntQuantizer
# isort: on

__all__ = [
    "Granularity",
    "ScaleRounding",
    "Quantizer",
    "Float8Quantizer",
    "MXQuantizer",
    "NVFP4Quantizer",
    "IntQuantizer",
    "IntGrid",
]
