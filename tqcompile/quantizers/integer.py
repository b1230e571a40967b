"""The INT family: signed INT8 / INT4 / INT3 / INT2 codes under fp32 scales per tensor, channel or
1-D block, round half to even, on one of two grids (`IntGrid`; docs/numerics/int.md)."""

from __future__ import annotations

import dataclasses
import enum

import torch

from tqcompile.formats import Format
from tqcompile.formats.format import formats_of_kind
from tqcompile.quantizers import geometry
from tqcompile.quantizers.base import Quantizer, register_family
from tqcompile.quantizers.geometry import Granularity
from tqcompile.quantizers.scaling import amax_scaled, scale_from_amax

__all__ = ["IntQuantizer", "IntGrid"]


class IntGrid(enum.Enum):
    """Which signed codes a `bits`-wide integer quantizer uses, and the value an amax maps to.

    =========  ==========================================  ==========================================
    grid       codes (INT4 / INT8)                          scale (the amax maps to)
    =========  ==========================================  ==========================================
    SYMMETRIC  ``-qmax..qmax``, qmax = 2**(bits-1) - 1      ``qmax / amax`` (INT4 7, INT8 127)
               (-7..7 / -127..127)
    FULL       ``-2**(bits-1)..2**(bits-1) - 1``            ``((2**bits - 1) / 2) / amax`` (7.5, 127.5)
               (-8..7 / -128..127)
    =========  ==========================================  ==========================================

    FULL is llmcompressor's and compressed-tensors' symmetric observer (INT4 scale amax / 7.5): the
    amax itself rounds to the top code on the positive side and to the bottom code on the
    negative side, so every code is used and the step is 7% smaller at INT4 than SYMMETRIC's.
    The PTQ presets use it for weights (and for static INT8 activations); SYMMETRIC, a grid
    symmetric about zero, stays the default of `IntQuantizer` (QAT, per-token activations as vLLM
    quantizes them with amax / 127, and every quantizer saved before FULL existed).

    ASYMMETRIC adds a zero point per unit (compressed-tensors' ``symmetric: false``): the codes of
    FULL span the unit's ``[min(x, 0), max(x, 0)]``, ``scale = (2**bits - 1) / (max - min)``,
    ``zero_point = round(-2**(bits-1) - min * scale)``, ``q = round(clamp(x * scale + zero_point))``
    and ``x = (q - zero_point) / scale``. For weights, per channel or in 1-D blocks: its static
    "amax" holds two values a unit, ``(-min, max)`` (both non-negative, so a max-reduction and a
    clipping ratio act on each side), and its scales two, ``(1 / scale, zero_point)``.
    """

    __module__ = "tqcompile.quantizers"  # the name pickles of quantizers hold (see tqcompile.quantizers)

    SYMMETRIC = "symmetric"
    FULL = "full"
    ASYMMETRIC = "asymmetric"


