"""Number formats: what each element or scale format is, its torch dtype, range and width.

`Format` is an `Enum`, so it is already an opaque value type for torch.compile and may sit in a
quantizer's fields.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["Format", "E2M1_VALUES"]

# The eight non-negative E2M1 magnitudes, indexed by the 3-bit code (sign is bit 3).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class Format(enum.Enum):
    """An element or scale format.

    Example:
        >>> Format.E4M3.max_value
        448.0
        >>> Format.E2M1.bits
        4
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    E2M1 = "e2m1"
    E8M0 = "e8m0"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int:
        """Width of one element in bits."""
        return _BITS[self]

    @property
    def max_value(self) -> float:
        """Largest finite magnitude (for E8M0, the largest power of two, 2**127)."""
        return _MAX[self]

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two the format holds (OCP MX `emax_elem`)."""
        if self not in _EMAX:
            raise ValueError(f"{self} has no floating-point exponent; emax is defined for {list(_EMAX)}")
        return _EMAX[self]

    @property
    def is_float(self) -> bool:
        """True for the floating-point element formats (E4M3, E5M2, E2M1)."""
        return self in (Format.E4M3, Format.E5M2, Format.E2M1)

    @property
    def is_int(self) -> bool:
        return self in (Format.INT8, Format.INT4)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype of one element, or None where torch has none (E2M1 and INT4 are
        stored two to a `uint8` byte, low nibble first)."""
        return {
            Format.E4M3: torch.float8_e4m3fn,
            Format.E5M2: torch.float8_e5m2,
            Format.E8M0: torch.float8_e8m0fnu,
            Format.INT8: torch.int8,
        }.get(self)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype payloads of this format are stored in."""
        return self.torch_dtype or torch.uint8

    @property
    def elements_per_byte(self) -> int:
        return 2 if self.bits == 4 else 1


_BITS = {Format.E4M3: 8, Format.E5M2: 8, Format.E2M1: 4, Format.E8M0: 8, Format.INT8: 8, Format.INT4: 4}
_MAX = {
    Format.E4M3: 448.0,
    Format.E5M2: 57344.0,
    Format.E2M1: 6.0,
    Format.E8M0: 2.0**127,
    Format.INT8: 127.0,
    Format.INT4: 7.0,
}
_EMAX = {Format.E4M3: 8, Format.E5M2: 15, Format.E2M1: 2}
