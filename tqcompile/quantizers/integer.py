"""The INT family: symmetric INT8 / INT4 under fp32 scales ``qmax / max(amax, eps)`` per tensor,
channel or 1-D block, round half to even (docs/numerics/int.md)."""

from __future__ import annotations

import dataclasses

import torch

from tqcompile.formats import Format
from tqcompile.formats.format import formats_of_kind
from tqcompile.quantizers import geometry
from tqcompile.quantizers.base import Quantizer, register_family
from tqcompile.quantizers.geometry import Granularity
from tqcompile.quantizers.scaling import amax_scaled

__all__ = ["IntQuantizer"]


@register_family
@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class IntQuantizer(Quantizer):
    """Symmetric INT8 / INT4: ``scale = qmax / max(amax, amax_epsilon)``, round half to even.

    Granularity TENSORWISE (default), ROWWISE (per channel: one scale per slice along `axis`;
    for an (out, in) weight the default axis=-1 gives one scale per output channel) or
    BLOCKWISE_1D (`block_size` elements of the last dim). INT4 is stored two to a byte.
    Fields the granularity does not use are reset to their defaults, as in `Float8Quantizer`.
    """

    format: Format = Format.INT8
    granularity: Granularity = Granularity.TENSORWISE
    axis: int = -1
    block_size: int = 128
    amax_epsilon: float = 1e-12

    @classmethod
    def allowed_formats(cls) -> tuple[Format, ...]:
        """The integer element formats (INT8, INT4)."""
        return formats_of_kind("int")

    def __post_init__(self) -> None:
        self._check_layout(self.allowed_formats(), (Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCKWISE_1D))
        self._check_epsilon(self.format.max_value)
        self._canonicalize_layout()

    def element_format(self) -> Format:
        return self.format

    def layout(self) -> geometry.Layout:
        return self.granularity, self.axis, self.block_size

    def reference_quantize(self, xf, amax, seed) -> tuple[torch.Tensor, torch.Tensor]:
        codec = self.format.codec
        v, scale_inv = amax_scaled(xf, self.layout(), amax, codec.max_value, self.amax_epsilon)
        return codec.pack(codec.encode(v)), scale_inv

    def reference_dequantize(self, data, scale_inv, amax, shape) -> torch.Tensor:
        codec = self.format.codec
        return codec.decode(codec.unpack(data)) * geometry.expand(scale_inv, shape, self.layout())
