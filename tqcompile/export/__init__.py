"""Export for serving: `tq.export` writes compressed-tensors or ModelOpt checkpoints that vLLM,
SGLang, TensorRT-LLM and transformers load, and `tq.load_exported` reads them back as calibrated
models (see docs/serving.md)."""

from tqcompile.export.export import FORMATS, ExportReport, ExportRow, ExportWarning, export
from tqcompile.export.load import load_exported
from tqcompile.export.units import ExportError

__all__ = ["export", "load_exported", "ExportReport", "ExportRow", "ExportError", "ExportWarning", "FORMATS"]
