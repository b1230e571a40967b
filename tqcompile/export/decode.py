"""One quantized layer of a compressed-tensors or ModelOpt checkpoint, read back in tq's terms
(for `tq.load_exported`): the tq quantizers of its scheme, its weight dequantized as tq
dequantizes, and the static amaxes that give the checkpoint's scales.

Schemes map back through the export's own mapping: `compressed_tensors.scheme_of` and
`modelopt.scheme_of` are run over the quantizers tq can export, and the first whose scheme is the
checkpoint's is taken. One table serves both directions, so a scheme loads exactly when tq would
export it that way.

Scales map back to amaxes (int and FP8: ``amax = scale * qmax``; NVFP4's global scale: ``amax =
448 * 6 / global_scale``; MX: no amax, every block scale comes from its block). tq computes a
scale from an amax with one or two fp32 roundings (``scale_inv = 1 / (qmax / amax)``), so the
amax is searched among the fp32 values a few ulps around that estimate for one whose scale,
computed as tq computes it, is the checkpoint's exactly. For a checkpoint tq wrote one always
exists; a scale another tool computed (``amax / qmax``) may have none, and then the nearest is
taken (an ulp of the scale away; counted in `DecodedLayer.inexact`).

The weight is then dequantized by tq's own kernel from the checkpoint's payload and those scales,
so fake-quantizing it again reproduces it: the loaded model computes with the checkpoint's weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from tqcompile import ops
from tqcompile.export import compressed_tensors as ct
from tqcompile.export import modelopt as mo
from tqcompile.export.units import ExportError, ExportUnit
from tqcompile.formats import Format
from tqcompile.kernels.reference import (
    _NVFP4_ENC,
    _pack_nibbles,
    _scale_from_amax,
    _unpack_nibbles,
    e2m1_decode,
    nvfp4_tensor_scale,
)
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, MXQuantizer, NVFP4Quantizer, Quantizer, ScaleRounding

__all__ = ["LayerScheme", "DecodedLayer", "ct_scheme", "modelopt_scheme", "check_layer", "decode_layer", "amax_for_scale", "with_scale_rules"]

_ULPS = 8  # the amax search's reach either side of its estimate (tq's own scales need at most 3)
# The fields of compressed-tensors' QuantizationArgs that decide the quantization (others, such as
# observer or the dtype a scale is stored in, do not change what a weight dequantizes to).
_ARG_KEYS = ("num_bits", "type", "strategy", "dynamic", "group_size", "block_structure")


@dataclasses.dataclass(frozen=True)
class LayerScheme:
    """The tq quantizers of a checkpoint scheme: weight, input (None: 16-bit activations) and
    whether the input scale is static (calibrated, in the checkpoint) or dynamic."""

    weight_q: Quantizer
    input_q: Quantizer | None
    static_input: bool
    text: str  # the scheme as the checkpoint names it, for messages


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
    beyond_qmax: int = 0  # integer codes outside tq's symmetric range (-128 / -8 written by other tools)
    mx_rceil: bool = False  # MX blocks only RCEIL scales give (see `_mx_rceil`)
    pow2_scales: bool | None = None  # FP8 layers: every scale a power of two (None: not FP8)


# ---------------------------------------------------------------------------------------------
# Schemes: the export's mapping, run backwards
# ---------------------------------------------------------------------------------------------
def _weight_candidates(group_size: int | None, block: int | None) -> list[Quantizer]:
    made = []
    for make in (
        lambda: IntQuantizer(Format.INT8),
        lambda: IntQuantizer(Format.INT8, Granularity.ROWWISE),
        lambda: IntQuantizer(Format.INT8, Granularity.BLOCKWISE_1D, block_size=group_size),
        lambda: IntQuantizer(Format.INT4),
        lambda: IntQuantizer(Format.INT4, Granularity.ROWWISE),
        lambda: IntQuantizer(Format.INT4, Granularity.BLOCKWISE_1D, block_size=group_size),
        lambda: Float8Quantizer(),
        lambda: Float8Quantizer(granularity=Granularity.ROWWISE),
        lambda: Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, block_size=group_size),
        lambda: Float8Quantizer(granularity=Granularity.BLOCKWISE_2D, block_size=block),
        lambda: MXQuantizer(Format.E4M3),
        lambda: MXQuantizer(Format.E2M1),
        lambda: NVFP4Quantizer(),
    ):
        try:
            made.append(make())
        except (ValueError, TypeError):  # a block size this scheme does not have (None) or tq refuses
            continue
    return made


def _input_candidates(group_size: int | None) -> list[tuple[Quantizer | None, bool]]:
    out: list[tuple[Quantizer | None, bool]] = [(None, False)]
    for q in (IntQuantizer(Format.INT8), Float8Quantizer()):
        out += [(q, True), (q, False), (dataclasses.replace(q, granularity=Granularity.ROWWISE), False)]
        if group_size:
            try:
                out.append((dataclasses.replace(q, granularity=Granularity.BLOCKWISE_1D, block_size=group_size), False))
            except ValueError:
                pass
    return out + [(MXQuantizer(Format.E4M3), False), (MXQuantizer(Format.E2M1), False), (NVFP4Quantizer(), True)]


def _stub(wq: Quantizer, iq: Quantizer | None, static: bool) -> ExportUnit:
    """What the export's scheme mapping reads of a layer: its quantizers and whether the input is static."""
    amax = torch.ones(()) if (iq is not None and static) else None
    return ExportUnit(
        name="", weight_key="", bias_key=None, weight_q=wq, weight_amax=None, input_q=iq, input_amax=amax, experts=False, source=""
    )


