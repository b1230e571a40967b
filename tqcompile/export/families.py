"""What every checkpoint format needs to know of a quantizer family: one `functools.singledispatch`
per question, registered here per family (a new family registers its own, from its module or here).

- **Candidates** (`register_candidates`, `quantizer_candidates`): the quantizers of a family a
  checkpoint's scheme may be. `tq.load_exported` runs a format's own scheme mapping over them and
  takes the first whose scheme is the checkpoint's, so a scheme loads exactly when tq would export
  it that way. MX candidates are every registered MX element format
  (`tqcompile.formats.format.mx_element_formats`): a new element needs no entry here.
- **Global scales** (`global_scale`, `global_amax`): families with `has_global_scale()` (NVFP4).
- **Block-scale tiles** (`scale_rows`, `with_stored_tiles`): NVFP4's 16x16 weight tiles are written
  as 1x16 block scales repeated down each tile's 16 rows, the layout engines load.
- **Payloads** (`check_payload`, `read_payload`): how a family's payload is stored and read back.
  Integers are int8 codes or compressed-tensors' int32 words (`pack_int32_words`, the only integer
  packing a format has); the others are their element format's storage dtype, packed by bit width.
- **Scales** (`scale_problem`, `read_weight`, `scale_rules`): what makes a stored scale corrupt, the
  weight and amax a family's scales give, and the scale rules (MX RCEIL, FP8 power-of-two scales)
  that a checkpoint does not record but its scales reveal.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from tqcompile import ops
from tqcompile.export.safetensors_io import dtype_name
from tqcompile.export.scales import amax_for_scale, bad_values, scale_inv_of, scaled_amax
from tqcompile.export.units import ExportError
from tqcompile.formats.codec import pack_codes, unpack_codes
from tqcompile.kernels.reference import int_values
from tqcompile.quantizers import (
    Float8Quantizer,
    Granularity,
    IntGrid,
    IntQuantizer,
    MXQuantizer,
    NVFP4Quantizer,
    Quantizer,
    ScaleRounding,
)
from tqcompile.quantizers.nvfp4 import NVFP4_ENC, nvfp4_tensor_scale

INT_BITS = (2, 3, 4, 8)  # the integer widths pack-quantized checkpoints hold that tq reads and writes

__all__ = [
    "StoredLayer",
    "ReadWeight",
    "register_candidates",
    "quantizer_candidates",
    "global_scale",
    "global_amax",
    "scale_rows",
    "with_stored_tiles",
    "check_payload",
    "read_payload",
    "stored_scale_shape",
    "check_zero_points",
    "scale_problem",
    "read_weight",
    "scale_rules",
    "pack_int32_words",
    "unpack_int32_words",
]


@dataclasses.dataclass(frozen=True)
class StoredLayer:
    """One checkpoint layer as the readers see it: `prefix` its name, `where` the start of its
    messages, ``entry(local)`` a tensor's header entry (None: absent), ``get(local)`` the tensor."""

    prefix: str
    where: str
    entry: Callable[[str], dict | None]
    get: Callable[[str], torch.Tensor | None]


@dataclasses.dataclass
class ReadWeight:
    """A layer's weight as tq dequantizes it from the checkpoint's payload and scales, the static
    amax those scales give (tensor-level: 0-dim; per unit: the scale shape; None for MX), how many
    scales have no exact tq amax, and what the scales reveal of the rules that wrote them."""

    weight: torch.Tensor
    amax: torch.Tensor | None
    inexact: int = 0
    mx_rceil: bool = False
    pow2_scales: bool | None = None
    quantizer: Quantizer | None = None  # the weight quantizer the scales were read with (an integer grid read off them)


# ---------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------
_CANDIDATES: dict[type, Callable[[int | None, int | None], list[Callable[[], Quantizer]]]] = {}


def register_candidates(family: type):
    """Decorator: ``fn(group_size, block) -> [constructors]`` makes the quantizers of `family` a
    checkpoint scheme may be (a constructor that raises ValueError or TypeError, for a block size
    the scheme does not have, is skipped). Families are tried in registration order."""

    def deco(fn):
        _CANDIDATES[family] = fn
        return fn

    return deco


def quantizer_candidates(group_size: int | None, block: int | None) -> list[Quantizer]:
    """Every registered family's candidates for a scheme with 1-D groups of `group_size` and 2-D
    blocks of `block` (None: the scheme has none)."""
    made = []
    for candidates in _CANDIDATES.values():
        for make in candidates(group_size, block):
            try:
                made.append(make())
            except (ValueError, TypeError):  # a block size this scheme does not have (None) or tq refuses
                continue
    return made


