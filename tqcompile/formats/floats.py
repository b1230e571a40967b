"""Floating-point element formats: the FP8 formats torch has a dtype for (a saturating cast), and
small floats without inf or NaN (E2M1; OCP's E2M3 and E3M2 are the same codec with other widths),
encoded on their grid of values.

Registering a small float is one line: its `Format` member and ``SmallFloatCodec(ebits, mbits)``;
``mx_element=True`` makes it an MX element format too (`tq.MXQuantizer`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from tqcompile.formats.codec import ElementCodec
from tqcompile.formats.format import Format, register_codec

__all__ = ["FloatCodec", "CastFloatCodec", "SmallFloatCodec", "E2M1_VALUES"]

# The eight non-negative E2M1 magnitudes, indexed by the 3-bit code (sign is bit 3).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclasses.dataclass(frozen=True)
class FloatCodec(ElementCodec):
    """A float format: sign, `ebits` exponent bits (bias ``2**(ebits-1) - 1``), `mbits` mantissa bits."""

    ebits: int = 0
    mbits: int = 0

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (below it, subnormals are spaced ``2**(emin - mbits)``)."""
        return 1 - self.bias


def _float_codec(cls, *, ebits: int, mbits: int, max_value: float, torch_dtype: torch.dtype | None):
    bits = 1 + ebits + mbits
    return cls(
        bits=bits,
        max_value=max_value,
        kind="float",
        torch_dtype=torch_dtype,
        emax=math.floor(math.log2(max_value)),
        ebits=ebits,
        mbits=mbits,
    )


@dataclasses.dataclass(frozen=True)
class CastFloatCodec(FloatCodec):
    """A float format torch has a dtype for: encoding is a cast, saturating at ±max; NaN encodes as +NaN."""

    @classmethod
    def of(cls, torch_dtype: torch.dtype, ebits: int, mbits: int) -> CastFloatCodec:
        return _float_codec(cls, ebits=ebits, mbits=mbits, max_value=torch.finfo(torch_dtype).max, torch_dtype=torch_dtype)

    def encode(self, v: torch.Tensor) -> torch.Tensor:
        m = self.max_value
        # Every NaN encodes as +NaN (0x7F). Which sign bit torch leaves on a NaN is path-dependent: a
        # GPU multiply returns +NaN, a CPU one keeps its operand's sign, and CPU fp16 -> fp32 keeps it
        # on its vectorized path only (a 1-element -NaN fp16 tensor came out 0x7F, a 64-element one 0xFF).
        v = torch.where(torch.isnan(v), math.nan, v)
        return v.clamp(-m, m).to(self.torch_dtype)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.float()


@dataclasses.dataclass(frozen=True)
class SmallFloatCodec(FloatCodec):
    """A float format narrower than a byte with no inf or NaN (OCP's FP4 / FP6 element formats).

    Codes are uint8: the sign in bit ``bits - 1``, the magnitude's index on the grid of the
    ``2**(bits-1)`` non-negative values below it (that index *is* the exponent and mantissa bits).
    Encoding rounds to the nearest grid value, ties to the even code (the even mantissa),
    saturating at ±max; NaN encodes as +0; the sign is kept for values that round to zero
    (-0.01 -> -0), so ``encode(decode(c)) == c`` for every code.
    """

    @classmethod
    def of(cls, ebits: int, mbits: int) -> SmallFloatCodec:
        bias = 2 ** (ebits - 1) - 1
        top = (2 - 2.0**-mbits) * 2.0 ** ((2**ebits - 1) - bias)
        return _float_codec(cls, ebits=ebits, mbits=mbits, max_value=top, torch_dtype=None)

    @functools.cached_property
    def magnitudes(self) -> tuple[float, ...]:
        """The non-negative values, indexed by the magnitude bits of the code."""
        out = []
        for code in range(2 ** (self.bits - 1)):
            e, m = code >> self.mbits, code & (2**self.mbits - 1)
            if e == 0:  # subnormal
                out.append(m * 2.0 ** (self.emin - self.mbits))
            else:
                out.append((1 + m * 2.0**-self.mbits) * 2.0 ** (e - self.bias))
        return tuple(out)

    def _sign(self, v: torch.Tensor) -> torch.Tensor:
        """The sign bit from v's IEEE sign bit (so -0.0 stays -0 and encode(decode(c)) == c); NaN has none."""
        return (torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << (self.bits - 1)

    def encode(self, v: torch.Tensor) -> torch.Tensor:
        grid = self.magnitudes
        mag = v.abs()
        code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
        for i in range(len(grid) - 1):
            t = (grid[i] + grid[i + 1]) / 2  # exact: the midpoint of two grid values is one more mantissa bit
            # A tie goes to the even code: up from an odd code i, down from an even one.
            up = (mag >= t) if i % 2 == 1 else (mag > t)
            code = code + up.to(torch.uint8)  # out of place: inductor may trace this (tqcompile.ops.inductor)
        return code | self._sign(v)

    def encode_stochastic(self, v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Stochastic rounding: up to the next grid value with probability (|v| - lo) / (hi - lo),
        for uniform numbers `u` in [0, 1) (one per element, any shape of v's size)."""
        grid = torch.tensor(self.magnitudes, device=v.device)
        top = len(self.magnitudes) - 1
        mag = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=self.max_value)
        lo_code = (mag.unsqueeze(-1) >= grid[1:]).sum(-1)
        hi_code = (lo_code + 1).clamp(max=top)
        lo, hi = grid[lo_code], grid[hi_code]
        gap = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
        up = u.reshape(v.shape) < (mag - lo) / gap
        code = torch.where(up, hi_code, lo_code).to(torch.uint8)
        return code | self._sign(v)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor tracing a decomposition (tqcompile.ops.inductor)
            return self._decode_arithmetic(codes)
        grid = self.magnitudes
        lut = torch.tensor(grid + tuple(-v for v in grid), device=codes.device)
        return lut[codes.long()]

    def _decode_arithmetic(self, codes: torch.Tensor) -> torch.Tensor:
        """`decode` without the table: the same values bit for bit (signed zeros included), from
        fp32 arithmetic on the code. Eager, the table is 6x faster (one gather against a dozen
        passes); compiled, inductor's CPU backend turns the gather into scalar loads and this into
        one vectorized loop: an NVFP4 (2816, 1024) weight dequantized 6.8 ms -> 1.8 ms, one thread."""
        c = codes.float()
        half = float(2 ** (self.bits - 1))
        neg = c >= half
        mag = torch.where(neg, c - half, c)
        e = torch.floor(mag * 2.0**-self.mbits)
        m = mag - e * 2.0**self.mbits
        v = m * 2.0 ** (self.emin - self.mbits)  # subnormals (e == 0)
        for k in range(1, 2**self.ebits):
            v = torch.where(e == k, (m + 2.0**self.mbits) * 2.0 ** (k - self.bias - self.mbits), v)
        return torch.where(neg, -v, v)


register_codec(Format.E4M3, CastFloatCodec.of(torch.float8_e4m3fn, ebits=4, mbits=3), mx_element=True)
register_codec(Format.E5M2, CastFloatCodec.of(torch.float8_e5m2, ebits=5, mbits=2), mx_element=True)
register_codec(Format.E2M1, SmallFloatCodec.of(ebits=2, mbits=1), mx_element=True)
