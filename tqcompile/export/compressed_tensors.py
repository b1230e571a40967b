"""The compressed-tensors format (written by llmcompressor; read by vLLM, SGLang and transformers):
`CompressedTensors`, which says which scheme a tq quantizer pair is, writes the tensors a layer of
that scheme holds, and reads both back.

Names, shapes, dtypes and conventions are the ones compressed-tensors' compressors and vLLM's
loaders define (read from their source; compressed-tensors 0.20, vLLM 0.32):

- dequantization is ``q * weight_scale``, or ``(q - weight_zero_point) * weight_scale`` for
  asymmetric integer weights (``symmetric: false``; tq's `IntGrid.ASYMMETRIC`), so a tq
  ``scale_inv`` is a weight_scale as it is, fp32; zero points are int8 in the scale's shape, or,
  `pack-quantized`, packed as the codes are along the rows (int32, ``ceil(out * bits / 32)`` rows);
- per-tensor scales have shape (1,), per-channel (out, 1), groups (out, in / group), 2-D blocks
  (out / b, in / b); MX scales are E8M0 exponent bytes (uint8);
- `pack-quantized`: ``weight_packed`` int32, value + 2**(bits-1) (offset binary) packed densely,
  element i at bit bits * i of the row's little-endian words (a 3-bit value may straddle two), and
  ``weight_shape`` (int64);
- MX: one format per element (`register_mx_element`): ``weight`` (8-bit elements, `mxfp8-quantized`)
  or ``weight_packed`` uint8 packed by bit width as tq packs (`mxfp4-pack-quantized`: element 2i
  in the low nibble), ``weight_scale`` uint8 E8M0 per 32-block;
- `nvfp4-pack-quantized`: ``weight_packed`` uint8 (element 2i in the low nibble), ``weight_scale``
  float8_e4m3fn per 16-block, ``weight_global_scale`` = tq's ``s_enc`` = 2688 / amax (the
  reciprocal of ModelOpt's ``weight_scale_2``), dequantized as ``q * (weight_scale / global)``;
  ``input_global_scale`` likewise from the calibrated input amax;
- a static input scale is ``input_scale`` (fp32, (1,)), the `scale_inv` tq quantizes that input with
  (`reference.tensor_scale_inv`: ``1 / (qmax / amax)``, power-of-two rounded where the quantizer says).

Per quantizer family, `weight_scheme`, `input_scheme` and `weight_tensors` are
`functools.singledispatch` registries: a new family registers its scheme and tensors there.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import torch
from torch import nn

from tqcompile.export import kv_cache
from tqcompile.export.checkpoint_format import CheckpointFormat, LayerScheme, register_format
from tqcompile.export.decode import invert
from tqcompile.export.families import pack_int32_words, scale_rows
from tqcompile.export.scales import GlobalScaleTensor
from tqcompile.export.units import ExportError, ExportUnit, QuantizedWeight
from tqcompile.formats import Format
from tqcompile.kernels.reference import int_values
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, MXQuantizer, NVFP4Quantizer, Quantizer

__all__ = [
    "CompressedTensors",
    "COMPRESSED_TENSORS",
    "Scheme",
    "RowKind",
    "register_mx_element",
    "weight_scheme",
    "input_scheme",
    "weight_tensors",
]


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
        if w.get("symmetric") is False:
            text += " asymmetric"
        if self.inputs is None:
            return text + ", activations 16-bit"
        i = dict(self.inputs)
        return text + f", A{i['num_bits']} {i['strategy']} {'static' if i['dynamic'] is False else 'dynamic'}"


# How a layer tensor's dim after the expert dim relates to the weight's rows, so that a fused
# weight (experts' gate_up) splits into the per-module tensors engines load: "rows" (one entry a
# weight row), ("blocks", b) (one entry per b rows), ("packed_rows", bits) (one entry a row, packed
# along the rows into int32 words as `bits`-wide codes after the split: asymmetric zero points),
# "tensor" (one value for the whole layer) or "shape" (the unpacked weight shape, rebuilt after the split).
RowKind = str | tuple[str, int]


def _args(bits: int, kind: str, strategy: str, dynamic: bool | str = False, **extra) -> tuple:
    d = {"num_bits": bits, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": dynamic}
    d.update({k: v for k, v in extra.items() if v is not None})
    return tuple(d.items())


def _refuse(unit: ExportUnit, what: str, q: Quantizer) -> ExportError:
    works = COMPRESSED_TENSORS.weight_works() if what == "weight" else COMPRESSED_TENSORS.input_works()
    return ExportError(f"tq.export: layer {unit.name!r}: the {what} quantizer {q!r} has no compressed-tensors form; {works}")


# ---------------------------------------------------------------------------------------------
# MX element formats: one compression format each
# ---------------------------------------------------------------------------------------------
_MX_ELEMENTS: dict[Format, str] = {}


def register_mx_element(element: Format, scheme_format: str) -> None:
    """Export (and load) MX blocks of `element` as compressed-tensors' format `scheme_format`
    (``"mxfp6-pack-quantized"``): weights and inputs with ``num_bits`` the element's width, type
    float, groups of 32, uint8 E8M0 scales; a packed element's payload is ``weight_packed`` (tq's
    packing by bit width), a byte-wide one's ``weight``. compressed-tensors names an MX element by
    its width alone, so one element per width. The elements compressed-tensors 0.20 names are
    registered below; a format added outside tqcompile registers its own from its module.
    """
    if element not in MXQuantizer.allowed_formats():
        raise ValueError(f"register_mx_element: {element} is not an MX element format; allowed: {list(MXQuantizer.allowed_formats())}")
    clash = [f for f in _MX_ELEMENTS if f.bits == element.bits and f is not element]
    if clash:
        raise ValueError(f"register_mx_element: compressed-tensors names MX elements by width; {clash[0]} already has num_bits={element.bits}")
    _MX_ELEMENTS[element] = scheme_format


register_mx_element(Format.E4M3, "mxfp8-quantized")
register_mx_element(Format.E2M1, "mxfp4-pack-quantized")
register_mx_element(Format.E2M3, "mxfp6-pack-quantized")  # OCP MXFP6: compressed-tensors has E2M3, not E3M2


def _mx_args(q: MXQuantizer, dynamic: bool) -> tuple:
    return _args(q.format.bits, "float", "group", dynamic=dynamic, group_size=32, scale_dtype="torch.uint8", zp_dtype="torch.uint8")


# ---------------------------------------------------------------------------------------------
# Schemes, per family
# ---------------------------------------------------------------------------------------------
def _layout_args(unit: ExportUnit, q: Quantizer, kind: str) -> tuple:
    """The weight arguments of an amax-scaled quantizer (FP8, INT) by its layout."""
    bits = q.element_format().bits
    gran, axis, block = q.layout()
    if gran is Granularity.TENSORWISE:
        return _args(bits, kind, "tensor")
    if gran is Granularity.ROWWISE and axis in (-1, 1):
        return _args(bits, kind, "channel")
    if gran is Granularity.BLOCKWISE_1D:
        return _args(bits, kind, "group", group_size=block)
    if gran is Granularity.BLOCKWISE_2D:
        return _args(bits, kind, "block", block_structure=(block, block))
    raise _refuse(unit, "weight", q)


@functools.singledispatch
def weight_scheme(q: Quantizer, unit: ExportUnit) -> tuple[tuple, str]:
    """(weight arguments, compression format) of a layer whose weight quantizer is `q`."""
    raise _refuse(unit, "weight", q)


@weight_scheme.register(IntQuantizer)
def _(q, unit):
    args = _layout_args(unit, q, "int")
    if q.has_zero_point():
        args = tuple((k, False if k == "symmetric" else v) for k, v in args)
    if q.format.bits < 8 or unit.input_q is None:
        return args, "pack-quantized"  # sub-byte and weight-only integers are stored packed (W4A16, W3A16, W8A16)
    return args, "int-quantized"


@weight_scheme.register(Float8Quantizer)
def _(q, unit):
    if q.format is not Format.E4M3:
        raise _refuse(unit, "weight", q)
    return _layout_args(unit, q, "float"), ("naive-quantized" if unit.input_q is None else "float-quantized")


@weight_scheme.register(MXQuantizer)
def _(q, unit):
    if q.format not in _MX_ELEMENTS:
        raise _refuse(unit, "weight", q)
    return _mx_args(q, dynamic=False), _MX_ELEMENTS[q.format]


@weight_scheme.register(NVFP4Quantizer)
def _(q, unit):
    if q.hadamard_transformed():
        raise _refuse(unit, "weight", q)
    dt = "torch.float8_e4m3fn"
    return _args(4, "float", "tensor_group", group_size=16, scale_dtype=dt, zp_dtype=dt), "nvfp4-pack-quantized"


def _scaled_input_args(q: Quantizer, unit: ExportUnit, kind: str) -> tuple:
    bits, static = q.element_format().bits, unit.input_amax is not None
    gran, axis, block = q.layout()
    if gran is Granularity.TENSORWISE:
        return _args(bits, kind, "tensor", dynamic=not static)
    if gran is Granularity.ROWWISE and axis == -1:
        return _args(bits, kind, "token", dynamic=True)
    if gran is Granularity.BLOCKWISE_1D:
        return _args(bits, kind, "group", dynamic=True, group_size=block)
    raise _refuse(unit, "input", q)


@functools.singledispatch
def input_scheme(q: Quantizer, unit: ExportUnit) -> tuple:
    """The input arguments of a layer whose input quantizer is `q` (static where `unit.input_amax` is set)."""
    raise _refuse(unit, "input", q)


@input_scheme.register(IntQuantizer)
def _(q, unit):
    return _scaled_input_args(q, unit, "int")


@input_scheme.register(Float8Quantizer)
def _(q, unit):
    if q.format is not Format.E4M3:
        raise _refuse(unit, "input", q)
    return _scaled_input_args(q, unit, "float")


@input_scheme.register(MXQuantizer)
def _(q, unit):
    if q.format not in _MX_ELEMENTS:
        raise _refuse(unit, "input", q)
    return _mx_args(q, dynamic=True)


@input_scheme.register(NVFP4Quantizer)
def _(q, unit):
    if q.hadamard_transformed() or unit.input_amax is None:
        raise _refuse(unit, "input", q)
    dt = "torch.float8_e4m3fn"
    return _args(4, "float", "tensor_group", dynamic="local", group_size=16, scale_dtype=dt, zp_dtype=dt)


# ---------------------------------------------------------------------------------------------
# Tensors, per family
# ---------------------------------------------------------------------------------------------
def _per_tensor(t: torch.Tensor, experts: bool) -> torch.Tensor:
    return t.reshape(-1, 1) if experts else t.reshape(1)


def _scale_tensor(scale_inv: torch.Tensor, q: Quantizer, experts: bool) -> torch.Tensor:
    if q.layout()[0] is Granularity.TENSORWISE:
        return _per_tensor(scale_inv.float(), experts)
    return scale_inv.float()


def _scale_rows(q: Quantizer) -> RowKind:
    gran, _, block = q.layout()
    if gran is Granularity.TENSORWISE:
        return "tensor"
    return ("blocks", block) if gran is Granularity.BLOCKWISE_2D else "rows"


def _scaled_weight(unit: ExportUnit, qw: QuantizedWeight) -> dict:
    q = unit.weight_q
    return {"weight": (qw.data, "rows"), "weight_scale": (_scale_tensor(qw.scale_inv, q, unit.experts), _scale_rows(q))}


@functools.singledispatch
def weight_tensors(q: Quantizer, unit: ExportUnit, scheme: Scheme, qw: QuantizedWeight, out_rows: int, in_features: int) -> dict:
    """{local name: (tensor, RowKind)} of a layer's weight of `scheme` (its input scale comes after)."""
    raise TypeError(f"compressed-tensors: no tensors registered for {type(q).__name__}")


