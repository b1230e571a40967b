"""NVIDIA Model Optimizer's Hugging Face checkpoint format (read by vLLM and TensorRT-LLM): one
``quant_algo`` for the whole model, in ``hf_quant_config.json`` and in config.json's
``quantization_config`` (``quant_method: "modelopt"``), with ``exclude_modules`` for the layers kept in
high precision. Per layer (names and conventions as vLLM 0.32's ModelOpt loader reads them):

=========================  ====================================================================
quant_algo                 tensors
=========================  ====================================================================
FP8                        ``weight`` e4m3, ``weight_scale`` fp32 (), ``input_scale`` fp32 ()
FP8_PER_CHANNEL_PER_TOKEN  ``weight`` e4m3, ``weight_scale`` fp32 (out,), 1-D; activations per token
FP8_PB_WO                  ``weight`` e4m3, ``weight_scale`` fp32 (out/128, in/128); activations dynamic
MXFP8                      ``weight`` e4m3, ``weight_scale`` uint8 E8M0 (out, in/32); activations dynamic
NVFP4                      ``weight`` uint8 (two E2M1 a byte), ``weight_scale`` e4m3 (out, in/16),
                           ``weight_scale_2`` fp32 () = 1 / s_enc, ``input_scale`` fp32 () = 1 / s_enc(input)
W4A16_NVFP4                NVFP4 weights, activations in 16 bits
=========================  ====================================================================

Dequantization is ``q * weight_scale`` (NVFP4: ``q * weight_scale * weight_scale_2``); tq's scales
are written as they are (`scale_inv`), so FP8 and MXFP8 weights dequantize bit for bit as tq's;
NVFP4's ``weight_scale_2`` is the fp32 reciprocal of tq's ``s_enc``, one rounding away (use
compressed-tensors for a bit-exact NVFP4 checkpoint).
"""

from __future__ import annotations

import dataclasses

import torch

from tqcompile.export.units import ExportError, ExportUnit, QuantizedWeight
from tqcompile.formats import Format
from tqcompile.kernels.reference import nvfp4_tensor_scale, tensor_scale_inv
from tqcompile.quantizers import Float8Quantizer, Granularity, MXQuantizer, NVFP4Quantizer

__all__ = ["Scheme", "scheme_of", "layer_tensors", "quantization_config", "extra_files", "check_targets", "PRODUCER"]

PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the ModelOpt release whose format this writes
_WORKS = (
    "ModelOpt checkpoints hold FP8 per tensor (static inputs), FP8 per channel (ROWWISE weights and inputs), FP8 128x128 "
    "blocks, MXFP8 and NVFP4 (W4A4 with a calibrated input amax, or W4A16); for INT8/INT4 or mixed schemes use "
    "format='compressed-tensors'"
)


@dataclasses.dataclass(frozen=True)
class Scheme:
    algo: str

    def describe(self) -> str:
        return f"modelopt {self.algo}"


def _e4m3(q) -> bool:
    return isinstance(q, Float8Quantizer) and q.format is Format.E4M3


def scheme_of(unit: ExportUnit) -> Scheme:
    """The ModelOpt quant_algo of `unit`, or an `ExportError` naming the layer and what exports."""
    wq, iq, static = unit.weight_q, unit.input_q, unit.input_amax is not None
    w_gran = wq.layout()[0] if _e4m3(wq) else None
    i_gran, i_axis, _ = iq.layout() if _e4m3(iq) else (None, None, None)
    algo = None
    if w_gran is Granularity.TENSORWISE and i_gran is Granularity.TENSORWISE and static:
        algo = "FP8"
    elif w_gran is Granularity.ROWWISE and wq.layout()[1] in (-1, 1) and i_gran is Granularity.ROWWISE and i_axis == -1:
        algo = "FP8_PER_CHANNEL_PER_TOKEN"
    elif w_gran is Granularity.BLOCKWISE_2D and wq.layout()[2] == 128 and i_gran is Granularity.BLOCKWISE_1D:
        algo = "FP8_PB_WO"
    elif isinstance(wq, MXQuantizer) and wq.format is Format.E4M3 and isinstance(iq, MXQuantizer):
        algo = "MXFP8"
    elif isinstance(wq, NVFP4Quantizer) and not wq.hadamard:
        if iq is None:
            algo = "W4A16_NVFP4"
        elif isinstance(iq, NVFP4Quantizer) and not iq.hadamard and static:
            algo = "NVFP4"
    if algo is None:
        raise ExportError(
            f"tq.export: layer {unit.name!r} (weight {wq!r}, input {iq!r}, "
            f"{'static' if static else 'dynamic'} input scale) has no ModelOpt form; {_WORKS}"
        )
    return Scheme(algo)


