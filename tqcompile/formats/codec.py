"""What an element codec is, and payload packing by bit width.

An `ElementCodec` is what one `Format` member *is*: its width and range, how fp32 values become
codes (`encode`) and back (`decode`), and how codes are laid out in payload bytes (`pack` /
`unpack`). Codecs are registered for `Format` members (`tqcompile.formats.format.register_codec`)
and everything else asks them, so a new element format is a new codec, not a new branch.

Packing is by bit width only. A `bits`-wide code packs along the last dim in groups of
``pack_elements`` codes that fill ``pack_bytes`` whole bytes, little-endian: element i of a group
sits at bit ``bits * i`` of the group's bytes read as one little-endian integer. So 8 bits is one
element a byte; 4 bits two a byte, element 2i in the low nibble (the layout of NVFP4, MXFP4 and
INT4 payloads); 6 bits four elements in three bytes (OCP MXFP6).
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["ElementCodec", "pack_group", "pack_codes", "unpack_codes"]

_COUNT_WORDS = {2: "two", 3: "three", 4: "four", 8: "eight"}


def pack_group(bits: int) -> tuple[int, int]:
    """(elements, bytes) of the smallest group of `bits`-wide codes that fills whole bytes."""
    elements = 8 // math.gcd(bits, 8)
    return elements, elements * bits // 8


def _widened(codes: torch.Tensor, nbytes: int) -> torch.Tensor:
    return codes if nbytes == 1 else codes.to(torch.int32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `bits`-wide codes (uint8, the last dim a multiple of `pack_group(bits)[0]`) into
    uint8 bytes along the last dim (module docstring). 8-bit codes are returned as they are."""
    elements, nbytes = pack_group(bits)
    if elements == 1:
        return codes
    # A group that fits one byte is assembled in uint8 (for 4 bits exactly ``c[0::2] | c[1::2] << 4``),
    # a wider one in an int32 word that is then cut into bytes.
    word = _widened(codes[..., 0::elements], nbytes)
    for i in range(1, elements):
        word = word | (_widened(codes[..., i::elements], nbytes) << (bits * i))
    if nbytes == 1:
        return word
    return torch.stack([(word >> (8 * j)) & 0xFF for j in range(nbytes)], dim=-1).flatten(-2).to(torch.uint8)


def unpack_codes(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: the uint8 codes of a packed payload, in element order."""
    elements, nbytes = pack_group(bits)
    if elements == 1:
        return payload
    if nbytes == 1:
        word = payload
    else:
        grouped = payload.unflatten(-1, (-1, nbytes)).to(torch.int32)
        word = grouped[..., 0]
        for j in range(1, nbytes):
            word = word | (grouped[..., j] << (8 * j))
    mask = (1 << bits) - 1
    fields = []
    for i in range(elements):
        shift = bits * i
        field = word >> shift if shift else word
        # The top field needs no mask: the shift leaves only zeros above it.
        fields.append(field & mask if shift + bits < 8 * nbytes else field)
    codes = torch.stack(fields, dim=-1).flatten(-2)
    return codes if nbytes == 1 else codes.to(torch.uint8)


@dataclasses.dataclass(frozen=True)
class ElementCodec:
    """How one element (or scale) format encodes. Subclasses fill the fields and `encode` / `decode`.

    `kind` is "float", "int" or "scale"; `torch_dtype` the dtype codes are held in where torch has
    one (payloads are then that dtype, one element each), else None: codes are uint8 bit patterns,
    packed by `bits` (`pack_codes`). `emax` is the exponent of the largest power of two a float
    format holds (OCP MX's `emax_elem`), None for the others.
    """

    bits: int
    max_value: float
    kind: str
    torch_dtype: torch.dtype | None = None
    emax: int | None = None

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype payloads of this format are stored in."""
        return self.torch_dtype or torch.uint8

    @property
    def pack_elements(self) -> int:
        """Elements in one packed group along the last dim (1 for byte-wide formats)."""
        return pack_group(self.bits)[0] if self.torch_dtype is None else 1

    @property
    def pack_bytes(self) -> int:
        """Bytes one packed group takes (`pack_elements` elements)."""
        return pack_group(self.bits)[1] if self.torch_dtype is None else self.bits // 8

    def packing_rule(self) -> str:
        """The packing constraint on the last dim in words, e.g. "4-bit payloads pack two elements
        a byte; the last dim must be even" (shape errors quote it)."""
        n, nbytes = self.pack_elements, self.pack_bytes
        where = "a byte" if nbytes == 1 else f"in {_COUNT_WORDS.get(nbytes, nbytes)} bytes"
        need = "even" if n == 2 else f"a multiple of {n}"
        return f"{self.bits}-bit payloads pack {_COUNT_WORDS.get(n, n)} elements {where}; the last dim must be {need}"

    def encode(self, v: torch.Tensor) -> torch.Tensor:
        """fp32 values (already scaled into the format) -> codes: round to nearest even, saturating."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes -> fp32 values."""
        raise NotImplementedError

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes -> payload (packed along the last dim where `torch_dtype` is None)."""
        return codes if self.torch_dtype is not None else pack_codes(codes, self.bits)

    def unpack(self, payload: torch.Tensor) -> torch.Tensor:
        """Payload -> codes, in element order."""
        return payload if self.torch_dtype is not None else unpack_codes(payload, self.bits)

    def round(self, v: torch.Tensor) -> torch.Tensor:
        """``decode(encode(v))``: the fp32 value each element of `v` rounds to."""
        return self.decode(self.encode(v))
