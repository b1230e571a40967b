"""The compressed-tensors format (written by llmcompressor; read by vLLM, SGLang and transformers):
which scheme a tq quantizer pair is, and the tensors a layer of that scheme holds.

Names, shapes, dtypes and conventions are the ones compressed-tensors' compressors and vLLM's
loaders define (read from their source; compressed-tensors 0.20, vLLM 0.32):

- dequantization is ``q * weight_scale`` (no zero point: tq's quantizers are symmetric), so a tq
  ``scale_inv`` is a weight_scale as it is, fp32;
- per-tensor scales have shape (1,), per-channel (out, 1), groups (out, in / group), 2-D blocks
  (out / b, in / b); MX scales are E8M0 exponent bytes (uint8);
- `pack-quantized`: ``weight_packed`` int32, 32 / bits values a word, value + 2**(bits-1) (offset
  binary), element i at bit 4 * i (4-bit) of its little-endian word, and ``weight_shape`` (int64);
- `nvfp4-pack-quantized`: ``weight_packed`` uint8 (element 2i in the low nibble), ``weight_scale``
  float8_e4m3fn per 16-block, ``weight_global_scale`` = tq's ``s_enc`` = 2688 / amax (the
  reciprocal of ModelOpt's ``weight_scale_2``), dequantized as ``q * (weight_scale / global)``;
  ``input_global_scale`` likewise from the calibrated input amax;
- a static input scale is ``input_scale`` (fp32, (1,)), the `scale_inv` tq quantizes that input with
  (`reference.tensor_scale_inv`: ``1 / (qmax / amax)``, power-of-two rounded where the quantizer says).
"""

from __future__ import annotations

import dataclasses

import torch

from tqcompile.export.units import ExportError, ExportUnit, QuantizedWeight
from tqcompile.formats import Format
from tqcompile.kernels.reference import int_values, nvfp4_tensor_scale, tensor_scale_inv
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, MXQuantizer, NVFP4Quantizer, Quantizer