def _invert(forward: Callable[[ExportUnit], object], wanted: Callable[[object], bool], weights, inputs) -> LayerScheme | None:
    for wq in weights:
        for iq, static in inputs:
            try:
                scheme = forward(_stub(wq, iq, static))
            except ExportError:
                continue
            if wanted(scheme):
                return LayerScheme(wq, iq, static, "")
    return None


def _norm_args(args: dict | None) -> dict | None:
    if args is None:
        return None
    d = {k: args.get(k) for k in _ARG_KEYS}
    d["dynamic"] = False if d["dynamic"] is None else d["dynamic"]
    if d["strategy"] not in ("group", "tensor_group"):
        d["group_size"] = None
    d["block_structure"] = tuple(d["block_structure"]) if d["strategy"] == "block" and d["block_structure"] else None
    d["e8m0_scales"] = str(args.get("scale_dtype")) in ("torch.uint8", "torch.float8_e8m0fnu")  # MX, not FP8 groups of 32
    return d


def _format_family(fmt: str | None) -> str | None:
    # How a layer's tensors are stored: the MX and NVFP4 formats each have their own; int and
    # float weights load from any of the plain ones (tq writes weight-only integers packed,
    # other tools may not).
    return fmt if fmt in ("mxfp8-quantized", "mxfp4-pack-quantized", "nvfp4-pack-quantized") else None


def ct_scheme(group: dict, layer: str, group_name: str, model_format: str | None) -> LayerScheme:
    """The tq quantizers of a compressed-tensors config group (`model_format`: the config's
    ``format``, for groups that name none; `layer`, `group_name`: for messages)."""
    weights, inputs = group.get("weights"), group.get("input_activations")
    where = f"tq.load_exported: layer {layer!r} (config group {group_name!r})"
    if weights is None:
        raise ExportError(f"{where} quantizes activations only; tq loads layers with quantized weights")
    if group.get("output_activations"):
        raise ExportError(f"{where} quantizes its output; tq loads weight and input quantization only")
    for side, args in (("weights", weights), ("input activations", inputs)):
        if args is not None and args.get("symmetric", True) is False:
            raise ExportError(
                f"{where}: its {side} are asymmetric (zero points); tq's integer quantizers are symmetric, so this "
                "checkpoint cannot load; quantize with symmetric=True"
            )
    w, i = _norm_args(weights), _norm_args(inputs)
    block = w["block_structure"][0] if w["block_structure"] and w["block_structure"][0] == w["block_structure"][1] else None
    found = _invert(
        ct.scheme_of,
        lambda s: _norm_args(dict(s.weights)) == w
        and _norm_args(None if s.inputs is None else dict(s.inputs)) == i
        and _format_family(s.format) == _format_family(group.get("format") or model_format),
        _weight_candidates(w["group_size"], block),
        _input_candidates(i["group_size"] if i else None),
    )
    text = f"weights {_brief(w)}, inputs {_brief(i) if i else '16-bit'}"
    if found is None:
        raise ExportError(
            f"{where}: the scheme ({text}) has no tq quantizer; tq loads what it exports: {ct._WEIGHT_WORKS}; {ct._INPUT_WORKS}"
        )
    return dataclasses.replace(found, text=text)


