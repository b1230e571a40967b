"""The record a calibrated model keeps of how it was calibrated (`tq.calibrate`, `tq.restore`,
`tq.calibration.prepare`, `tq.quantize_checkpoint`), which `tq.quant_state` saves beside the amaxes.

A module of its own so that `tqcompile.calibration.state` reads it without importing the
calibration pipeline.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tqcompile.calibration.config import QuantConfig
from tqcompile.surgery.names import unwrap

__all__ = ["CalibrationRecord", "set_record"]


@dataclasses.dataclass(frozen=True)
class CalibrationRecord:
    """What `tq.quant_state` saves besides the amaxes (kept on the calibrated model)."""

    config: QuantConfig
    algorithm: str
    percentile: float


def set_record(model: nn.Module, converted: list[nn.Module], record: CalibrationRecord) -> None:
    """Keep `record` on the model (inside any DDP / compile wrapper, so it survives (un)wrapping) and on
    every converted module, so that `tq.quant_state` of a submodule (e.g. the inner model of a wrapper
    tqcompile does not strip) finds it too."""
    for m in (unwrap(model), *converted):
        m.tq_calibration = record
