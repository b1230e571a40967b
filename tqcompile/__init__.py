"""tqcompile: quantization for PyTorch, built for `torch.compile(fullgraph=True)` first."""

import torch as _torch

from tqcompile import (  # noqa: E402  (these import the names above)
    calibration,
    configs,
    deploy,
    distributed,
    export,  # the package, callable: tq.export(model, path) (see its docstring)
    nn,
    optim,
    recipes,
)
from tqcompile.api import SUPPORTED_DTYPES, quantize
from tqcompile.calibration import AWQ, GPTQ, SmoothQuant, calibrate, quant_state, restore, summary
from tqcompile.conversion import convert
from tqcompile.deploy import Int4PackedCPUTensor as _Int4PackedCPUTensor
from tqcompile.deploy import Int4PackedCUDATensor as _Int4PackedCUDATensor
from tqcompile.deploy import MXFP4PackedTensor as _MXFP4PackedTensor
from tqcompile.deploy import MXPackedTensor as _MXPackedTensor
from tqcompile.deploy import compress
from tqcompile.export import load_exported
from tqcompile.export.streaming import quantize_checkpoint
from tqcompile.formats import Format
from tqcompile.quantizers import (
    Float8Quantizer,
    Granularity,
    IntGrid,
    IntQuantizer,
    MXQuantizer,
    NVFP4Quantizer,
    Quantizer,
    ScaleRounding,
)
from tqcompile.quantizers.base import quantizer_families as _quantizer_families
from tqcompile.recipes import Recipe
from tqcompile.tensor import GroupedQuantizedTensor as _GroupedQuantizedTensor
from tqcompile.tensor import QuantizedTensor
from tqcompile.torch_export import lift_quantizers

__version__ = "0.1.0"

__all__ = [
    "Format",
    "Granularity",
    "ScaleRounding",
    "Quantizer",
    "Float8Quantizer",
    "MXQuantizer",
    "NVFP4Quantizer",
    "IntQuantizer",
    "IntGrid",
    "QuantizedTensor",
    "quantize",
    "Recipe",
    "recipes",
    "nn",
    "optim",
    "convert",
    "calibration",
    "configs",
    "calibrate",
    "GPTQ",
    "AWQ",
    "SmoothQuant",
    "summary",
    "quant_state",
    "restore",
    "compress",
    "deploy",
    "distributed",
    "export",
    "load_exported",
    "quantize_checkpoint",
    "lift_quantizers",
]

# Let `torch.load(..., weights_only=True)` rebuild QuantizedTensors (a compressed model's packed ones too), recipes and quantizers (every
# registered family, and the enums their fields hold).
_torch.serialization.add_safe_globals([QuantizedTensor, _GroupedQuantizedTensor, _Int4PackedCPUTensor, _Int4PackedCUDATensor, _MXPackedTensor, _MXFP4PackedTensor, Recipe, Format, Granularity, ScaleRounding, IntGrid, *_quantizer_families()])