def _amax_scaled(cls: type, group_size: int | None, block: int | None, blocks_2d: bool) -> list[Callable[[], Quantizer]]:
    # Per tensor, per row, 1-D groups (and 2-D blocks), for each element format of the family.
    out = []
    for fmt in cls.allowed_formats():
        out += [
            lambda f=fmt: cls(f),
            lambda f=fmt: cls(f, Granularity.ROWWISE),
            lambda f=fmt: cls(f, Granularity.BLOCKWISE_1D, block_size=group_size),
        ]
        if blocks_2d:
            out.append(lambda f=fmt: cls(f, Granularity.BLOCKWISE_2D, block_size=block))
    return out


# INT first, then FP8, MX and NVFP4: the order the loader has always tried them in. (Integer
# candidates are SYMMETRIC; `read_weight` reads the grid off the codes and scales.)
register_candidates(IntQuantizer)(
    lambda group_size, block: _amax_scaled(IntQuantizer, group_size, block, blocks_2d=False)
    + [
        lambda f=f, make=make: dataclasses.replace(make(f), grid=IntGrid.ASYMMETRIC)
        for f in IntQuantizer.allowed_formats()
        for make in (lambda f: IntQuantizer(f, Granularity.ROWWISE), lambda f: IntQuantizer(f, Granularity.BLOCKWISE_1D, block_size=group_size))
    ]
)
register_candidates(Float8Quantizer)(lambda group_size, block: _amax_scaled(Float8Quantizer, group_size, block, blocks_2d=True))
register_candidates(MXQuantizer)(lambda group_size, block: [lambda f=f: MXQuantizer(f) for f in MXQuantizer.allowed_formats()])
register_candidates(NVFP4Quantizer)(lambda group_size, block: [NVFP4Quantizer])


# ---------------------------------------------------------------------------------------------
# Global scales and block-scale tiles
# ---------------------------------------------------------------------------------------------
@functools.singledispatch
def global_scale(q: Quantizer, amax: torch.Tensor) -> torch.Tensor:
    """The global scale (``s_enc``) of a quantizer with `has_global_scale()`, from its tensor amax."""
    raise TypeError(f"{type(q).__name__} has no global scale")


@global_scale.register(NVFP4Quantizer)
def _(q, amax):
    return nvfp4_tensor_scale(amax, q)


@functools.singledispatch
def global_amax(q: Quantizer, stored: torch.Tensor, reciprocal: bool) -> tuple[torch.Tensor, int]:
    """The tensor amax whose global scale is the checkpoint's `stored` one (``1 / s_enc`` where
    `reciprocal`), searched (`amax_for_scale`), and whether it is inexact."""
    raise TypeError(f"{type(q).__name__} has no global scale")


@global_amax.register(NVFP4Quantizer)
def _(q, stored, reciprocal):
    s = stored.float().reshape(())
    enc = lambda a: nvfp4_tensor_scale(a, q)  # noqa: E731
    if reciprocal:
        return amax_for_scale(s, lambda a: 1.0 / enc(a), s * NVFP4_ENC)
    return amax_for_scale(s, enc, torch.div(NVFP4_ENC, s))


@functools.singledispatch
def scale_rows(q: Quantizer, scale: torch.Tensor) -> torch.Tensor:
    """The block scales as a checkpoint holds them: one row of scales a weight row."""
    return scale


@scale_rows.register(NVFP4Quantizer)
def _(q, scale):
    # 16x16 weight tiles are 1x16 blocks that share a scale down each 16 rows.
    return scale.repeat_interleave(16, dim=-2) if q.block_2d else scale


