"""Export for serving: `tq.export` writes compressed-tensors or ModelOpt checkpoints that vLLM,
SGLang, TensorRT-LLM and transformers load, and `tq.load_exported` reads them back as calibrated
models (see docs/serving.md).

This package is also the export itself: ``tq.export(model, path, ...)`` calls
`tqcompile.export.export` (the function; `tqcompile.export.writer` holds it). So
``import tqcompile.export`` and ``tq.export`` are one object, the package, and neither hides the
other (a function bound to the package's name would: ``import tqcompile.export as e`` gave it).
"""

import inspect
import sys
import types

from tqcompile.export.load import load_exported
from tqcompile.export.units import ExportError
from tqcompile.export.writer import FORMATS, ExportReport, ExportRow, ExportWarning, export

__all__ = ["export", "load_exported", "ExportReport", "ExportRow", "ExportError", "ExportWarning", "FORMATS"]


class _CallablePackage(types.ModuleType):
    """The package's type: calling it runs `export` (Python lets a module's class be a
    `ModuleType` subclass for exactly this kind of customisation)."""

    def __call__(self, *args, **kwargs) -> ExportReport:
        return export(*args, **kwargs)


__signature__ = inspect.signature(export)  # what `inspect.signature(tq.export)` and help() show
sys.modules[__name__].__class__ = _CallablePackage
