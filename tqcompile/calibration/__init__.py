"""PTQ and QAT: configs, calibration, fake quantization, quantization state save/restore.

`tq.calibrate(model, config, forward_loop)` converts a model in place to fake-quantized modules
and calibrates their static amaxes; `tq.summary`, `tq.quant_state` and `tq.restore` inspect, save
and rebuild that state. Fake quantization is ``tq.quantize(x, q, amax=...).dequantize()``: the
same quantizers, ops and kernels as training. See docs/ptq.md and docs/qat.md.
"""

from tqcompile.calibration import specs as _specs  # noqa: F401  (registers how tqcompile.surgery.layer_specs reads fake-quantized layers)
from tqcompile.calibration.algorithms import AWQ, GPTQ, SmoothQuant
from tqcompile.calibration.config import ConfigError, QuantConfig, QuantRule, register_module_type
from tqcompile.calibration.fake_quant import TensorQuantizer, fake_quantize, fake_quantize_grouped
from tqcompile.calibration.modules import ExpertGemmQuantizers, FakeQuantModule
from tqcompile.calibration.pipeline import ALGORITHMS, CalibrationWarning, calibrate, prepare
from tqcompile.calibration.state import QuantSummary, SummaryRow, quant_state, reattach, restore, summary
from tqcompile.calibration.views import weight_only

__all__ = [
    "calibrate",
    "GPTQ",
    "AWQ",
    "SmoothQuant",
    "CalibrationWarning",
    "QuantConfig",
    "QuantRule",
    "ConfigError",
    "register_module_type",
    "fake_quantize",
    "quant_state",
    "restore",
    "summary",
    "weight_only",
]