def _brief(args: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in args.items() if v is not None and not (k == "e8m0_scales" and not v))


def modelopt_scheme(algo: str) -> LayerScheme:
    """The tq quantizers of a ModelOpt ``quant_algo``."""
    found = _invert(lambda u: mo.scheme_of(u).algo, lambda a: a == algo, _weight_candidates(None, 128), _input_candidates(128))
    if found is None:
        raise ExportError(f"tq.load_exported: ModelOpt quant_algo {algo!r} has no tq quantizer; {mo._WORKS}")
    return dataclasses.replace(found, text=f"modelopt {algo}")


def with_scale_rules(scheme: LayerScheme, *, rceil: bool, pow2: bool) -> LayerScheme:
    """`scheme` with its MX quantizers on the RCEIL rule and its FP8 quantizers on power-of-two
    scales, as the checkpoint's scales show (it records neither; activations take the weights'
    rule, as in tq's recipes and presets)."""

    def rule(q):
        if rceil and isinstance(q, MXQuantizer):
            return dataclasses.replace(q, scale_rounding=ScaleRounding.RCEIL)
        if pow2 and isinstance(q, Float8Quantizer):
            return dataclasses.replace(q, power_of_two_scale=True)
        return q

    return dataclasses.replace(scheme, weight_q=rule(scheme.weight_q), input_q=rule(scheme.input_q))


