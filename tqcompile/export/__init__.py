"""Export for serving: `tq.export` writes compressed-tensors or ModelOpt checkpoints (and GPT-OSS's
own MXFP4 format) that vLLM, SGLang, TensorRT-LLM and transformers load, and `tq.load_exported`
reads them back as calibrated models (see docs/serving.md).

A checkpoint format is a class (`checkpoint_format.CheckpointFormat`) that owns writing and reading
its scheme; `FORMATS` maps `tq.export`'s ``format=`` names to the registered instances
(`compressed_tensors.CompressedTensors`, `modelopt.ModelOpt`, `gpt_oss_mxfp4.GptOssMxfp4`).
docs/adding_a_checkpoint_format.md says how to add one.

This package is also the export itself: ``tq.export(model, path, ...)`` calls
`tqcompile.export.export` (the function; `tqcompile.export.writer` holds it). So
``import tqcompile.export`` and ``tq.export`` are one object, the package, and neither hides the
other (a function bound to the package's name would: ``import tqcompile.export as e`` gave it).
"""

import inspect
import sys
import types

# isort: off
# Importing a format registers it; this order is the one `FORMATS` and the loader's messages list them in.
from tqcompile.export import compressed_tensors, modelopt, gpt_oss_mxfp4  # noqa: F401
# isort: on
from tqcompile.export.load import load_exported
from tqcompile.export.units import ExportError
from tqcompile.export.writer import FORMATS, ExportReport, ExportRow, ExportWarning, export

__all__ = ["export", "load_exported", "ExportReport", "ExportError", "ExportWarning"]


class _CallablePackage(types.ModuleType):
    """The package's type: calling it runs `export` (Python lets a module's class be a
    `ModuleType` subclass for exactly this kind of customisation)."""

    def __call__(self, *args, **kwargs) -> ExportReport:
        return export(*args, **kwargs)


__signature__ = inspect.signature(export)  # what `inspect.signature(tq.export)` and help() show
sys.modules[__name__].__class__ = _CallablePackage