__all__ = ["Scheme", "scheme_of", "layer_tensors", "quantization_config", "extra_files", "check_targets", "RowKind"]


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A layer's scheme: the weights' and inputs' arguments (JSON-ready, as compressed-tensors'
    `QuantizationArgs` dumps them) and the compression format. Frozen: layers group by it."""

    weights: tuple[tuple[str, object], ...]
    inputs: tuple[tuple[str, object], ...] | None
    format: str

    def to_dict(self, targets: list[str]) -> dict:
        return {
            "targets": targets,
            "weights": {k: list(v) if isinstance(v, tuple) else v for k, v in self.weights},
            "input_activations": None if self.inputs is None else dict(self.inputs),
            "output_activations": None,
            "format": self.format,
        }

    def describe(self) -> str:
        w = dict(self.weights)
        text = f"{self.format} W{w['num_bits']} {w['type']} {w['strategy']}"
        if w.get("group_size"):
            text += f" {w['group_size']}"
        if w.get("block_structure"):
            text += f" {w['block_structure']}"
        if self.inputs is None:
            return text + ", activations 16-bit"
        i = dict(self.inputs)
        return text + f", A{i['num_bits']} {i['strategy']} {'static' if i['dynamic'] is False else 'dynamic'}"


def _args(bits: int, kind: str, strategy: str, dynamic: bool | str = False, **extra) -> tuple:
    d = {"num_bits": bits, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": dynamic}
    d.update({k: v for k, v in extra.items() if v is not None})
    return tuple(d.items())


def _refuse(unit: ExportUnit, what: str, q: Quantizer, works: str) -> ExportError:
    return ExportError(f"tq.export: layer {unit.name!r}: the {what} quantizer {q!r} has no compressed-tensors form; {works}")


_WEIGHT_WORKS = (
    "weights export as IntQuantizer INT8/INT4 (TENSORWISE, ROWWISE, BLOCKWISE_1D), Float8Quantizer E4M3 (TENSORWISE, "
    "ROWWISE, BLOCKWISE_2D), MXQuantizer E4M3/E2M1 and NVFP4Quantizer without hadamard"
)
_INPUT_WORKS = (
    "inputs export as INT8/E4M3 TENSORWISE (static or dynamic), ROWWISE along the last dim (dynamic per token), "
    "BLOCKWISE_1D (dynamic groups), MXQuantizer, and NVFP4 with a calibrated amax"
)


def _weights_args(unit: ExportUnit) -> tuple[tuple, str]:
    q = unit.weight_q
    if isinstance(q, (IntQuantizer, Float8Quantizer)):
        if isinstance(q, Float8Quantizer) and q.format is not Format.E4M3:
            raise _refuse(unit, "weight", q, _WEIGHT_WORKS)
        kind, bits = ("int", q.format.bits) if isinstance(q, IntQuantizer) else ("float", 8)
        gran, axis, block = q.layout()
        if gran is Granularity.TENSORWISE:
            args = _args(bits, kind, "tensor")
        elif gran is Granularity.ROWWISE and axis in (-1, 1):
            args = _args(bits, kind, "channel")
        elif gran is Granularity.BLOCKWISE_1D:
            args = _args(bits, kind, "group", group_size=block)
        elif gran is Granularity.BLOCKWISE_2D and kind == "float":
            args = _args(bits, kind, "block", block_structure=(block, block))
        else:
            raise _refuse(unit, "weight", q, _WEIGHT_WORKS)
        if kind == "int" and (bits == 4 or unit.input_q is None):
            return args, "pack-quantized"  # weight-only integers are stored packed (W4A16, W8A16)
        if unit.input_q is None:
            return args, "naive-quantized"
        return args, ("int-quantized" if kind == "int" else "float-quantized")
    if isinstance(q, MXQuantizer):
        if q.format is Format.E5M2:
            raise _refuse(unit, "weight", q, _WEIGHT_WORKS)
        bits = q.format.bits
        args = _args(bits, "float", "group", group_size=32, scale_dtype="torch.uint8", zp_dtype="torch.uint8")
        return args, ("mxfp4-pack-quantized" if bits == 4 else "mxfp8-quantized")
    if isinstance(q, NVFP4Quantizer) and not q.hadamard:
        dt = "torch.float8_e4m3fn"
        return _args(4, "float", "tensor_group", group_size=16, scale_dtype=dt, zp_dtype=dt), "nvfp4-pack-quantized"
    raise _refuse(unit, "weight", q, _WEIGHT_WORKS)


def _input_args(unit: ExportUnit) -> tuple | None:
    q, static = unit.input_q, unit.input_amax is not None
    if q is None:
        return None
    if isinstance(q, (IntQuantizer, Float8Quantizer)) and (isinstance(q, IntQuantizer) or q.format is Format.E4M3):
        kind, bits = ("int", q.format.bits) if isinstance(q, IntQuantizer) else ("float", 8)
        gran, axis, block = q.layout()
        if gran is Granularity.TENSORWISE:
            return _args(bits, kind, "tensor", dynamic=not static)
        if gran is Granularity.ROWWISE and axis == -1:
            return _args(bits, kind, "token", dynamic=True)
        if gran is Granularity.BLOCKWISE_1D:
            return _args(bits, kind, "group", dynamic=True, group_size=block)
    if isinstance(q, MXQuantizer) and q.format is not Format.E5M2:
        return _args(q.format.bits, "float", "group", dynamic=True, group_size=32, scale_dtype="torch.uint8", zp_dtype="torch.uint8")
    if isinstance(q, NVFP4Quantizer) and not q.hadamard and static:
        dt = "torch.float8_e4m3fn"
        return _args(4, "float", "tensor_group", dynamic="local", group_size=16, scale_dtype=dt, zp_dtype=dt)
    raise _refuse(unit, "input", q, _INPUT_WORKS)


def scheme_of(unit: ExportUnit) -> Scheme:
    """The compressed-tensors scheme of `unit`, or an `ExportError` naming the layer and what exports."""
    weights, fmt = _weights_args(unit)
    return Scheme(weights, _input_args(unit), fmt)


# How a layer tensor's dim after the expert dim relates to the weight's rows, so that a fused
# weight (experts' gate_up) splits into the per-module tensors engines load: "rows" (one entry a
# weight row), ("blocks", b) (one entry per b rows), "tensor" (one value for the whole layer) or
# "shape" (the unpacked weight shape, rebuilt after the split).
RowKind = str | tuple[str, int]


def _pack_int32(ints: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' `pack-quantized` words: offset-binary values (v + 2**(bits-1)), 32 / bits
    a little-endian int32 word along the last dim, zero-padded to whole words."""
    per_word = 32 // bits
    u = (ints.to(torch.int32) + (1 << (bits - 1))).to(torch.uint8)
    pad = -u.shape[-1] % per_word
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    if bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << 4)  # element 2i in the low nibble, then bytes in word order
    elif bits != 8:
        raise ExportError(f"pack-quantized export supports 4 and 8 bits, got {bits}")
    return u.contiguous().view(torch.int32)  # little-endian words (every CPU torch runs on here)


