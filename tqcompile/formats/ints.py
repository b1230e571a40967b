"""Signed integer element formats: INT8 (a torch int8 payload), INT4, INT3 and INT2 (two's complement
codes, packed two a byte, eight in three bytes, four a byte). Any width up to 8 is ``IntCodec.of(bits)``."""

from __future__ import annotations

import dataclasses

import torch

from tqcompile.formats.codec import ElementCodec
from tqcompile.formats.format import Format, register_codec

__all__ = ["IntCodec"]


@dataclasses.dataclass(frozen=True)
class IntCodec(ElementCodec):
    """Signed integers, ``qmax = 2**(bits-1) - 1`` (`max_value`): round half to even, saturating to
    ``[-qmax, qmax]`` or the range a quantizer's grid gives (`encode`); NaN encodes as 0. Codes
    narrower than a byte are their two's complement low bits (uint8)."""

    @classmethod
    def of(cls, bits: int) -> IntCodec:
        return cls(bits=bits, max_value=float(2 ** (bits - 1) - 1), kind="int", torch_dtype=torch.int8 if bits == 8 else None)

    def encode(self, v: torch.Tensor, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Codes of `v`, saturated to ``[lo, hi]`` (default the symmetric ``[-qmax, qmax]``; FULL
        grids pass ``lo = -qmax - 1``)."""
        qmax = self.max_value
        lo = -qmax if lo is None else lo
        hi = qmax if hi is None else hi
        ints = torch.nan_to_num(v, nan=0.0).clamp(lo, hi).round().to(torch.int8)
        return ints if self.torch_dtype is not None else ints.view(torch.uint8) & ((1 << self.bits) - 1)

    def signed(self, codes: torch.Tensor) -> torch.Tensor:
        """The signed values (int8) of codes (a narrow code's two's complement sign-extended)."""
        if self.torch_dtype is not None:
            return codes
        wide = codes.to(torch.int16)
        return torch.where(wide >= 2 ** (self.bits - 1), wide - 2**self.bits, wide).to(torch.int8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.signed(codes).float()


register_codec(Format.INT8, IntCodec.of(8))
register_codec(Format.INT4, IntCodec.of(4))
register_codec(Format.INT3, IntCodec.of(3))
register_codec(Format.INT2, IntCodec.of(2))