@weight_tensors.register(IntQuantizer)
def _(q, unit, scheme, qw, out_rows, in_features):
    zero_point = None
    if q.has_zero_point():  # (1 / scale, zero point) a unit: compressed-tensors keeps them apart
        zero_point = qw.scale_inv[..., 1].round().to(torch.int8)
        qw = dataclasses.replace(qw, scale_inv=qw.scale_inv[..., 0].contiguous())
    if scheme.format != "pack-quantized":
        out = _scaled_weight(unit, qw)
        if zero_point is not None:
            out["weight_zero_point"] = (zero_point, _scale_rows(q))  # int8, the scale's shape
        return out
    e = unit.experts
    shape = [qw.data.shape[0], out_rows, in_features] if e else [out_rows, in_features]
    out = {
        "weight_packed": (pack_int32_words(int_values(qw.data, q), q.format.bits), "rows"),
        "weight_scale": (_scale_tensor(qw.scale_inv, q, e), _scale_rows(q)),
        "weight_shape": (torch.tensor(shape, dtype=torch.int64), "shape"),
    }
    if zero_point is not None:
        # Packed as the codes are, along the rows (compressed-tensors' packed_dim=0), once the
        # rows of each written module are picked.
        out["weight_zero_point"] = (zero_point, ("packed_rows", q.format.bits))
    return out