def _expand_2d_tiles(scale: torch.Tensor, q: Quantizer) -> torch.Tensor:
    # NVFP4 16x16 weight tiles are 1x16 blocks that share a scale down each 16 rows.
    return scale.repeat_interleave(16, dim=-2) if isinstance(q, NVFP4Quantizer) and q.block_2d else scale


def _per_tensor(t: torch.Tensor, experts: bool) -> torch.Tensor:
    return t.reshape(-1, 1) if experts else t.reshape(1)


def _input_tensors(unit: ExportUnit) -> dict[str, tuple[torch.Tensor, RowKind]]:
    q, amax = unit.input_q, unit.input_amax
    if q is None or amax is None:
        return {}
    if isinstance(q, NVFP4Quantizer):
        return {"input_global_scale": (_per_tensor(nvfp4_tensor_scale(amax, q), unit.experts), "tensor")}
    return {"input_scale": (_per_tensor(tensor_scale_inv(amax, q), unit.experts), "tensor")}


def layer_tensors(unit: ExportUnit, scheme: Scheme, qw: QuantizedWeight, out_rows: int, in_features: int) -> dict:
    """{local name: (tensor, RowKind)} of one layer of `scheme` (leading expert dim for experts)."""
    q, e = unit.weight_q, unit.experts
    out: dict = {}
    if scheme.format == "pack-quantized":
        bits = q.element_format().bits
        out["weight_packed"] = (_pack_int32(int_values(qw.data, q), bits), "rows")
        out["weight_scale"] = (_scale_tensor(qw.scale_inv, q, e), _scale_rows(q))
        shape = [qw.data.shape[0], out_rows, in_features] if e else [out_rows, in_features]
        out["weight_shape"] = (torch.tensor(shape, dtype=torch.int64), "shape")
    elif scheme.format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        out["weight_packed"] = (qw.data, "rows")
        scale = qw.scale_inv.view(torch.uint8) if isinstance(q, MXQuantizer) else _expand_2d_tiles(qw.scale_inv, q)
        out["weight_scale"] = (scale, "rows")
        if isinstance(q, NVFP4Quantizer):
            out["weight_global_scale"] = (_per_tensor(nvfp4_tensor_scale(qw.amax, q), e), "tensor")
    elif scheme.format == "mxfp8-quantized":
        out["weight"] = (qw.data, "rows")
        out["weight_scale"] = (qw.scale_inv.view(torch.uint8), "rows")
    else:  # int-quantized, float-quantized, naive-quantized
        out["weight"] = (qw.data, "rows")
        out["weight_scale"] = (_scale_tensor(qw.scale_inv, q, e), _scale_rows(q))
    out.update(_input_tensors(unit))
    return out


def _scale_tensor(scale_inv: torch.Tensor, q: Quantizer, experts: bool) -> torch.Tensor:
    if q.layout()[0] is Granularity.TENSORWISE:
        return _per_tensor(scale_inv.float(), experts)
    return scale_inv.float()


def _scale_rows(q: Quantizer) -> RowKind:
    gran, _, block = q.layout()
    if gran is Granularity.TENSORWISE:
        return "tensor"
    return ("blocks", block) if gran is Granularity.BLOCKWISE_2D else "rows"


# How `ignore` names experts kept in high precision: per expert, as compressed-tensors itself does
# (vLLM looks up ``<experts>.0.<gate|up|down>_proj`` in it, by exact name).
IGNORE_EXPERTS = "per_expert"


def quantization_config(groups: dict[Scheme, list[str]], ignore: list[str], extra_targets: list[str] = ()) -> dict:
    """config.json's ``quantization_config``: one config group per scheme. A single scheme targets
    ``Linear`` (every linear layer not in `ignore`: what vLLM's MoE and fused layers expect) and, by
    name, the quantized layers an engine does not build as a Linear (`extra_targets`: a quantized
    ``lm_head``); several schemes name their layers."""
    formats = {s.format for s in groups}
    config_groups = {}
    for i, (scheme, names) in enumerate(groups.items()):
        targets = ["Linear", *sorted(extra_targets)] if len(groups) == 1 else sorted(names)
        config_groups[f"group_{i}"] = scheme.to_dict(targets)
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def extra_files(groups: dict, ignore: list[str]) -> dict[str, dict]:
    """compressed-tensors keeps everything in config.json."""
    return {}


def check_targets(extra_targets: list[str]) -> None:
    """compressed-tensors names such layers in its targets (`quantization_config`)."""