# ---------------------------------------------------------------------------------------------
# Scales back to amaxes
# ---------------------------------------------------------------------------------------------
def amax_for_scale(
    target: torch.Tensor, scale_of: Callable[[torch.Tensor], torch.Tensor], estimate: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The fp32 amax, per element of `target`, whose scale as tq computes it (`scale_of`) is the
    checkpoint's `target`: searched within `_ULPS` ulps of `estimate`, nearest first; where none
    gives it exactly, the candidate whose scale is closest. Returns (amax, how many are inexact)."""
    start = estimate.float()
    cands, up, down = [start], start, start
    for _ in range(_ULPS):
        up, down = torch.nextafter(up, torch.full_like(up, math.inf)), torch.nextafter(down, torch.zeros_like(down))
        cands += [up, down]
    c = torch.stack(cands)
    err = (scale_of(c) - target.float()).abs()
    err = torch.where(torch.isnan(err), math.inf, err)
    best = err.argmin(0, keepdim=True)  # the first minimum: the candidate nearest the estimate
    return c.gather(0, best)[0], int((err.gather(0, best) != 0).sum())


def _scale_inv_of(q: Quantizer) -> Callable[[torch.Tensor], torch.Tensor]:
    fmax = q.element_format().max_value
    return lambda a: 1.0 / _scale_from_amax(a, fmax, q.amax_epsilon, False)  # as reference._quantize_scaled


def _scaled_amax(scale: torch.Tensor, q: Quantizer) -> tuple[torch.Tensor, int]:
    s = scale.float()
    return amax_for_scale(s, _scale_inv_of(q), s * q.element_format().max_value)


def _nvfp4_amax(scale: torch.Tensor, q: Quantizer, reciprocal: bool) -> tuple[torch.Tensor, int]:
    """compressed-tensors stores the global scale s_enc = 2688 / amax; ModelOpt its reciprocal."""
    s = scale.float().reshape(())
    enc = lambda a: nvfp4_tensor_scale(a, q)  # noqa: E731
    if reciprocal:
        return amax_for_scale(s, lambda a: 1.0 / enc(a), s * _NVFP4_ENC)
    return amax_for_scale(s, enc, torch.div(_NVFP4_ENC, s))


# ---------------------------------------------------------------------------------------------
# Payloads back to tq's layout
# ---------------------------------------------------------------------------------------------
def _unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """compressed-tensors' `pack-quantized` words back to int8 values (the inverse of
    `compressed_tensors._pack_int32`: offset binary, element i at bit ``bits * i``)."""
    u = packed.contiguous().view(torch.uint8)  # little-endian words: bytes in element order
    if bits == 4:
        u = _unpack_nibbles(u)
    elif bits != 8:
        raise ExportError(f"tq.load_exported: pack-quantized with {bits} bits; tq loads 4 and 8")
    return (u[..., :cols].to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def _int_payload(values: torch.Tensor, q: IntQuantizer) -> torch.Tensor:
    return _pack_nibbles(values.view(torch.uint8) & 0xF) if q.format is Format.INT4 else values


def _nvfp4_block_2d(scale: torch.Tensor) -> bool:
    """Whether NVFP4 block scales repeat down every 16 rows: 16x16 weight tiles, written as
    1x16 blocks (what the export does with tq's `block_2d` weights)."""
    rows = scale.shape[0]
    if rows % 16:
        return False
    tiles = scale.view(torch.uint8).reshape(rows // 16, 16, -1)
    return bool((tiles == tiles[:, :1]).all())


def _mx_rceil(data: torch.Tensor, q: MXQuantizer) -> bool:
    """Whether some MX block's largest element is below 2**emax (256 for E4M3, 4 for E2M1), which
    the FLOOR rule never gives (its exponent puts every block's amax in [2**emax, 2**(emax+1))) and
    RCEIL does (its blocks' amaxes lie in (max / 2, max]). The checkpoint does not say which rule
    wrote it; its blocks do, for all but the smallest layers."""
    vals = e2m1_decode(_unpack_nibbles(data)) if q.format is Format.E2M1 else data.float()
    block_max = vals.abs().unflatten(-1, (-1, q.BLOCK)).amax(-1)
    return bool(((block_max > 0) & (block_max < 2.0**q.format.emax)).any())


_FLOAT_STORAGE = ("F64", "F32", "F16", "BF16")  # compressed-tensors' "dense": a weight stored dequantized


def _bad_values(t: torch.Tensor, zero_ok: bool) -> str | None:
    """What is wrong with a tensor of scales, or None: NaN, infinities, negatives, zeros."""
    v = t.float()
    for what, mask in (("NaN", torch.isnan(v)), ("infinite", torch.isinf(v)), ("negative", v < 0), ("zero", None if zero_ok else v == 0)):
        if mask is not None and bool(mask.any()):
            first = tuple(int(i) for i in mask.nonzero()[0]) if v.dim() else ()
            return f"{int(mask.sum())} {what} value(s) (the first at index {first}: {v[first].item()})"
    return None


def check_layer(prefix: str, scheme: LayerScheme, entry: Callable[[str], dict | None], get: Callable[[str], torch.Tensor | None], modelopt: bool) -> LayerScheme:
    """Everything `decode_layer` needs of the layer `prefix`, checked before any tensor of a model
    is written: the tensors the scheme needs are there, stored as it stores them, shaped as its
    scales are for the weight's shape; every scale finite and positive (NVFP4 block scales may be
    zero: an all-zero block); integer codes within the config's `num_bits`; and no scale the
    scheme would drop (an input scale for dynamic or 16-bit activations). `entry(local)` gives a
    tensor's header entry, `get(local)` the tensor (read here only for scales and, for integers of
    fewer than 8 bits stored a byte each, the codes). Returns the scheme, with NVFP4 16x16 weight
    tiles where the block scales show them. Raises `ExportError` naming the tensor."""
    q, where = scheme.weight_q, f"tq.load_exported: layer {prefix!r} ({scheme.text})"
    if entry("weight_zero_point") is not None and bool((get("weight_zero_point") != 0).any()):
        raise ExportError(f"{where} holds non-zero weight_zero_point values (asymmetric); tq's quantizers are symmetric")
    if entry("weight_g_idx") is not None:
        raise ExportError(f"{where} holds weight_g_idx (GPTQ activation ordering); tq loads groups in their natural order")
    if entry("weight_scale") is None:
        raise ExportError(f"{where} lacks its weight_scale")
    local = "weight_packed" if entry("weight_packed") is not None else "weight"
    data = entry(local)
    if data is None:
        raise ExportError(f"{where} lacks its weight (or weight_packed)")
    stored, shape = data["dtype"], tuple(data["shape"])
    if stored in _FLOAT_STORAGE:
        pass
    elif isinstance(q, IntQuantizer):
        bits = q.format.bits
        if stored == "I32":  # pack-quantized: 32 // bits codes a word
            if entry("weight_shape") is None:
                raise ExportError(f"{where}: its weight_packed has no weight_shape beside it")
            logical = tuple(int(v) for v in get("weight_shape"))
            words = -(-logical[-1] * bits // 32)
            if bits not in (4, 8) or shape[-1] != words or shape[:-1] != logical[:-1]:
                raise ExportError(
                    f"{where}: {prefix}.weight_packed is {list(shape)} int32 words for a {list(logical)} weight; num_bits={bits} "
                    f"packs it in {[*logical[:-1], words]}{'' if bits in (4, 8) else ' (tq loads 4 and 8 bits)'}: the config's "
                    "num_bits contradicts the payload"
                )
            shape = logical
        elif stored == "I8":
            if bits < 8:  # codes stored a byte each: their range is what says how many bits they have
                codes = get(local)
                lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
                if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
                    raise ExportError(
                        f"{where}: {prefix}.{local} holds codes from {int(codes.min())} to {int(codes.max())}, beyond num_bits={bits}'s "
                        f"{lo}..{hi}: the config's num_bits contradicts the payload"
                    )
        else:
            raise ExportError(f"{where}: its {local} is stored as {stored}; the scheme stores int8 (or int32 words, packed)")
    else:
        want = q.element_format().storage_dtype
        from tqcompile.export.safetensors_io import _DTYPES

        if stored != _DTYPES.get(want):
            raise ExportError(f"{where}: its {local} is stored as {stored}; the scheme stores {_DTYPES.get(want, want)}")
        shape = tuple(q.logical_shape(torch.Size(shape)))
    err = q.shape_error(shape)
    if err is not None:
        raise ExportError(f"{where}: its {shape} weight does not fit tq's {q!r}: {err}")
    scale = get("weight_scale")
    want_scale = torch.Size(q.scale_shape(shape))
    if isinstance(q, NVFP4Quantizer) and scale.numel() == want_scale.numel() and _nvfp4_block_2d(scale.reshape(want_scale)):
        q = dataclasses.replace(q, block_2d=True)
        scheme = dataclasses.replace(scheme, weight_q=q)
    if scale.numel() != want_scale.numel():
        raise ExportError(
            f"{where}: {prefix}.weight_scale has shape {list(scale.shape)}; a {list(shape)} weight quantized as the config says "
            f"({scheme.text}) has {list(want_scale)} scales: the config's strategy or group size contradicts the tensors"
        )
    if isinstance(q, MXQuantizer):
        nan = scale.view(torch.uint8) == 0xFF
        problem = f"{int(nan.sum())} NaN E8M0 exponent(s) (0xFF)" if bool(nan.any()) else None
    else:
        problem = _bad_values(scale, zero_ok=isinstance(q, NVFP4Quantizer))
    if problem:
        raise ExportError(f"{where}: {prefix}.weight_scale holds {problem}; a scale must be finite and positive: the checkpoint is corrupt")
    names = ["weight_scale_2" if modelopt else "weight_global_scale"] if isinstance(q, NVFP4Quantizer) else []
    iq = scheme.input_q
    input_name = "input_global_scale" if isinstance(iq, NVFP4Quantizer) and not modelopt else "input_scale"
    if iq is not None and scheme.static_input:
        names.append(input_name)
    for name in names:
        if entry(name) is None:
            raise ExportError(f"{where} lacks its {name}")
        t = get(name)
        problem = _bad_values(t, zero_ok=False) or (None if t.numel() == 1 else f"{t.numel()} values where the scheme has one")
        if problem:
            raise ExportError(f"{where}: {prefix}.{name} holds {problem}; it must be one finite, positive scale: the checkpoint is corrupt")
    for name in ("input_scale", "input_global_scale"):
        if name not in names and entry(name) is not None:
            kind = "16-bit" if iq is None else "dynamic (a scale from each input)"
            raise ExportError(
                f"{where}: {prefix}.{name} is in the checkpoint but the config says its inputs are {kind}, so the scale would be "
                "dropped: the config and the tensors disagree (a static input scheme names it, as dynamic: false)"
            )
    return scheme


def decode_layer(prefix: str, scheme: LayerScheme, get: Callable[[str], torch.Tensor | None], modelopt: bool) -> DecodedLayer:
    """Read the layer `prefix` of `scheme` (`get(local name)` returns its tensor, or None), which
    `check_layer` has checked (and given its NVFP4 tile layout)."""
    q = scheme.weight_q
    scale, packed, inexact, beyond = get("weight_scale"), get("weight_packed"), 0, 0
    data = get("weight") if packed is None else packed
    dense = data.is_floating_point() and data.dtype != torch.float8_e4m3fn  # compressed-tensors' "dense": stored dequantized
    if dense:
        shape = tuple(data.shape)
    elif isinstance(q, IntQuantizer):
        if data.dtype == torch.int32:  # pack-quantized
            cols = get("weight_shape")
            data = _unpack_int32(data, q.format.bits, int(cols[-1]))
        shape = tuple(data.shape)
        beyond = int((data.to(torch.int16).abs() > q.format.max_value).sum())
        data = _int_payload(data, q)
    else:
        shape = q.logical_shape(data.shape)
    weight_amax, rceil, pow2 = None, False, None
    if isinstance(q, NVFP4Quantizer):
        weight_amax, inexact = _nvfp4_amax(get("weight_scale_2" if modelopt else "weight_global_scale"), q, reciprocal=modelopt)
        if q.block_2d:  # written as 1x16 blocks, one row of scales a 16-row tile
            scale = scale[::16]
        w = ops.dequantize(data, scale.to(torch.float8_e4m3fn).contiguous(), weight_amax, q, torch.float32)
    elif isinstance(q, MXQuantizer):
        rceil = _mx_rceil(data, q)
        w = ops.dequantize(data, scale.view(torch.uint8).view(torch.float8_e8m0fnu).contiguous(), None, q, torch.float32)
    else:
        weight_amax, inexact = _scaled_amax(scale.reshape(q.scale_shape(shape)), q)
        if isinstance(q, Float8Quantizer):  # fp32 powers of two have no mantissa bits
            pow2 = bool(((scale.float().view(torch.int32) & 0x7FFFFF) == 0).all())
        scale_inv = _scale_inv_of(q)(weight_amax)
        if dense:
            w = data.float()
        else:
            w = ops.dequantize(data, scale_inv.contiguous(), None, q, torch.float32)
    input_amax, more = _input_amax(scheme, get, modelopt)
    return DecodedLayer(scheme, w, weight_amax, input_amax, inexact + more, beyond, rceil, pow2)


def _input_amax(scheme: LayerScheme, get, modelopt: bool) -> tuple[torch.Tensor | None, int]:
    iq = scheme.input_q
    if iq is None or not scheme.static_input:
        return None, 0
    s = get("input_global_scale" if isinstance(iq, NVFP4Quantizer) and not modelopt else "input_scale")
    if isinstance(iq, NVFP4Quantizer):
        return _nvfp4_amax(s, iq, reciprocal=modelopt)
    amax, bad = _scaled_amax(s.reshape(()), iq)
    return amax, bad
