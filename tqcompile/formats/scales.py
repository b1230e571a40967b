"""E8M0, the power-of-two scale format of OCP MX blocks (torch's `float8_e8m0fnu`): 8 exponent
bits with bias 127, no sign, no mantissa; code 0 is 2**-127, 0xFF is NaN."""

from __future__ import annotations

import dataclasses

import torch

from tqcompile.formats.codec import ElementCodec
from tqcompile.formats.format import Format, register_codec

__all__ = ["E8M0Codec"]


@dataclasses.dataclass(frozen=True)
class E8M0Codec(ElementCodec):
    """E8M0 scales. Quantizers compute the exponent and store it (`from_exponent`); `decode`
    builds the fp32 power of two from the bits (2**-127 is an fp32 subnormal)."""

    BIAS = 127

    def from_exponent(self, e: torch.Tensor) -> torch.Tensor:
        """Unbiased int32 exponents, already in [-127, 127], as E8M0 codes."""
        return (e + self.BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)

    def encode(self, v: torch.Tensor) -> torch.Tensor:
        """Positive fp32 values rounded down to a power of two (their exponent field); NaN -> 0xFF."""
        bits = ((v.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        return torch.where(torch.isnan(v), torch.full_like(bits, 0xFF), bits).view(torch.float8_e8m0fnu)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        bits = codes.view(torch.uint8).to(torch.int32)
        normal = (bits << 23).view(torch.float32)
        return torch.where(bits == 0, torch.full_like(normal, 2.0**-127), normal)


register_codec(Format.E8M0, E8M0Codec(bits=8, max_value=2.0**127, kind="scale", torch_dtype=torch.float8_e8m0fnu))