@register_family
@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class IntQuantizer(Quantizer):
    """Signed INT8 / INT4 / INT3 / INT2: ``scale = top / max(amax, amax_epsilon)``, round half to
    even, saturating to the grid's codes; `grid` says which codes and which `top` (`IntGrid`:
    SYMMETRIC, the default, ``-qmax..qmax`` with top = qmax; FULL, ``-2**(bits-1)..qmax`` with top =
    (2**bits - 1) / 2, as llmcompressor and the engines' checkpoints).

    Granularity TENSORWISE (default), ROWWISE (per channel: one scale per slice along `axis`;
    for an (out, in) weight the default axis=-1 gives one scale per output channel) or
    BLOCKWISE_1D (`block_size` elements of the last dim). INT4 is stored two to a byte, INT2 four,
    INT3 eight in three bytes. Fields the granularity does not use are reset to their defaults,
    as in `Float8Quantizer`.
    """

    format: Format = Format.INT8
    granularity: Granularity = Granularity.TENSORWISE
    axis: int = -1
    block_size: int = 128
    amax_epsilon: float = 1e-12
    grid: IntGrid = IntGrid.SYMMETRIC

    @classmethod
    def allowed_formats(cls) -> tuple[Format, ...]:
        """The integer element formats (INT8, INT4, INT3, INT2)."""
        return formats_of_kind("int")

    def __post_init__(self) -> None:
        self._check_layout(self.allowed_formats(), (Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCKWISE_1D))
        self._check_enum("grid", tuple(IntGrid))
        if self.grid is IntGrid.ASYMMETRIC and self.granularity is Granularity.TENSORWISE:
            raise ValueError(
                "IntQuantizer: grid=IntGrid.ASYMMETRIC with granularity=Granularity.TENSORWISE is not allowed; allowed: "
                "ROWWISE or BLOCKWISE_1D (weights per channel or group, as compressed-tensors' asymmetric schemes)"
            )
        self._check_epsilon(self.scale_max())
        self._canonicalize_layout()

    def __setstate__(self, state) -> None:
        # A quantizer pickled before `grid` existed holds one value fewer: it quantized on SYMMETRIC.
        # (Setting fields of the frozen dataclass here is its construction, as the dataclass's own
        # __setstate__ does: nobody holds the object yet.)
        names = [f.name for f in dataclasses.fields(self)]
        values = dict(zip(names, state))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, values.get(f.name, f.default))

    def code_range(self) -> tuple[int, int]:
        """(lowest, highest) signed code of this quantizer's grid."""
        qmax = int(self.format.max_value)
        return (-qmax if self.grid is IntGrid.SYMMETRIC else -qmax - 1), qmax

    def scale_max(self) -> float:
        """The scaled value an amax maps to: qmax on SYMMETRIC, qmax + 0.5 on FULL; on ASYMMETRIC
        the span ``max - min`` maps to ``2**bits - 1``."""
        if self.grid is IntGrid.ASYMMETRIC:
            return 2.0 * self.format.max_value + 1.0
        return self.format.max_value + (0.5 if self.grid is IntGrid.FULL else 0.0)

    def has_zero_point(self) -> bool:
        return self.grid is IntGrid.ASYMMETRIC

    def scale_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        base = geometry.scale_shape(shape, self.layout())
        return base + (2,) if self.has_zero_point() else base

    def reference_unit_amax(self, xf: torch.Tensor) -> torch.Tensor:
        if not self.has_zero_point():
            return Quantizer.reference_unit_amax(self, xf)
        finite = torch.where(torch.isfinite(xf), xf, torch.zeros((), dtype=xf.dtype, device=xf.device))
        below, above = (-finite).clamp(min=0), finite.clamp(min=0)
        return torch.stack([geometry.unit_amax(below, self.layout()), geometry.unit_amax(above, self.layout())], -1)

    def element_format(self) -> Format:
        return self.format

    def layout(self) -> geometry.Layout:
        return self.granularity, self.axis, self.block_size

    def reference_quantize(self, xf, amax, seed) -> tuple[torch.Tensor, torch.Tensor]:
        codec, (lo, hi) = self.format.codec, self.code_range()
        if not self.has_zero_point():
            v, scale_inv = amax_scaled(xf, self.layout(), amax, self.scale_max(), self.amax_epsilon)
            return codec.pack(codec.encode(v, lo, hi)), scale_inv
        scale, scale_inv, zero = self.reference_unit_scales(self.reference_unit_amax(xf) if amax is None else amax)
        layout = self.layout()
        v = torch.nan_to_num(xf, nan=0.0) * geometry.expand(scale, xf.shape, layout) + geometry.expand(zero, xf.shape, layout)
        return codec.pack(codec.encode(v, lo, hi)), torch.stack([scale_inv, zero], -1)

    def reference_unit_scales(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(scale, scale_inv, zero_point or None) of static per-unit amaxes, as `reference_quantize`
        computes them (GPTQ holds them while it rounds a unit's columns one at a time)."""
        if not self.has_zero_point():
            scale = scale_from_amax(amax.float(), self.scale_max(), self.amax_epsilon, False)
            return scale, 1.0 / scale, None
        ext, lo = amax.float(), self.code_range()[0]
        scale = scale_from_amax(ext[..., 0] + ext[..., 1], self.scale_max(), self.amax_epsilon, False)
        return scale, 1.0 / scale, (lo + ext[..., 0] * scale).round().clamp(lo, self.code_range()[1])

    def reference_round(self, xf: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """``dequantize(quantize(xf))`` in fp32 under scales from `reference_unit_scales` (broadcast
        to `xf`): the same arithmetic, bit for bit, without payloads."""
        lo, hi = self.code_range()
        v = torch.nan_to_num(xf, nan=0.0) * scale
        if zero is None:
            return (v.clamp(lo, hi).round() + 0.0) * scale_inv  # + 0.0: a code is never -0
        return ((v + zero).clamp(lo, hi).round() - zero + 0.0) * scale_inv

    def reference_dequantize(self, data, scale_inv, amax, shape) -> torch.Tensor:
        codec, layout = self.format.codec, self.layout()
        codes = codec.decode(codec.unpack(data))
        if not self.has_zero_point():
            return codes * geometry.expand(scale_inv, shape, layout)
        return (codes - geometry.expand(scale_inv[..., 1], shape, layout)) * geometry.expand(scale_inv[..., 0], shape, layout)