@weight_tensors.register(Float8Quantizer)
def _(q, unit, scheme, qw, out_rows, in_features):
    return _scaled_weight(unit, qw)


@weight_tensors.register(MXQuantizer)
def _(q, unit, scheme, qw, out_rows, in_features):
    payload = "weight_packed" if q.format.pack_elements > 1 else "weight"
    return {payload: (qw.data, "rows"), "weight_scale": (qw.scale_inv.view(torch.uint8), "rows")}


@weight_tensors.register(NVFP4Quantizer)
def _(q, unit, scheme, qw, out_rows, in_features):
    return {
        "weight_packed": (qw.data, "rows"),
        "weight_scale": (scale_rows(q, qw.scale_inv), "rows"),
        "weight_global_scale": (_per_tensor(COMPRESSED_TENSORS.weight_global_scale(qw, q), unit.experts), "tensor"),
    }


# ---------------------------------------------------------------------------------------------
# Reading: a config group back to tq quantizers
# ---------------------------------------------------------------------------------------------
# The fields of compressed-tensors' QuantizationArgs that decide the quantization (others, such as
# observer or the dtype a scale is stored in, do not change what a weight dequantizes to).
_ARG_KEYS = ("num_bits", "type", "strategy", "dynamic", "group_size", "block_structure", "symmetric")


