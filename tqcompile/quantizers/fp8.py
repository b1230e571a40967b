"""The FP8 family: E4M3 / E5M2 elements under fp32 scales ``fmt_max / max(amax, eps)`` per
tensor, row, 1-D block or 2-D tile (docs/numerics/fp8.md)."""

from __future__ import annotations

import dataclasses

import torch

from tqcompile.formats import Format
from tqcompile.formats.format import formats_of_kind
from tqcompile.quantizers import geometry
from tqcompile.quantizers.base import Quantizer, register_family
from tqcompile.quantizers.geometry import Granularity
from tqcompile.quantizers.scaling import amax_scaled

__all__ = ["Float8Quantizer"]


@register_family
@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Float8Quantizer(Quantizer):
    """FP8 (E4M3 or E5M2) with fp32 scales: ``scale = fmt_max / max(amax, amax_epsilon)``.

    Granularity TENSORWISE (default), ROWWISE (one scale per slice along `axis`), BLOCKWISE_1D
    (1 x `block_size`, DeepSeek-V3 activations) or BLOCKWISE_2D (`block_size` x `block_size`,
    DeepSeek-V3 weights). `power_of_two_scale` rounds each scale down to a power of two.
    Fields the granularity does not use are reset to their defaults (`axis` unless ROWWISE,
    `block_size` unless blockwise), so quantizers that give the same result compare equal.

    Example:
        >>> Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, power_of_two_scale=True)
    """

    format: Format = Format.E4M3
    granularity: Granularity = Granularity.TENSORWISE
    axis: int = -1
    block_size: int = 128
    power_of_two_scale: bool = False
    amax_epsilon: float = 1e-12

    @classmethod
    def allowed_formats(cls) -> tuple[Format, ...]:
        """The 8-bit float element formats (E4M3, E5M2)."""
        return formats_of_kind("float", bits=8)

    def __post_init__(self) -> None:
        self._check_layout(self.allowed_formats(), tuple(Granularity))
        self._check_bool("power_of_two_scale")
        self._check_epsilon(self.format.max_value)
        self._canonicalize_layout()

    def element_format(self) -> Format:
        return self.format

    def layout(self) -> geometry.Layout:
        return self.granularity, self.axis, self.block_size

    def reference_quantize(self, xf, amax, seed) -> tuple[torch.Tensor, torch.Tensor]:
        v, scale_inv = amax_scaled(xf, self.layout(), amax, self.format.max_value, self.amax_epsilon, self.power_of_two_scale)
        return self.format.codec.encode(v), scale_inv

    def reference_dequantize(self, data, scale_inv, amax, shape) -> torch.Tensor:
        return self.format.codec.decode(data) * geometry.expand(scale_inv, shape, self.layout())
