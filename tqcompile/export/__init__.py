"""Export for serving: `tq.export` writes compressed-tensors or ModelOpt checkpoints that vLLM,
SGLang, TensorRT-LLM and transformers load (see docs/serving.md)."""

from tqcompile.export.export import FORMATS, ExportReport, ExportRow, ExportWarning, export
from tqcompile.export.units import ExportError

__all__ = ["export", "ExportReport", "ExportRow", "ExportError", "ExportWarning", "FORMATS"]
