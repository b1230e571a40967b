"""`Format`, the enum of element and scale formats, and the registry of the codecs behind it.

`Format` is an `Enum`, so it is already an opaque value type for torch.compile and may sit in a
quantizer's fields (Dynamo treats its members as constants). What a member *is* lives in the
`ElementCodec` registered for it (`register_codec`, called by `tqcompile.formats.floats`, `ints`
and `scales`); every property here asks that codec.
"""

from __future__ import annotations

import enum

import torch

from tqcompile.formats.codec import ElementCodec

__all__ = ["Format", "register_codec", "mx_element_formats", "formats_of_kind"]


class Format(enum.Enum):
    """An element or scale format.

    Example:
        >>> Format.E4M3.max_value
        448.0
        >>> Format.E2M1.bits
        4
        >>> Format.E2M1.codec.encode(torch.tensor([0.3, -5.5]))   # codes; sign in bit 3
        tensor([ 1, 15], dtype=torch.uint8)
    """

    # Pickles and `torch.load(weights_only=True)` allow-lists name the class by module: keep the
    # one it had before formats became a package, so saved quantizers load either way.
    __module__ = "tqcompile.formats"

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    E2M1 = "e2m1"
    E2M3 = "e2m3"  # MXFP6 (tqcompile.formats.fp6)
    E3M2 = "e3m2"  # MXFP6
    E8M0 = "e8m0"
    INT8 = "int8"
    INT4 = "int4"
    INT3 = "int3"  # weights only: 8 codes in 3 bytes
    INT2 = "int2"  # weights only: 4 codes a byte

    @property
    def codec(self) -> ElementCodec:
        """The codec registered for this format: encode / decode / pack / unpack and the facts below."""
        return _CODECS[self]

    @property
    def bits(self) -> int:
        """Width of one element in bits."""
        return _CODECS[self].bits

    @property
    def max_value(self) -> float:
        """Largest finite magnitude (for E8M0, the largest power of two, 2**127)."""
        return _CODECS[self].max_value

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two the format holds (OCP MX `emax_elem`)."""
        emax = _CODECS[self].emax
        if emax is None:
            have = [f for f in Format if f in _CODECS and _CODECS[f].emax is not None]
            raise ValueError(f"{self} has no floating-point exponent; emax is defined for {have}")
        return emax

    @property
    def is_float(self) -> bool:
        """True for the floating-point element formats (E4M3, E5M2, E2M1)."""
        return _CODECS[self].kind == "float"

    @property
    def is_int(self) -> bool:
        """True for the integer element formats (INT8, INT4, INT3, INT2)."""
        return _CODECS[self].kind == "int"

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype of one element, or None where torch has none (E2M1 and INT4 are
        stored two to a `uint8` byte, low nibble first)."""
        return _CODECS[self].torch_dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype payloads of this format are stored in."""
        return _CODECS[self].storage_dtype

    @property
    def pack_elements(self) -> int:
        """Elements in one packed group of the last dim: 1, or 2 for 4-bit formats (two a byte)."""
        return _CODECS[self].pack_elements

    @property
    def pack_bytes(self) -> int:
        """Bytes one packed group (`pack_elements` elements) takes."""
        return _CODECS[self].pack_bytes

    @property
    def elements_per_byte(self) -> int:
        """Elements a payload byte holds (2 for 4-bit formats); only for formats that pack whole
        elements into one byte (see `pack_elements` / `pack_bytes` for the others)."""
        codec = _CODECS[self]
        if codec.pack_bytes != 1:
            raise ValueError(
                f"{self} packs {codec.pack_elements} elements in {codec.pack_bytes} bytes; use pack_elements / pack_bytes"
            )
        return codec.pack_elements


_CODECS: dict[Format, ElementCodec] = {}
_MX_ELEMENTS: set[Format] = set()


def register_codec(fmt: Format, codec: ElementCodec, *, mx_element: bool = False) -> None:
    """Make `codec` what `fmt` is. `mx_element=True` also makes `fmt` an element format of OCP MX
    blocks (`tq.MXQuantizer(format=fmt)`), whose scale rule needs only the codec's `emax` and
    `max_value`. Each format is registered once, by the module of its kind of element."""
    if fmt in _CODECS:
        raise ValueError(f"register_codec: {fmt} already has the codec {_CODECS[fmt]!r}")
    if mx_element and (codec.kind != "float" or codec.emax is None):
        raise ValueError(f"register_codec: {fmt} ({codec!r}) cannot be an MX element: MX scales need a float codec with an emax")
    _CODECS[fmt] = codec
    if mx_element:
        _MX_ELEMENTS.add(fmt)


def mx_element_formats() -> tuple[Format, ...]:
    """The formats registered as OCP MX element formats, in `Format` order."""
    return tuple(f for f in Format if f in _MX_ELEMENTS)


def formats_of_kind(kind: str, bits: int | None = None) -> tuple[Format, ...]:
    """The registered formats of `kind` ("float", "int", "scale"), of width `bits` if given, in `Format` order."""
    return tuple(f for f in Format if f in _CODECS and _CODECS[f].kind == kind and bits in (None, _CODECS[f].bits))