def layer_tensors(unit: ExportUnit, scheme: Scheme, qw: QuantizedWeight, out_rows: int, in_features: int) -> dict:
    """{local name: (tensor, RowKind)} of one layer (leading expert dim for experts)."""
    e = unit.experts
    per_tensor = (lambda t: t.reshape(-1)) if e else (lambda t: t.reshape(()))
    out = {"weight": (qw.data, "rows")}
    algo = scheme.algo
    if algo == "FP8":
        out["weight_scale"] = (per_tensor(qw.scale_inv.float()), "tensor")
    elif algo == "FP8_PB_WO":
        out["weight_scale"] = (qw.scale_inv.float(), ("blocks", 128))
    elif algo == "MXFP8":
        out["weight_scale"] = (qw.scale_inv.view(torch.uint8), "rows")
    elif algo.endswith("NVFP4"):
        q = unit.weight_q
        scale = qw.scale_inv.repeat_interleave(16, dim=-2) if q.block_2d else qw.scale_inv
        out["weight_scale"] = (scale, "rows")
        out["weight_scale_2"] = (per_tensor(1.0 / nvfp4_tensor_scale(qw.amax, q)), "tensor")
    else:  # FP8_PER_CHANNEL_PER_TOKEN: one scale per output row, 1-D, as vLLM's loader declares it
        out["weight_scale"] = (qw.scale_inv.float().squeeze(-1), "rows")
    if unit.input_amax is not None:
        iq, amax = unit.input_q, unit.input_amax
        scale_inv = 1.0 / nvfp4_tensor_scale(amax, iq) if algo == "NVFP4" else tensor_scale_inv(amax, iq)
        out["input_scale"] = (per_tensor(scale_inv), "tensor")
    return out


def _algo(groups: dict) -> str:
    algos = sorted({s.algo for s in groups})
    if len(algos) != 1:
        raise ExportError(f"tq.export: ModelOpt checkpoints hold one quant_algo, the model's layers need {algos}; {_WORKS}")
    return algos[0]


def _quantization(groups: dict, ignore: list[str]) -> dict:
    algo = _algo(groups)
    q = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": sorted(ignore)}
    if "NVFP4" in algo:
        q["group_size"] = 16
    return q


# How `exclude_modules` names experts kept in high precision: the experts module (vLLM matches it as a prefix).
IGNORE_EXPERTS = "module"


def check_targets(extra_targets: list[str]) -> None:
    """A quantized layer that vLLM's ModelOpt loader does not build as a linear layer (an LM head)."""
    if extra_targets:
        raise ExportError(
            f"tq.export: {sorted(extra_targets)} quantized: vLLM's ModelOpt loader keeps the LM head in high precision; "
            "keep it so (the presets do), or use format='compressed-tensors', which names it in its targets"
        )


def quantization_config(groups: dict, ignore: list[str], extra_targets: list[str] = ()) -> dict:
    """config.json's ``quantization_config`` (the same content as ``hf_quant_config.json``)."""
    return {"quant_method": "modelopt", "producer": dict(PRODUCER), "quantization": _quantization(groups, ignore)}


def extra_files(groups: dict, ignore: list[str]) -> dict[str, dict]:
    """``hf_quant_config.json``: what ModelOpt's exporter writes beside config.json."""
    return {"hf_quant_config.json": {"producer": dict(PRODUCER), "quantization": _quantization(groups, ignore)}}
