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
from tqcompile.quantizers.scaling import amax_scaled

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
    """

    __module__ = "tqcompile.quantizers"  # the name pickles of quantizers hold (see tqcompile.quantizers)

    SYMMETRIC = "symmetric"
    FULL = "full"


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
        self._check_epsilon(self.scale_max())
        self._canonicalize_layout()

    def __setstate__(self, state) -> None:
        # A quantizer pickled before `grid` existed holds one value fewer: it quantized on SYMMETRIC.
        names = [f.name for f in dataclasses.fields(self)]
        values = dict(zip(names, state))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, values.get(f.name, f.default))

    def code_range(self) -> tuple[int, int]:
        """(lowest, highest) signed code of this quantizer's grid."""
        qmax = int(self.format.max_value)
        return (-qmax - 1 if self.grid is IntGrid.FULL else -qmax), qmax

    def scale_max(self) -> float:
        """The scaled value an amax maps to: qmax on SYMMETRIC, qmax + 0.5 on FULL."""
        return self.format.max_value + (0.5 if self.grid is IntGrid.FULL else 0.0)

    def element_format(self) -> Format:
        return self.format

    def layout(self) -> geometry.Layout:
        return self.granularity, self.axis, self.block_size

    def reference_quantize(self, xf, amax, seed) -> tuple[torch.Tensor, torch.Tensor]:
        codec = self.format.codec
        v, scale_inv = amax_scaled(xf, self.layout(), amax, self.scale_max(), self.amax_epsilon)
        return codec.pack(codec.encode(v, *self.code_range())), scale_inv

    def reference_dequantize(self, data, scale_inv, amax, shape) -> torch.Tensor:
        codec = self.format.codec
        return codec.decode(codec.unpack(data)) * geometry.expand(scale_inv, shape, self.layout())
