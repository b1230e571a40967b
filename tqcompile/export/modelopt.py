"""NVIDIA Model Optimizer's Hugging Face checkpoint format (read by vLLM and TensorRT-LLM):
`ModelOpt`. One ``quant_algo`` for the whole model, in ``hf_quant_config.json`` and in config.json's
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

Which algo a layer is depends on its weight and input quantizers together, so each family says
what it is in ModelOpt's terms (`form_of`, a `functools.singledispatch` registry) and one table
(`ModelOpt.scheme_of`) names the algo.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from tqcompile.export import kv_cache
from tqcompile.export.checkpoint_format import CheckpointFormat, LayerScheme, register_format
from tqcompile.export.decode import invert
from tqcompile.export.families import scale_rows
from tqcompile.export.scales import GlobalScaleTensor
from tqcompile.export.units import ExportError, ExportUnit, QuantizedWeight
from tqcompile.formats import Format
from tqcompile.quantizers import Float8Quantizer, Granularity, MXQuantizer, NVFP4Quantizer, Quantizer

__all__ = [
    "ModelOpt",
    "MODELOPT",
    "Scheme",
    "form_of",
    "PRODUCER",
]

PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the ModelOpt release whose format this writes


@dataclasses.dataclass(frozen=True)
class Scheme:
    algo: str

    def describe(self) -> str:
        return f"modelopt {self.algo}"


@functools.singledispatch
def form_of(q: Quantizer) -> tuple | None:
    """What `q` is in ModelOpt's algos: ``("FP8", granularity, axis, block)`` for E4M3 with fp32
    scales, ``("MX", element)``, ``("NVFP4",)``, or None (nothing ModelOpt holds)."""
    return None


@form_of.register(Float8Quantizer)
def _(q):
    return ("FP8", *q.layout()) if q.format is Format.E4M3 else None


@form_of.register(MXQuantizer)
def _(q):
    return ("MX", q.format)


@form_of.register(NVFP4Quantizer)
def _(q):
    return None if q.hadamard_transformed() else ("NVFP4",)


def _algo_of(w: tuple | None, i: tuple | None, static: bool, weight_only: bool) -> str | None:
    """The quant_algo of a layer whose weight and input have the forms `w` and `i`."""
    wk, ik = (w or (None,))[0], (i or (None,))[0]
    if wk == "FP8" and ik == "FP8":
        (w_gran, w_axis, w_block), (i_gran, i_axis, _) = w[1:], i[1:]
        if w_gran is Granularity.TENSORWISE and i_gran is Granularity.TENSORWISE and static:
            return "FP8"
        if w_gran is Granularity.ROWWISE and w_axis in (-1, 1) and i_gran is Granularity.ROWWISE and i_axis == -1:
            return "FP8_PER_CHANNEL_PER_TOKEN"
        if w_gran is Granularity.BLOCKWISE_2D and w_block == 128 and i_gran is Granularity.BLOCKWISE_1D:
            return "FP8_PB_WO"
    elif wk == "MX" and w[1] is Format.E4M3 and ik == "MX":
        return "MXFP8"
    elif wk == "NVFP4":
        if weight_only:
            return "W4A16_NVFP4"
        if ik == "NVFP4" and static:
            return "NVFP4"
    return None


class ModelOpt(CheckpointFormat):
    """ModelOpt's HF checkpoints: one quant_algo for the model (module docstring)."""

    NAME = "modelopt"
    QUANT_METHOD = "modelopt"
    CONFIG_FILE = "hf_quant_config.json"  # what ModelOpt's exporter writes beside config.json
    # How `exclude_modules` names experts kept in high precision: the experts module (vLLM matches it as a prefix).
    IGNORE_EXPERTS = "module"
    WEIGHT_GLOBAL_SCALE = GlobalScaleTensor("weight_scale_2", reciprocal=True)
    INPUT_GLOBAL_SCALE = GlobalScaleTensor("input_scale", reciprocal=True)
    LAYER_TENSORS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    WORKS = (
        "ModelOpt checkpoints hold FP8 per tensor (static inputs), FP8 per channel (ROWWISE weights and inputs), FP8 128x128 "
        "blocks, MXFP8 and NVFP4 (W4A4 with a calibrated input amax, or W4A16); for INT8/INT4 or mixed schemes use "
        "format='compressed-tensors'"
    )

    def __repr__(self) -> str:
        return "ModelOpt()"

    # --- writing ---------------------------------------------------------------------------
    def scheme_of(self, unit: ExportUnit) -> Scheme:
        """The ModelOpt quant_algo of `unit`, or an `ExportError` naming the layer and what exports."""
        wq, iq, static = unit.weight_q, unit.input_q, unit.input_amax is not None
        algo = _algo_of(form_of(wq), None if iq is None else form_of(iq), static, weight_only=iq is None)
        if algo is None:
            raise ExportError(
                f"tq.export: layer {unit.name!r} (weight {wq!r}, input {iq!r}, "
                f"{'static' if static else 'dynamic'} input scale) has no ModelOpt form; {self.WORKS}"
            )
        return Scheme(algo)

    def layer_tensors(self, unit: ExportUnit, scheme: Scheme, qw: QuantizedWeight, out_rows: int, in_features: int) -> dict:
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
            out["weight_scale"] = (scale_rows(q, qw.scale_inv), "rows")
            out[self.WEIGHT_GLOBAL_SCALE.name] = (per_tensor(self.weight_global_scale(qw, q)), "tensor")
        else:  # FP8_PER_CHANNEL_PER_TOKEN: one scale per output row, 1-D, as vLLM's loader declares it
            out["weight_scale"] = (qw.scale_inv.float().squeeze(-1), "rows")
        found = self.input_scale(unit)
        if found is not None:
            out[found[0]] = (per_tensor(found[1]), "tensor")
        return out

    def check_kv_cache_only(self) -> None:
        raise ExportError(
            "tq.export: the model quantizes only its KV cache; a ModelOpt checkpoint names a quant_algo for its linear "
            "layers, without one vLLM's ModelOpt loader refuses it ('Missing quant_algo'): use format='compressed-tensors', "
            "which holds the KV-cache scheme alone"
        )

    def _quantization(self, groups: dict, ignore: list[str]) -> dict:
        algos = sorted({s.algo for s in groups})
        if len(algos) != 1:
            raise ExportError(f"tq.export: ModelOpt checkpoints hold one quant_algo, the model's layers need {algos}; {self.WORKS}")
        q = {"quant_algo": algos[0], "kv_cache_quant_algo": None, "exclude_modules": sorted(ignore)}
        if "NVFP4" in algos[0]:
            q["group_size"] = 16
        return q

    def check_targets(self, extra_targets: list[str]) -> None:
        """A quantized layer that vLLM's ModelOpt loader does not build as a linear layer (an LM head)."""
        if extra_targets:
            raise ExportError(
                f"tq.export: {sorted(extra_targets)} quantized: vLLM's ModelOpt loader keeps the LM head in high precision; "
                "keep it so (the presets do), or use format='compressed-tensors', which names it in its targets"
            )

    def quantization_config(self, groups: dict, ignore: list[str], extra_targets: list[str] = ()) -> dict:
        """config.json's ``quantization_config`` (the same content as ``hf_quant_config.json``)."""
        return {"quant_method": "modelopt", "producer": dict(PRODUCER), "quantization": self._quantization(groups, ignore)}

    def extra_files(self, groups: dict, ignore: list[str]) -> dict[str, dict]:
        """``hf_quant_config.json``: what ModelOpt's exporter writes beside config.json."""
        return {self.CONFIG_FILE: {"producer": dict(PRODUCER), "quantization": self._quantization(groups, ignore)}}

    # --- reading ---------------------------------------------------------------------------
    def scheme_resolver(self, qc: dict, model: nn.Module) -> Callable[[str], LayerScheme]:
        """The model's one quant_algo, for every layer."""
        scheme = self.algo_scheme((qc.get("quantization") or qc).get("quant_algo"))
        return lambda prefix: scheme

    def algo_scheme(self, algo: str) -> LayerScheme:
        """The tq quantizers of a ModelOpt ``quant_algo``."""
        found = invert(lambda u: self.scheme_of(u).algo, lambda a: a == algo, group_size=None, block=128, input_group_size=128)
        if found is None:
            raise ExportError(f"tq.load_exported: ModelOpt quant_algo {algo!r} has no tq quantizer; {self.WORKS}")
        return dataclasses.replace(found, text=f"modelopt {algo}")


    # --- the KV cache (`tqcompile.export.kv_cache`) ---------------------------------------------
    def kv_cache_config(self, qconfig: dict, files: dict[str, dict], q: Quantizer) -> None:
        """``kv_cache_quant_algo: "FP8"``, in config.json and hf_quant_config.json alike."""
        if kv_cache.per_head(q):
            raise ExportError(
                "tq.export: the KV cache is quantized per head; vLLM's ModelOpt loader takes one k_scale / v_scale per "
                "layer (kv_cache_quant_algo FP8): use tq.configs.fp8_kv_cache() (per layer), or format='compressed-tensors' "
                "(its 'attn_head' strategy)"
            )
        for content in (qconfig, *files.values()):
            content["quantization"]["kv_cache_quant_algo"] = "FP8"

    def kv_cache_tensors(self, q: Quantizer, key_scale: torch.Tensor, value_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """``k_scale`` / ``v_scale``, fp32 scalars (vLLM's KVCacheScaleParameter)."""
        return {"k_scale": key_scale.reshape(()), "v_scale": value_scale.reshape(())}

    def kv_cache_quantizer(self, qc: dict) -> Quantizer | None:
        algo = (qc.get("quantization") or qc).get("kv_cache_quant_algo")
        if algo is None:
            return None
        if str(algo).upper() != "FP8":
            raise ExportError(f"tq.load_exported: ModelOpt kv_cache_quant_algo {algo!r} has no tq quantizer; tq loads 'FP8'")
        return kv_cache.kv_quantizer_for(False)


MODELOPT = register_format(ModelOpt())

# The module's functions before the format was a class (importable as before, no longer advertised).
scheme_of = MODELOPT.scheme_of
layer_tensors = MODELOPT.layer_tensors
quantization_config = MODELOPT.quantization_config
extra_files = MODELOPT.extra_files
check_targets = MODELOPT.check_targets
IGNORE_EXPERTS = ModelOpt.IGNORE_EXPERTS