def _tiles_repeat(scale: torch.Tensor) -> bool:
    """Whether block scales repeat down every 16 rows: 16x16 weight tiles, written as 1x16 blocks."""
    rows = scale.shape[0]
    if rows % 16:
        return False
    tiles = scale.view(torch.uint8).reshape(rows // 16, 16, -1)
    return bool((tiles == tiles[:, :1]).all())


@functools.singledispatch
def with_stored_tiles(q: Quantizer, scale: torch.Tensor, want: torch.Size) -> Quantizer:
    """`q` with the scale layout the checkpoint's block scales show (`want`: their shape for `q`)."""
    return q


@with_stored_tiles.register(NVFP4Quantizer)
def _(q, scale, want):
    if scale.numel() == want.numel() and _tiles_repeat(scale.reshape(want)):
        return dataclasses.replace(q, block_2d=True)
    return q


# ---------------------------------------------------------------------------------------------
# Payloads
# ---------------------------------------------------------------------------------------------
def pack_int32_words(ints: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' `pack-quantized` words (0.19 and later): offset-binary values
    (v + 2**(bits-1)) packed densely along the last dim, element i at bit ``bits * i`` of the row's
    little-endian bit stream (a 3-bit code may straddle two words), ``ceil(cols * bits / 32)`` words
    a row. For 2, 4 and 8 bits that is also the older `32 // bits` codes a word."""
    if bits not in INT_BITS:
        raise ExportError(f"pack-quantized export supports {INT_BITS} bits, got {bits}")
    u = (ints.to(torch.int32) + (1 << (bits - 1))).to(torch.uint8)
    cols = u.shape[-1]
    pad = -cols % 32  # 32 codes fill `bits` whole words
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    # tq's own packing of `bits`-wide codes is that bit stream, in bytes of word order.
    packed = pack_codes(u, bits).contiguous()
    # Little-endian words (every CPU torch runs on here); flat first: a (1, n) view may keep a stride of 1.
    words = packed.reshape(-1).view(torch.int32).reshape(*packed.shape[:-1], -1)
    return words[..., : -(-cols * bits // 32)].contiguous()


def unpack_int32_words(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """`pack_int32_words` back to int8 values (the first `cols` of each row)."""
    if bits not in INT_BITS:
        raise ExportError(f"tq.load_exported: pack-quantized with {bits} bits; tq loads {INT_BITS}")
    words = packed.contiguous()
    pad = -words.shape[-1] % bits  # whole groups of 32 codes (`bits` words each) for the unpacker
    if pad:
        words = torch.nn.functional.pad(words, (0, pad))
    u = unpack_codes(words.view(torch.uint8), bits)  # little-endian words: bytes in element order
    return (u[..., :cols].to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


@functools.singledispatch
def check_payload(q: Quantizer, layer: StoredLayer, local: str, stored: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Check how the weight payload `local` (safetensors dtype `stored`, `shape`) is stored for
    `q`; return the weight's logical shape. The default: the element format's storage dtype."""
    want = q.element_format().storage_dtype
    if stored != dtype_name(want):
        raise ExportError(f"{layer.where}: its {local} is stored as {stored}; the scheme stores {dtype_name(want) or want}")
    return tuple(q.logical_shape(torch.Size(shape)))


@check_payload.register(IntQuantizer)
def _(q, layer, local, stored, shape):
    bits, where, prefix = q.format.bits, layer.where, layer.prefix
    if stored == "I32":  # pack-quantized: 32 // bits codes a word
        if layer.entry("weight_shape") is None:
            raise ExportError(f"{where}: its weight_packed has no weight_shape beside it")
        logical = tuple(int(v) for v in layer.get("weight_shape"))
        words = -(-logical[-1] * bits // 32)
        if bits not in INT_BITS or shape[-1] != words or shape[:-1] != logical[:-1]:
            raise ExportError(
                f"{where}: {prefix}.weight_packed is {list(shape)} int32 words for a {list(logical)} weight; num_bits={bits} "
                f"packs it in {[*logical[:-1], words]}{'' if bits in INT_BITS else f' (tq loads {INT_BITS} bits)'}: the config's "
                "num_bits contradicts the payload"
            )
        return logical
    if stored == "I8":
        if bits < 8:  # codes stored a byte each: their range is what says how many bits they have
            codes = layer.get(local)
            lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
            if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
                raise ExportError(
                    f"{where}: {prefix}.{local} holds codes from {int(codes.min())} to {int(codes.max())}, beyond num_bits={bits}'s "
                    f"{lo}..{hi}: the config's num_bits contradicts the payload"
                )
        return shape
    raise ExportError(f"{where}: its {local} is stored as {stored}; the scheme stores int8 (or int32 words, packed)")


@functools.singledispatch
def read_payload(q: Quantizer, data: torch.Tensor, layer: StoredLayer) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(payload in tq's layout, logical shape) of a stored, checked payload."""
    return data, tuple(q.logical_shape(data.shape))


@read_payload.register(IntQuantizer)
def _(q, data, layer):
    codec = q.format.codec
    if data.dtype == torch.int32:  # pack-quantized
        data = unpack_int32_words(data, codec.bits, int(layer.get("weight_shape")[-1]))
    # The codes' bit patterns, kept as they are (-8 and -128 included: loaded quantizers are FULL-grid).
    codes = data if codec.torch_dtype is not None else data.view(torch.uint8) & ((1 << codec.bits) - 1)
    return codec.pack(codes), tuple(data.shape)


# ---------------------------------------------------------------------------------------------
# Scales
# ---------------------------------------------------------------------------------------------
@functools.singledispatch
def scale_problem(q: Quantizer, scale: torch.Tensor) -> str | None:
    """What makes the stored weight scales corrupt, or None."""
    return bad_values(scale, zero_ok=False)


@scale_problem.register(MXQuantizer)
def _(q, scale):
    nan = scale.view(torch.uint8) == 0xFF
    return f"{int(nan.sum())} NaN E8M0 exponent(s) (0xFF)" if bool(nan.any()) else None


@scale_problem.register(NVFP4Quantizer)
def _(q, scale):
    return bad_values(scale, zero_ok=True)  # an all-zero block has a zero block scale


@functools.singledispatch
def read_weight(q: Quantizer, data, scale, shape, dense: bool, layer: StoredLayer, global_tensor) -> ReadWeight:
    """The weight and amaxes of a layer of `q` from its payload `data` (tq's layout, or the float
    weight where `dense`) and stored `scale`. The default: amax-scaled families (FP8, INT)."""
    amax, inexact = scaled_amax(scale.reshape(q.scale_shape(shape)), q)
    scale_inv = scale_inv_of(q)(amax)
    w = data.float() if dense else ops.dequantize(data, scale_inv.contiguous(), None, q, torch.float32)
    return ReadWeight(w, amax, inexact, quantizer=q)


def stored_scale_shape(q: Quantizer, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the `weight_scale` a checkpoint stores for a weight of `shape`: tq's scale
    shape, without the zero points an asymmetric quantizer keeps beside its scales."""
    want = tuple(q.scale_shape(shape))
    return want[:-1] if q.has_zero_point() else want


def _zero_points(q: IntQuantizer, layer: StoredLayer, scale_shape: tuple[int, ...]) -> torch.Tensor:
    """The int8 zero points of an asymmetric layer, in its scale's shape (unpacked where packed)."""
    zp = layer.get("weight_zero_point")
    if zp.dtype == torch.int32:  # pack-quantized: packed along the rows
        zp = unpack_int32_words(zp.transpose(-1, -2), q.format.bits, scale_shape[-2]).transpose(-1, -2)
    return zp.reshape(scale_shape)


def check_zero_points(q: IntQuantizer, layer: StoredLayer) -> None:
    """An asymmetric layer's zero points: there, int8 (or int32 words, packed along the rows),
    shaped as its scale, within the grid's codes."""
    where, prefix = layer.where, layer.prefix
    entry, scale = layer.entry("weight_zero_point"), layer.entry("weight_scale")
    if entry is None:
        raise ExportError(f"{where} lacks its weight_zero_point (its config says symmetric: false)")
    rows, groups = (list(scale["shape"]) + [1])[:2] if len(scale["shape"]) < 2 else scale["shape"][-2:]
    packed = [-(-rows * q.format.bits // 32), groups]
    if entry["dtype"] not in ("I8", "I32") or (entry["dtype"] == "I32" and list(entry["shape"][-2:]) != packed):
        raise ExportError(
            f"{where}: {prefix}.weight_zero_point is {entry['dtype']} {list(entry['shape'])}; the scheme stores int8 zero points "
            f"shaped as weight_scale {list(scale['shape'])}, or int32 {packed} packed along the rows"
        )
    zp = _zero_points(q, layer, tuple(scale["shape"]))
    lo, hi = q.code_range()
    if zp.numel() and (int(zp.min()) < lo or int(zp.max()) > hi):
        raise ExportError(
            f"{where}: {prefix}.weight_zero_point holds values from {int(zp.min())} to {int(zp.max())}, beyond the "
            f"{q.format.bits}-bit codes {lo}..{hi}: the checkpoint is corrupt"
        )


def _read_asymmetric(q: IntQuantizer, data, scale, shape, dense: bool, layer: StoredLayer) -> ReadWeight:
    # The span T = max - min a scale comes from is searched as a symmetric amax is (its scale_inv
    # is T / (2**bits - 1)); the zero point then places -min at (zp - lo) steps: -min = (zp - lo) T / (2**bits - 1).
    base = stored_scale_shape(q, shape)
    span, inexact = scaled_amax(scale.reshape(base), q)
    zero = _zero_points(q, layer, base).float()
    below = (zero - q.code_range()[0]) * span / q.scale_max()
    # The quantizer adds the two back in fp32: `span - below` need not give the span back (3% of
    # random cases), while below' = span - (span - below) and span - below' do (measured: every one
    # of 10^5); a unit where they still do not is counted inexact.
    below = span - (span - below)
    above = span - below
    inexact += int(((below + above) != span).sum())
    amax = torch.stack([below, above], -1)
    scales = torch.stack([scale_inv_of(q)(span), zero], -1)
    w = data.float() if dense else ops.dequantize(data, scales.contiguous(), None, q, torch.float32)
    return ReadWeight(w, amax, inexact, quantizer=q)


@read_weight.register(IntQuantizer)
def _(q, data, scale, shape, dense, layer, global_tensor):
    if q.has_zero_point():
        return _read_asymmetric(q, data, scale, shape, dense, layer)
    # The grid is not in the checkpoint: codes at the bottom of the FULL grid (-8, -128: what
    # llmcompressor writes, and tq's FULL-grid presets) need it; a layer without any reads as the
    # SYMMETRIC layers tq writes (the same codes either way; the scales map back exactly).
    if q.grid is IntGrid.SYMMETRIC and not dense:
        full = dataclasses.replace(q, grid=IntGrid.FULL)
        if bool((int_values(data, q) == full.code_range()[0]).any()):
            q = full
    return read_weight.dispatch(Quantizer)(q, data, scale, shape, dense, layer, global_tensor)


@read_weight.register(Float8Quantizer)
def _(q, data, scale, shape, dense, layer, global_tensor):
    read = read_weight.dispatch(Quantizer)(q, data, scale, shape, dense, layer, global_tensor)
    read.pow2_scales = bool(((scale.float().view(torch.int32) & 0x7FFFFF) == 0).all())  # no mantissa bits
    return read


@read_weight.register(MXQuantizer)
def _(q, data, scale, shape, dense, layer, global_tensor):
    e8m0 = scale.view(torch.uint8).view(q.scale_dtype()).contiguous()
    return ReadWeight(ops.dequantize(data, e8m0, None, q, torch.float32), None, mx_rceil=_mx_rceil(data, q))


def _mx_rceil(data: torch.Tensor, q: MXQuantizer) -> bool:
    """Whether some MX block's largest element is below 2**emax (256 for E4M3, 4 for E2M1), which
    the FLOOR rule never gives (its exponent puts every block's amax in [2**emax, 2**(emax+1))) and
    RCEIL does (its blocks' amaxes lie in (max / 2, max]). The checkpoint does not say which rule
    wrote it; its blocks do, for all but the smallest layers."""
    codec = q.format.codec
    block_max = codec.decode(codec.unpack(data)).abs().unflatten(-1, (-1, q.BLOCK)).amax(-1)
    return bool(((block_max > 0) & (block_max < 2.0**q.format.emax)).any())


@read_weight.register(NVFP4Quantizer)
def _(q, data, scale, shape, dense, layer, global_tensor):
    amax, inexact = global_amax(q, layer.get(global_tensor.name), global_tensor.reciprocal)
    if q.block_2d:  # written as 1x16 blocks, one row of scales a 16-row tile
        scale = scale[::16]
    w = ops.dequantize(data, scale.to(q.scale_dtype()).contiguous(), amax, q, torch.float32)
    return ReadWeight(w, amax, inexact)


@functools.singledispatch
def scale_rules(q: Quantizer | None, rceil: bool, pow2: bool) -> Quantizer | None:
    """`q` on the scale rules a checkpoint's scales show: MX blocks only RCEIL writes (`rceil`),
    FP8 scales that are all powers of two (`pow2`). Others (and None) as they are."""
    return q


@scale_rules.register(MXQuantizer)
def _(q, rceil, pow2):
    return dataclasses.replace(q, scale_rounding=ScaleRounding.RCEIL) if rceil else q


@scale_rules.register(Float8Quantizer)
def _(q, rceil, pow2):
    return dataclasses.replace(q, power_of_two_scale=True) if pow2 else q
