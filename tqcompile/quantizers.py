"""Quantizers: immutable value objects that say *how* to quantize.

A quantizer is a frozen, slotted dataclass whose fields are Python scalars and Enums only. It is
registered as a torch.compile *value* opaque type, so it can be an argument of a custom op;
Dynamo guards on `__eq__`, so an equal quantizer never recompiles and a different one does.
Changing a setting means making a new quantizer (`dataclasses.replace`), never mutation.

Every quantizer maps onto one *block layout*: which elements share one scale.

=================  ====================================================  =====================
granularity        elements that share a scale                           scale shape for (…, M, K)
=================  ====================================================  =====================
TENSORWISE         all                                                   ()
ROWWISE            all along `axis` (one scale per row for axis=-1)      shape with axis set to 1
BLOCKWISE_1D       `block` consecutive elements of the last dim          (…, M, K/block)
BLOCKWISE_2D       `block` x `block` tiles of the last two dims          (…, M/block, K/block)
=================  ====================================================  =====================
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import ClassVar

import torch

# Value opaque types: torch's private API, the only way to make a quantizer an argument of a custom
# op that Dynamo guards on by value. Checked on torch 2.13: a frozen, slotted dataclass subclassing
# OpaqueBase registers, pickles, compiles with inductor and passes torch.library.opcheck.
# tqcompile._opaque picks torch's names for it (renamed in torch 2.14).
from tqcompile._opaque import OpaqueBase, register_value_type
from tqcompile.formats import Format

__all__ = [
    "Granularity",
    "ScaleRounding",
    "Quantizer",
    "Float8Quantizer",
    "MXQuantizer",
    "NVFP4Quantizer",
    "IntQuantizer",
]

# Largest fp32 value; `max_value / amax_epsilon` must stay below it so scales are finite.
_FP32_MAX = torch.finfo(torch.float32).max


class Granularity(enum.Enum):
    """Which elements share one scale (see the table in this module's docstring)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE_1D = "blockwise_1d"
    BLOCKWISE_2D = "blockwise_2d"


class ScaleRounding(enum.Enum):
    """How an MX block's power-of-two scale is chosen from the block amax.

    FLOOR: OCP MX v1.0, ``e = floor(log2(amax)) - emax_elem``; the largest element may saturate.
    RCEIL: ``e = ceil(log2(amax / elem_max))``; never saturates (the rule of NVIDIA's MXFP8 GEMMs).
    """

    FLOOR = "floor"
    RCEIL = "rceil"


def _bad(cls_name: str, field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{cls_name}: {field}={value!r} is not allowed; allowed: {allowed}")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Quantizer(OpaqueBase):
    """Base of all quantizers. Subclasses are frozen dataclasses of scalars and Enums."""

    # Names a repr may use, for `__fx_repr__` and `eval`.
    _ENUMS: ClassVar[tuple[type, ...]] = (Format, Granularity, ScaleRounding)

    # --- the block layout (overridden) -------------------------------------------------
    def element_format(self) -> Format:
        raise NotImplementedError

    def layout(self) -> tuple[Granularity, int, int]:
        """(granularity, axis, block) of this quantizer's scales. (Methods, not properties: Dynamo cannot read a property of a slotted value opaque object.)"""
        raise NotImplementedError

    def uses_tensor_amax(self) -> bool:
        """True when a tensor-level amax feeds the scale; that amax is what `amax_group` reduces."""
        return self.layout()[0] is Granularity.TENSORWISE

    def scale_dtype(self) -> torch.dtype:
        return torch.float32

    def needs_seed(self) -> bool:
        return False

    def hadamard_transformed(self) -> bool:
        """True when a Hadamard transform mixes each 16-element block of the last dim before
        quantizing (NVFP4 `hadamard`): the columnwise usage then has its own amax, and the
        payload is no plain rounding of the tensor's values."""
        return False

    def columnwise_is_transpose(self) -> bool:
        """True when the columnwise usage holds the rowwise usage's quantized values, transposed,
        each under the same scale (one tensor-level scale, or 2-D blocks whose scale grid
        transposes with them) and no transform along the last dim. Its payload and scales can
        then be derived from the rowwise usage by transposing both, unpacking 4-bit payloads
        (what FSDP2's quantized all-gather does after the gather: `fsdp_layout.transpose_payload`).

        `columnwise_is_byte_transpose` is the narrower case a plain byte transpose serves."""
        return self.layout()[0] in (Granularity.TENSORWISE, Granularity.BLOCKWISE_2D) and not self.hadamard_transformed()

    def columnwise_is_byte_transpose(self) -> bool:
        """True when the columnwise usage is the rowwise payload's bytes transposed, with the very
        same scale tensor: one tensor-level scale and one byte per element (FP8 and INT8
        tensorwise). A subset of `columnwise_is_transpose`: 2-D blocks also need their scale grid
        transposed and 4-bit payloads repacked. Tensor parallelism derives a reused operand's
        columnwise usage this way (`tp_comm.columnwise_from_rowwise`)."""
        return self.layout()[0] is Granularity.TENSORWISE and self.element_format().bits == 8

    # --- value-object protocol ---------------------------------------------------------
    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            parts.append(f"{f.name}={type(v).__name__}.{v.name}" if isinstance(v, enum.Enum) else f"{f.name}={v!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        # Classes only, never a module: a module here breaks inductor's FX graph cache pickling.
        names = {type(self).__name__: type(self)}
        names.update({e.__name__: e for e in self._ENUMS})
        return repr(self), names

    # --- shapes ------------------------------------------------------------------------
    def check_shape(self, shape: tuple[int, ...] | torch.Size) -> None:
        """Raise a ValueError, naming the padding needed, if `shape` cannot be quantized."""
        problem = self.shape_error(shape)
        if problem is not None:
            raise ValueError(problem)

    def shape_error(self, shape: tuple[int, ...] | torch.Size) -> str | None:
        """Why `shape` cannot be quantized (naming the padding needed), or None if it can.

        `check_shape` raises this message; code traced by torch.compile asks for it instead, since
        Dynamo cannot hand a raised exception to the user (see docs/training.md)."""
        gran, axis, block = self.layout()
        shape = tuple(shape)
        name = type(self).__name__
        if gran is Granularity.ROWWISE:
            if len(shape) == 0:
                return f"{name} ROWWISE needs a tensor with at least 1 dim, got a 0-dim tensor"
            if not -len(shape) <= axis < len(shape):
                return f"{name}: axis={axis} is out of range for a {len(shape)}-dim tensor of shape {shape}"
        if gran in (Granularity.BLOCKWISE_1D, Granularity.BLOCKWISE_2D):
            need = 1 if gran is Granularity.BLOCKWISE_1D else 2
            if len(shape) < need:
                return f"{name} {gran.name} (block {block}) needs at least {need} dims, got shape {shape}"
            for d in range(len(shape) - need, len(shape)):
                if shape[d] % block:
                    padded = math.ceil(shape[d] / block) * block
                    return (
                        f"{name}: dim {d} of shape {shape} is {shape[d]}, not a multiple of the block size {block}; "
                        f"pad it with {padded - shape[d]} zeros to {padded} (e.g. torch.nn.functional.pad)"
                    )
        if self.element_format().bits == 4 and (len(shape) == 0 or shape[-1] % 2):
            return f"{name}: 4-bit payloads pack two elements a byte; the last dim must be even, got shape {shape}"
        if self.hadamard_transformed() and shape[-1] % 16:
            return f"{name}: the Hadamard transform works on 16-element blocks of the last dim; got shape {shape}"
        return None

    def padded_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...] | None:
        """The smallest shape at least `shape` (zero padding at the end of dims) that passes
        `check_shape`, or None where no padding helps (too few dims, an axis out of range)."""
        gran, _, block = self.layout()
        shape = tuple(shape)
        if not shape or (gran is Granularity.BLOCKWISE_2D and len(shape) < 2):
            return None
        last = block if gran in (Granularity.BLOCKWISE_1D, Granularity.BLOCKWISE_2D) else 1
        if self.element_format().bits == 4:
            last = math.lcm(last, 2)
        if self.hadamard_transformed():
            last = math.lcm(last, 16)
        units = [1] * len(shape)
        units[-1] = last
        if gran is Granularity.BLOCKWISE_2D:
            units[-2] = block
        padded = tuple(-(-d // u) * u for d, u in zip(shape, units))
        return padded if self.shape_error(padded) is None else None

    def scale_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """Shape of the scale tensor for a tensor of `shape` (`check_shape` must pass)."""
        gran, axis, block = self.layout()
        shape = tuple(shape)
        if gran is Granularity.TENSORWISE:
            return ()
        if gran is Granularity.ROWWISE:
            axis %= len(shape)
            return shape[:axis] + (1,) + shape[axis + 1 :]
        if gran is Granularity.BLOCKWISE_1D:
            return shape[:-1] + (shape[-1] // block,)
        return shape[:-2] + (shape[-2] // block, shape[-1] // block)

    def flat_columnwise_scale(self) -> bool:
        """True when a columnwise usage stores its scales flat (1-D blocks: MX, NVFP4 1x16, FP8 1x128).

        Their columnwise scale is (K, T // block) for T tokens, and torch 2.13's AOTAutograd asks of
        every graph tensor whether it is contiguous, which guards on each dim being 1: T // block == 1
        is a legal value, so a dynamic T recompiled at T == one block. Flat, (K * (T // block),) with
        K >= 2 is never 1 (compile_tests/test_token_count_recompiles.py)."""
        return self.layout()[0] is Granularity.BLOCKWISE_1D

    def columnwise_scale_shape(self, shape_t: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """Shape of a columnwise usage's scale, for the transpose `shape_t` (K, R) it quantizes:
        `scale_shape(shape_t)`, flattened (row-major) where `flat_columnwise_scale()`."""
        shape = self.scale_shape(shape_t)
        return (math.prod(shape),) if self.flat_columnwise_scale() else shape

    def payload_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = tuple(shape)
        per_byte = self.element_format().elements_per_byte
        return shape if per_byte == 1 else shape[:-1] + (shape[-1] // per_byte,)

    def logical_shape(self, payload_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = tuple(payload_shape)
        per_byte = self.element_format().elements_per_byte
        return shape if per_byte == 1 else shape[:-1] + (shape[-1] * per_byte,)

    def _check_epsilon(self, max_value: float) -> None:
        eps = self.amax_epsilon
        if not (isinstance(eps, float) and math.isfinite(eps) and eps > 0 and max_value / eps < _FP32_MAX):
            raise _bad(
                type(self).__name__,
                "amax_epsilon",
                eps,
                f"a positive float with {max_value}/amax_epsilon finite in fp32 (>= 1e-30)",
            )

    def _check_enum(self, field: str, allowed: tuple) -> None:
        v = getattr(self, field)
        if v not in allowed:
            raise _bad(type(self).__name__, field, v, ", ".join(f"{type(a).__name__}.{a.name}" for a in allowed))

    def _check_int(self, field: str, low: int) -> None:
        v = getattr(self, field)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise _bad(type(self).__name__, field, v, f"an int >= {low}")

    def _canonicalize(self, *fields: str) -> None:
        """Reset `fields`, which cannot change this quantizer's result, to their defaults.

        Equality is the compile cache key (Dynamo guards on `__eq__`), so two quantizers that
        quantize identically must compare and hash equal: a block size on a tensorwise quantizer
        would otherwise force a recompile. `object.__setattr__` because the dataclass is frozen;
        this runs only here, in `__post_init__`, before anyone can see the object, so it is still
        immutable from the outside (and `dataclasses.replace` runs it again).
        """
        for f in dataclasses.fields(self):
            if f.name in fields and getattr(self, f.name) != f.default:
                object.__setattr__(self, f.name, f.default)

    def _check_layout(self, formats: tuple[Format, ...], granularities: tuple[Granularity, ...]) -> None:
        """The fields of the quantizers with a free layout (FP8, INT): format, granularity, block_size, axis."""
        self._check_enum("format", formats)
        self._check_enum("granularity", granularities)
        self._check_int("block_size", 1)
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise _bad(type(self).__name__, "axis", self.axis, "an int")

    def _canonicalize_layout(self) -> None:
        """`axis` matters only for ROWWISE, `block_size` only for the block granularities."""
        gran = self.granularity
        unused = () if gran is Granularity.ROWWISE else ("axis",)
        if gran not in (Granularity.BLOCKWISE_1D, Granularity.BLOCKWISE_2D):
            unused += ("block_size",)
        self._canonicalize(*unused)

    def _check_bool(self, *fields: str) -> None:
        for f in fields:
            if not isinstance(getattr(self, f), bool):
                raise _bad(type(self).__name__, f, getattr(self, f), "True or False")


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

    def __post_init__(self) -> None:
        self._check_layout((Format.E4M3, Format.E5M2), tuple(Granularity))
        self._check_bool("power_of_two_scale")
        self._check_epsilon(self.format.max_value)
        self._canonicalize_layout()

    def element_format(self) -> Format:
        return self.format

    def layout(self) -> tuple[Granularity, int, int]:
        return self.granularity, self.axis, self.block_size


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class MXQuantizer(Quantizer):
    """OCP MX: 32-element blocks along the last dim sharing one E8M0 (power-of-two) scale.

    `format` E4M3 or E5M2 gives MXFP8, E2M1 gives MXFP4. `scale_rounding` names the rule that
    picks the block exponent (`ScaleRounding.FLOOR`, the OCP v1.0 rule, or `RCEIL`).
    """

    format: Format = Format.E4M3
    scale_rounding: ScaleRounding = ScaleRounding.FLOOR

    BLOCK: ClassVar[int] = 32

    def __post_init__(self) -> None:
        self._check_enum("format", (Format.E4M3, Format.E5M2, Format.E2M1))
        self._check_enum("scale_rounding", tuple(ScaleRounding))

    def element_format(self) -> Format:
        return self.format

    def layout(self) -> tuple[Granularity, int, int]:
        return Granularity.BLOCKWISE_1D, -1, self.BLOCK

    def scale_dtype(self) -> torch.dtype:
        return torch.float8_e8m0fnu


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class NVFP4Quantizer(Quantizer):
    """NVFP4: E2M1 elements in 16-element blocks (or 16x16 tiles with `block_2d`, for weights)
    with E4M3 block scales under an fp32 tensor-level scale ``s_enc = 448 * 6 / amax``.

    `stochastic_rounding` rounds elements up with probability equal to their distance from the
    lower neighbour (seeded: pass `seed=` to `tq.quantize`). `hadamard` multiplies each
    16-element block of the last dim by a 16x16 Hadamard matrix / 4 with a sign vector drawn
    from `hadamard_seed`; both operands of a GEMM must use it, so it cancels in the product.
    Without `hadamard`, `hadamard_seed` is reset to 0 (it cannot change the result).
    """

    block_2d: bool = False
    stochastic_rounding: bool = False
    hadamard: bool = False
    hadamard_seed: int = 0
    amax_epsilon: float = 1e-12

    BLOCK: ClassVar[int] = 16

    def __post_init__(self) -> None:
        self._check_bool("block_2d", "stochastic_rounding", "hadamard")
        self._check_int("hadamard_seed", 0)
        self._check_epsilon(Format.E4M3.max_value * Format.E2M1.max_value)
        if not self.hadamard:
            self._canonicalize("hadamard_seed")

    def element_format(self) -> Format:
        return Format.E2M1

    def layout(self) -> tuple[Granularity, int, int]:
        return (Granularity.BLOCKWISE_2D if self.block_2d else Granularity.BLOCKWISE_1D), -1, self.BLOCK

    def uses_tensor_amax(self) -> bool:
        return True

    def scale_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def needs_seed(self) -> bool:
        return self.stochastic_rounding

    def hadamard_transformed(self) -> bool:
        return self.hadamard


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

    def __post_init__(self) -> None:
        self._check_layout((Format.INT8, Format.INT4), (Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCKWISE_1D))
        self._check_epsilon(self.format.max_value)
        self._canonicalize_layout()

    def element_format(self) -> Format:
        return self.format

    def layout(self) -> tuple[Granularity, int, int]:
        return self.granularity, self.axis, self.block_size


for _cls in (Quantizer, Float8Quantizer, MXQuantizer, NVFP4Quantizer, IntQuantizer):
    register_value_type(_cls)
