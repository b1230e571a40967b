"""One quantized layer of a checkpoint, read back in tq's terms (for `tq.load_exported`): the tq
quantizers of its scheme, its weight dequantized as tq dequantizes, and the static amaxes that
give the checkpoint's scales. Format-independent: what differs between checkpoint formats is
asked of the format (`tqcompile.export.checkpoint_format`), what differs between quantizer
families of the family's registrations (`tqcompile.export.families`).

Schemes map back through the export's own mapping: a format's `scheme_of` is run over the
quantizers tq can export (`invert`), and the first whose scheme is the checkpoint's is taken. One
table serves both directions, so a scheme loads exactly when tq would export it that way.

Scales map back to amaxes (int and FP8: ``amax = scale * qmax``; NVFP4's global scale: ``amax =
448 * 6 / global_scale``; MX: no amax, every block scale comes from its block), searched among
the fp32 values whose scale is the checkpoint's exactly (`tqcompile.export.scales`).

The weight is then dequantized by tq's own kernel from the checkpoint's payload and those scales,
so fake-quantizing it again reproduces it: the loaded model computes with the checkpoint's weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from tqcompile.export import families
from tqcompile.export.checkpoint_format import CheckpointFormat, LayerScheme, input_scale_names
from tqcompile.export.families import StoredLayer
from tqcompile.export.scales import amax_for_scale, bad_values, scaled_amax
from tqcompile.export.units import ExportError, ExportUnit
from tqcompile.quantizers import IntGrid, Quantizer

__all__ = ["LayerScheme", "DecodedLayer", "invert", "check_layer", "decode_layer", "amax_for_scale", "with_scale_rules", "full_grid"]


@dataclasses.dataclass
class DecodedLayer:
    """One checkpoint layer: fp32 weight (out, in) as tq dequantizes it, the weight's static amax
    (tensor-level: 0-dim; per scaling unit: the quantizer's scale shape; None for MX), the input's
    static amax (0-dim) and how many of its scales have no exact tq amax (`inexact`)."""

    scheme: LayerScheme
    weight: torch.Tensor
    weight_amax: torch.Tensor | None
    input_amax: torch.Tensor | None
    inexact: int = 0
    mx_rceil: bool = False  # MX blocks only RCEIL scales give (`families.read_weight` of MX says why)
    pow2_scales: bool | None = None  # FP8 layers: every scale a power of two (None: not FP8)


# ---------------------------------------------------------------------------------------------
# Schemes: the export's mapping, run backwards
# ---------------------------------------------------------------------------------------------
def _input_candidates(group_size: int | None) -> list[tuple[Quantizer | None, bool]]:
    out: list[tuple[Quantizer | None, bool]] = [(None, False)]
    for q in families.quantizer_candidates(group_size, None):
        static = q.uses_tensor_amax() and q.takes_static_amax()  # a calibrated tensor amax, or one from each input
        out += [(q, True), (q, False)] if static else [(q, False)]
    return out


def _stub(wq: Quantizer, iq: Quantizer | None, static: bool) -> ExportUnit:
    """What the export's scheme mapping reads of a layer: its quantizers and whether the input is static."""
    amax = torch.ones(()) if (iq is not None and static) else None
    return ExportUnit(
        name="", weight_key="", bias_key=None, weight_q=wq, weight_amax=None, input_q=iq, input_amax=amax, experts=False, source=""
    )


def invert(
    forward: Callable[[ExportUnit], object],
    wanted: Callable[[object], bool],
    *,
    group_size: int | None,
    block: int | None,
    input_group_size: int | None,
) -> LayerScheme | None:
    """The first candidate (weight, input, static input) whose scheme under `forward` (a format's
    `scheme_of`, which raises `ExportError` for what it cannot hold) is `wanted`, or None. The
    candidates are every registered family's (`families.quantizer_candidates`) for the checkpoint
    scheme's weight groups (`group_size`), 2-D weight blocks (`block`) and input groups (None: none)."""
    inputs = _input_candidates(input_group_size)
    for wq in families.quantizer_candidates(group_size, block):
        for iq, static in inputs:
            try:
                scheme = forward(_stub(wq, iq, static))
            except ExportError:
                continue
            if wanted(scheme):
                return LayerScheme(wq, iq, static, "")
    return None


def with_scale_rules(scheme: LayerScheme, *, rceil: bool, pow2: bool) -> LayerScheme:
    """`scheme` with its MX quantizers on the RCEIL rule and its FP8 quantizers on power-of-two
    scales, as the checkpoint's scales show (it records neither; activations take the weights'
    rule, as in tq's recipes and presets)."""
    return dataclasses.replace(
        scheme,
        weight_q=families.scale_rules(scheme.weight_q, rceil, pow2),
        input_q=families.scale_rules(scheme.input_q, rceil, pow2),
    )


# ---------------------------------------------------------------------------------------------
# Checks, then the layer
# ---------------------------------------------------------------------------------------------
_FLOAT_STORAGE = ("F64", "F32", "F16", "BF16")  # compressed-tensors' "dense": a weight stored dequantized


def _input_scale_name(scheme: LayerScheme, fmt: CheckpointFormat) -> str:
    iq = scheme.input_q
    return fmt.INPUT_GLOBAL_SCALE.name if iq is not None and iq.has_global_scale() else "input_scale"


def check_layer(
    prefix: str, scheme: LayerScheme, entry: Callable[[str], dict | None], get: Callable[[str], torch.Tensor | None], fmt: CheckpointFormat
) -> LayerScheme:
    """Everything `decode_layer` needs of the layer `prefix`, checked before any tensor of a model
    is written: the tensors the scheme needs are there, stored as it stores them, shaped as its
    scales are for the weight's shape; every scale finite and positive (NVFP4 block scales may be
    zero: an all-zero block); integer codes within the config's `num_bits`; and no scale the
    scheme would drop (an input scale for dynamic or 16-bit activations). `entry(local)` gives a
    tensor's header entry, `get(local)` the tensor (read here only for scales and, for integers of
    fewer than 8 bits stored a byte each, the codes); `fmt` is the checkpoint's format (where it
    keeps global scales). Returns the scheme, with NVFP4 16x16 weight tiles where the block scales
    show them. Raises `ExportError` naming the tensor."""
    q, where = scheme.weight_q, f"tq.load_exported: layer {prefix!r} ({scheme.text})"
    if q.has_zero_point():
        families.check_zero_points(q, StoredLayer(prefix, where, entry, get))
    elif entry("weight_zero_point") is not None and bool((get("weight_zero_point") != 0).any()):
        raise ExportError(f"{where} holds non-zero weight_zero_point values (asymmetric) but its config says symmetric: true")
    if entry("weight_g_idx") is not None:
        raise ExportError(f"{where} holds weight_g_idx (GPTQ activation ordering); tq loads groups in their natural order")
    if entry("weight_scale") is None:
        raise ExportError(f"{where} lacks its weight_scale")
    local = "weight_packed" if entry("weight_packed") is not None else "weight"
    data = entry(local)
    if data is None:
        raise ExportError(f"{where} lacks its weight (or weight_packed)")
    stored, shape = data["dtype"], tuple(data["shape"])
    if stored not in _FLOAT_STORAGE:
        shape = families.check_payload(q, StoredLayer(prefix, where, entry, get), local, stored, shape)
    err = q.shape_error(shape)
    if err is not None:
        raise ExportError(f"{where}: its {shape} weight does not fit tq's {q!r}: {err}")
    scale = get("weight_scale")
    want_scale = torch.Size(families.stored_scale_shape(q, shape))
    tiled = families.with_stored_tiles(q, scale, want_scale)
    if tiled != q:
        q = tiled
        scheme = dataclasses.replace(scheme, weight_q=q)
    if scale.numel() != want_scale.numel():
        raise ExportError(
            f"{where}: {prefix}.weight_scale has shape {list(scale.shape)}; a {list(shape)} weight quantized as the config says "
            f"({scheme.text}) has {list(want_scale)} scales: the config's strategy or group size contradicts the tensors"
        )
    problem = families.scale_problem(q, scale)
    if problem:
        raise ExportError(f"{where}: {prefix}.weight_scale holds {problem}; a scale must be finite and positive: the checkpoint is corrupt")
    names = [fmt.WEIGHT_GLOBAL_SCALE.name] if q.has_global_scale() else []
    iq = scheme.input_q
    if iq is not None and scheme.static_input:
        names.append(_input_scale_name(scheme, fmt))
    for name in names:
        if entry(name) is None:
            raise ExportError(f"{where} lacks its {name}")
        t = get(name)
        problem = bad_values(t, zero_ok=False) or (None if t.numel() == 1 else f"{t.numel()} values where the scheme has one")
        if problem:
            raise ExportError(f"{where}: {prefix}.{name} holds {problem}; it must be one finite, positive scale: the checkpoint is corrupt")
    for name in input_scale_names():
        if name not in names and entry(name) is not None:
            kind = "16-bit" if iq is None else "dynamic (a scale from each input)"
            raise ExportError(
                f"{where}: {prefix}.{name} is in the checkpoint but the config says its inputs are {kind}, so the scale would be "
                "dropped: the config and the tensors disagree (a static input scheme names it, as dynamic: false)"
            )
    return scheme


def decode_layer(prefix: str, scheme: LayerScheme, get: Callable[[str], torch.Tensor | None], fmt: CheckpointFormat) -> DecodedLayer:
    """Read the layer `prefix` of `scheme` (`get(local name)` returns its tensor, or None) from a
    checkpoint of format `fmt`, which `check_layer` has checked (and given its NVFP4 tile layout)."""
    q = scheme.weight_q
    scale, packed = get("weight_scale"), get("weight_packed")
    data = get("weight") if packed is None else packed
    dense = data.is_floating_point() and data.dtype != torch.float8_e4m3fn  # compressed-tensors' "dense": stored dequantized
    layer = StoredLayer(prefix, "", lambda local: None, get)
    if dense:
        shape = tuple(data.shape)
    else:
        data, shape = families.read_payload(q, data, layer)
    read = families.read_weight(q, data, scale, shape, dense, layer, fmt.WEIGHT_GLOBAL_SCALE)
    if read.quantizer is not None and read.quantizer != q:
        scheme = _with_int_grid(scheme, read.quantizer)
    input_amax, more = _input_amax(scheme, get, fmt)
    return DecodedLayer(scheme, read.weight, read.amax, input_amax, read.inexact + more, read.mx_rceil, read.pow2_scales)


def full_grid(scheme: LayerScheme) -> LayerScheme | None:
    """`scheme` on the FULL integer grid where it is a SYMMETRIC integer one, else None: what the
    loader decodes a layer as when another layer of its GEMM (an expert beside it) has FULL codes."""
    q = scheme.weight_q
    if getattr(q, "grid", None) is not IntGrid.SYMMETRIC:
        return None
    return _with_int_grid(scheme, dataclasses.replace(q, grid=IntGrid.FULL))


def _with_int_grid(scheme: LayerScheme, weight_q: Quantizer) -> LayerScheme:
    """`scheme` with the weight quantizer its scales were read with (an integer grid read off
    them, `families.read_weight`) and a static integer input on the same grid (tq's presets and
    llmcompressor's static W8A8 put both on one grid; dynamic inputs keep SYMMETRIC: amax / 127,
    as vLLM quantizes them)."""
    iq = scheme.input_q
    if iq is not None and scheme.static_input and getattr(iq, "grid", None) is not None:
        iq = dataclasses.replace(iq, grid=weight_q.grid)
    return dataclasses.replace(scheme, weight_q=weight_q, input_q=iq)


def _input_amax(scheme: LayerScheme, get, fmt: CheckpointFormat) -> tuple[torch.Tensor | None, int]:
    iq = scheme.input_q
    if iq is None or not scheme.static_input:
        return None, 0
    s = get(_input_scale_name(scheme, fmt))
    if iq.has_global_scale():
        return families.global_amax(iq, s, fmt.INPUT_GLOBAL_SCALE.reciprocal)
    return scaled_amax(s.reshape(()), iq)