def _norm_args(args: dict | None) -> dict | None:
    if args is None:
        return None
    d = {k: args.get(k) for k in _ARG_KEYS}
    d["dynamic"] = False if d["dynamic"] is None else d["dynamic"]
    d["symmetric"] = d["symmetric"] is not False  # compressed-tensors' default
    if d["strategy"] not in ("group", "tensor_group"):
        d["group_size"] = None
    d["block_structure"] = tuple(d["block_structure"]) if d["strategy"] == "block" and d["block_structure"] else None
    d["e8m0_scales"] = str(args.get("scale_dtype")) in ("torch.uint8", "torch.float8_e8m0fnu")  # MX, not FP8 groups of 32
    return d


def _storage(fmt: str | None) -> str | None:
    # How a layer's tensors are stored: the MX and NVFP4 formats each have their own; int and
    # float weights load from any of the plain ones (tq writes weight-only integers packed,
    # other tools may not).
    return fmt if fmt in (*_MX_ELEMENTS.values(), "nvfp4-pack-quantized") else None


def _brief(args: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in args.items() if v is not None and not (k == "e8m0_scales" and not v))


def _matches(target: str, prefix: str, model: nn.Module) -> int:
    """How well a compressed-tensors target names the layer `prefix`: 3 by exact name, 2 by a
    "re:" regex, 1 by class name ("Linear": every layer the engines quantize), 0 not at all."""
    if target == prefix:
        return 3
    if target.startswith("re:"):
        return 2 if re.match(target[3:], prefix) else 0
    if target == "Linear":
        return 1
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return 0
    return 1 if any(c.__name__ == target for c in type(module).__mro__) else 0


