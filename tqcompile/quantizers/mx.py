"""The OCP MX family: 32-element blocks of the last dim sharing one E8M0 (power-of-two) scale,
generic over the element format (docs/numerics/mx.md).

The scale rule needs only the element codec's ``emax`` and ``max_value``, and the elements are
the codec's ``encode`` / ``pack``: any format registered with ``mx_element=True``
(`tqcompile.formats.format.register_codec`) is an MX element format here, with no code of its own.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from tqcompile.formats import Format
from tqcompile.formats.codec import ElementCodec
from tqcompile.formats.format import mx_element_formats
from tqcompile.quantizers import geometry
from tqcompile.quantizers.base import PUBLIC_MODULE, Quantizer, register_family
from tqcompile.quantizers.geometry import Granularity
from tqcompile.quantizers.scaling import div_scalar, finite_abs

__all__ = ["ScaleRounding", "MXQuantizer", "mx_exponent"]


class ScaleRounding(enum.Enum):
    """How an MX block's power-of-two scale is chosen from the block amax.

    FLOOR: OCP MX v1.0, ``e = floor(log2(amax)) - emax_elem``; the largest element may saturate.
    RCEIL: ``e = ceil(log2(amax / elem_max))``; never saturates (the rule of NVIDIA's MXFP8 GEMMs).
    """

    __module__ = PUBLIC_MODULE

    FLOOR = "floor"
    RCEIL = "rceil"


def mx_exponent(amax: torch.Tensor, rounding: ScaleRounding, codec: ElementCodec) -> torch.Tensor:
    """Unbiased block exponent e (int32) of each block amax, clamped to E8M0's range [-127, 127]."""
    if rounding is ScaleRounding.FLOOR:
        mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
        e = (exp - 1) - codec.emax
        nonzero = amax > 0
    else:
        ratio = div_scalar(amax, codec.max_value)
        mant, exp = torch.frexp(ratio)
        e = torch.where(mant == 0.5, exp - 1, exp)
        # A tiny amax whose ratio underflows to 0 gets the smallest scale, like an all-zero block.
        nonzero = ratio > 0
    e = torch.where(nonzero, e, torch.full_like(e, -127))
    return e.clamp(-127, 127)


@register_family
@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class MXQuantizer(Quantizer):
    """OCP MX: 32-element blocks along the last dim sharing one E8M0 (power-of-two) scale.

    `format` E4M3 or E5M2 gives MXFP8, E2M1 gives MXFP4 (any registered MX element format:
    `allowed_formats()`). `scale_rounding` names the rule that picks the block exponent
    (`ScaleRounding.FLOOR`, the OCP v1.0 rule, or `RCEIL`).
    """

    format: Format = Format.E4M3
    scale_rounding: ScaleRounding = ScaleRounding.FLOOR

    BLOCK = 32  # a class constant: no annotation, so not a dataclass field

    @classmethod
    def allowed_formats(cls) -> tuple[Format, ...]:
        """The formats registered as MX element formats."""
        return mx_element_formats()

    def __post_init__(self) -> None:
        self._check_enum("format", self.allowed_formats())
        self._check_enum("scale_rounding", tuple(ScaleRounding))

    def element_format(self) -> Format:
        return self.format

    def layout(self) -> geometry.Layout:
        return Granularity.BLOCKWISE_1D, -1, self.BLOCK

    def scale_dtype(self) -> torch.dtype:
        return torch.float8_e8m0fnu

    def takes_static_amax(self) -> bool:
        return False

    def reference_quantize(self, xf, amax, seed) -> tuple[torch.Tensor, torch.Tensor]:
        codec, scales = self.format.codec, Format.E8M0.codec
        e = mx_exponent(geometry.unit_amax(finite_abs(xf), self.layout()), self.scale_rounding, codec)
        scale_e8m0 = scales.from_exponent(e)
        v = xf / geometry.expand(scales.decode(scale_e8m0), xf.shape, self.layout())
        return codec.pack(codec.encode(v)), scale_e8m0

    def reference_dequantize(self, data, scale_inv, amax, shape) -> torch.Tensor:
        return self.dequantize_codes(self.format.codec.unpack(data), scale_inv, shape)

    def dequantize_codes(self, codes: torch.Tensor, scale_inv: torch.Tensor, shape) -> torch.Tensor:
        """`reference_dequantize` of the codes already unpacked (in element order): what a deployed
        weight holding its codes in another byte order computes (`tq.deploy.MXFP4PackedTensor`)."""
        return self.format.codec.decode(codes) * geometry.expand(Format.E8M0.codec.decode(scale_inv), shape, self.layout())