class CompressedTensors(CheckpointFormat):
    """compressed-tensors: one config group per scheme in config.json (module docstring)."""

    NAME = "compressed-tensors"
    QUANT_METHOD = "compressed-tensors"
    # How `ignore` names experts kept in high precision: per expert, as compressed-tensors itself
    # does (vLLM looks up ``<experts>.0.<gate|up|down>_proj`` in it, by exact name).
    IGNORE_EXPERTS = "per_expert"
    WEIGHT_GLOBAL_SCALE = GlobalScaleTensor("weight_global_scale", reciprocal=False)
    INPUT_GLOBAL_SCALE = GlobalScaleTensor("input_global_scale", reciprocal=False)
    LAYER_TENSORS = (
        "weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx",
        "weight_global_scale", "input_scale", "input_global_scale",
    )

    def __repr__(self) -> str:
        return "CompressedTensors()"

    def weight_works(self) -> str:
        """What exports as weights, for messages (the MX elements as registered)."""
        mx = "/".join(f.name for f in _MX_ELEMENTS)
        return (
            "weights export as IntQuantizer INT8/INT4/INT3/INT2 (TENSORWISE, ROWWISE, BLOCKWISE_1D), Float8Quantizer E4M3 (TENSORWISE, "
            f"ROWWISE, BLOCKWISE_2D), MXQuantizer {mx} and NVFP4Quantizer without hadamard"
        )

    def input_works(self) -> str:
        """What exports as inputs, for messages."""
        return (
            "inputs export as INT8/E4M3 TENSORWISE (static or dynamic), ROWWISE along the last dim (dynamic per token), "
            "BLOCKWISE_1D (dynamic groups), MXQuantizer, and NVFP4 with a calibrated amax"
        )

    # --- writing ---------------------------------------------------------------------------
    def scheme_of(self, unit: ExportUnit) -> Scheme:
        """The compressed-tensors scheme of `unit`, or an `ExportError` naming the layer and what exports."""
        weights, fmt = weight_scheme(unit.weight_q, unit)
        return Scheme(weights, None if unit.input_q is None else input_scheme(unit.input_q, unit), fmt)

    def layer_tensors(self, unit: ExportUnit, scheme: Scheme, qw: QuantizedWeight, out_rows: int, in_features: int) -> dict:
        """{local name: (tensor, RowKind)} of one layer of `scheme` (leading expert dim for experts)."""
        out = weight_tensors(unit.weight_q, unit, scheme, qw, out_rows, in_features)
        found = self.input_scale(unit)
        if found is not None:
            out[found[0]] = (_per_tensor(found[1], unit.experts), "tensor")
        return out

    def quantization_config(self, groups: dict[Scheme, list[str]], ignore: list[str], extra_targets: list[str] = ()) -> dict:
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
            # No group (only the KV cache quantized): "dense", compressed-tensors' format of unquantized weights.
            "format": formats.pop() if len(formats) == 1 else "mixed-precision" if formats else "dense",
            "quantization_status": "compressed",
            "config_groups": config_groups,
            "ignore": sorted(ignore),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }

    def check_targets(self, extra_targets: list[str]) -> None:
        """compressed-tensors names such layers in its targets (`quantization_config`)."""

    # --- reading ---------------------------------------------------------------------------
    def check_config(self, qc: dict, path: str) -> None:
        groups = qc.get("config_groups")
        if groups is not None and not (isinstance(groups, dict) and all(isinstance(g, dict) for g in groups.values())):
            raise ExportError(f"tq.load_exported: {path!r}'s quantization_config.config_groups is not an object of config groups")
        self.kv_cache_quantizer(qc)  # a KV scheme tq has no quantizer for is refused before any layer

    def scheme_resolver(self, qc: dict, model: nn.Module) -> Callable[[str], LayerScheme]:
        """The config group whose targets name the layer best (`_matches`), as tq quantizers."""
        groups = qc.get("config_groups") or {}
        cache: dict[str, LayerScheme] = {}

        def resolve(prefix: str) -> LayerScheme:
            ranked = [(max((_matches(t, prefix, model) for t in g.get("targets", ())), default=0), name) for name, g in groups.items()]
            best = max(ranked, default=(0, None))
            if best[0] == 0:
                raise ExportError(f"tq.load_exported: layer {prefix!r} holds quantized tensors but no config group targets it")
            if best[1] not in cache:
                cache[best[1]] = self.group_scheme(groups[best[1]], prefix, best[1], qc.get("format"))
            return cache[best[1]]

        return resolve

    def group_scheme(self, group: dict, layer: str, group_name: str, model_format: str | None) -> LayerScheme:
        """The tq quantizers of a config group (`model_format`: the config's ``format``, for groups
        that name none; `layer`, `group_name`: for messages)."""
        weights, inputs = group.get("weights"), group.get("input_activations")
        where = f"tq.load_exported: layer {layer!r} (config group {group_name!r})"
        if weights is None:
            raise ExportError(f"{where} quantizes activations only; tq loads layers with quantized weights")
        if group.get("output_activations"):
            raise ExportError(f"{where} quantizes its output; tq loads weight and input quantization only")
        if inputs is not None and inputs.get("symmetric", True) is False:
            raise ExportError(
                f"{where}: its input activations are asymmetric (zero points); tq loads asymmetric integer weights "
                "(per channel or group), not activations: quantize the activations with symmetric=True"
            )
        w, i = _norm_args(weights), _norm_args(inputs)
        block = w["block_structure"][0] if w["block_structure"] and w["block_structure"][0] == w["block_structure"][1] else None
        found = invert(
            self.scheme_of,
            lambda s: _norm_args(dict(s.weights)) == w
            and _norm_args(None if s.inputs is None else dict(s.inputs)) == i
            and _storage(s.format) == _storage(group.get("format") or model_format),
            group_size=w["group_size"],
            block=block,
            input_group_size=i["group_size"] if i else None,
        )
        text = f"weights {_brief(w)}, inputs {_brief(i) if i else '16-bit'}"
        if found is None:
            raise ExportError(
                f"{where}: the scheme ({text}) has no tq quantizer; tq loads what it exports: {self.weight_works()}; {self.input_works()}"
            )
        return dataclasses.replace(found, text=text)


    # --- the KV cache (`tqcompile.export.kv_cache`) ---------------------------------------------
    def kv_cache_config(self, qconfig: dict, files: dict[str, dict], q: Quantizer) -> None:
        """``kv_cache_scheme``: FP8 E4M3, static, strategy "tensor" or "attn_head" (vLLM's two)."""
        qconfig["kv_cache_scheme"] = dict(_args(8, "float", "attn_head" if kv_cache.per_head(q) else "tensor"))

    def kv_cache_tensors(self, q: Quantizer, key_scale: torch.Tensor, value_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """``k_scale`` / ``v_scale``: (1,) per layer, (kv_heads, 1, 1) per head (llmcompressor's shapes)."""
        shape = (-1, 1, 1) if kv_cache.per_head(q) else (1,)
        return {"k_scale": key_scale.reshape(shape), "v_scale": value_scale.reshape(shape)}

    def kv_cache_quantizer(self, qc: dict) -> Quantizer | None:
        scheme = qc.get("kv_cache_scheme")
        if not scheme:
            return None
        got = {k: scheme.get(k) for k in ("num_bits", "type", "strategy", "dynamic", "symmetric")} if isinstance(scheme, dict) else scheme
        if not isinstance(scheme, dict) or not (
            scheme.get("num_bits") == 8
            and scheme.get("type") == "float"
            and scheme.get("strategy") in ("tensor", "attn_head")
            and scheme.get("dynamic") in (False, None)
            and scheme.get("symmetric", True) is True
        ):
            raise ExportError(
                f"tq.load_exported: kv_cache_scheme {got!r} has no tq quantizer; tq loads FP8 (num_bits 8, type float) "
                "symmetric static KV caches with strategy 'tensor' or 'attn_head'"
            )
        return kv_cache.kv_quantizer_for(scheme["strategy"] == "attn_head")


COMPRESSED_TENSORS = register_format(CompressedTensors())

# The module's functions before the format was a class (importable as before, no longer advertised).
scheme_of = COMPRESSED_TENSORS.scheme_of
layer_tensors = COMPRESSED_TENSORS.layer_tensors
quantization_config = COMPRESSED_TENSORS.quantization_config
extra_files = COMPRESSED_TENSORS.extra_files
check_targets = COMPRESSED_TENSORS.check_targets
IGNORE_EXPERTS = CompressedTensors.IGNORE_EXPERTS
