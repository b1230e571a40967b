"""The quantizer base class: what every quantizer is and answers, whatever its family.

A quantizer is a frozen, slotted dataclass whose fields are Python scalars and Enums only. It is
registered as a torch.compile *value* opaque type, so it can be an argument of a custom op;
Dynamo guards on `__eq__`, so an equal quantizer never recompiles and a different one does.
Changing a setting means making a new quantizer (`dataclasses.replace`), never mutation.

A family (`tqcompile.quantizers.fp8`, `integer`, `mx`, `nvfp4`) subclasses `Quantizer`, says its
element format and layout (`tqcompile.quantizers.geometry`), answers the capability questions
below where its answer differs from the default, writes its reference numerics
(`reference_quantize` / `reference_dequantize`, which `tqcompile.kernels.reference` runs) and
registers itself with `register_family`. Other layers ask these methods, or keep a
`functools.singledispatch` registry of their own per family; none branches on the class.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

# Value opaque types: torch's private API, the only way to make a quantizer an argument of a custom
# op that Dynamo guards on by value. Checked on torch 2.13: a frozen, slotted dataclass subclassing
# OpaqueBase registers, pickles, compiles with inductor and passes torch.library.opcheck.
# tqcompile._opaque picks torch's names for it (renamed in torch 2.14).
from tqcompile._opaque import OpaqueBase, register_value_type
from tqcompile.formats import Format
from tqcompile.quantizers import geometry
from tqcompile.quantizers.geometry import Granularity
from tqcompile.quantizers.scaling import FP32_MAX, finite_abs

__all__ = ["Quantizer", "register_family", "quantizer_families", "PUBLIC_MODULE"]

# Pickles, `torch.load(weights_only=True)` allow-lists and exported graphs name a quantizer class
# by module and name: the families keep the module they had before quantizers became a package,
# so saved quantizers, states and checkpoints load either way.
PUBLIC_MODULE = "tqcompile.quantizers"

_FAMILIES: list[type] = []


def register_family(cls: type) -> type:
    """Class decorator of a quantizer family: registers it as a value opaque type (an argument of
    custom ops) and lists it in `quantizer_families` (config files, `torch.load` allow-lists)."""
    cls.__module__ = PUBLIC_MODULE  # after the dataclass is built: it resolves `ClassVar` in the defining module
    register_value_type(cls)
    _FAMILIES.append(cls)
    return cls


def quantizer_families() -> tuple[type, ...]:
    """The registered quantizer classes, in registration order."""
    return tuple(_FAMILIES)


def _bad(cls_name: str, field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{cls_name}: {field}={value!r} is not allowed; allowed: {allowed}")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Quantizer(OpaqueBase):
    """Base of all quantizers. Subclasses are frozen dataclasses of scalars and Enums."""

    # --- what the family is (overridden) -------------------------------------------------
    def family_name(self) -> str:
        """The quantizer's class name, for messages (a member compiled code can read on every torch)."""
        return type(self).__name__

    def element_format(self) -> Format:
        raise NotImplementedError

    def layout(self) -> geometry.Layout:
        """(granularity, axis, block) of this quantizer's scales. (Methods, not properties: Dynamo cannot read a property of a slotted value opaque object.)"""
        raise NotImplementedError

    # --- capabilities: what other layers ask instead of the class --------------------------
    def uses_tensor_amax(self) -> bool:
        """True when a tensor-level amax feeds the scale; that amax is what `amax_group` reduces."""
        return self.layout()[0] is Granularity.TENSORWISE

    def has_global_scale(self) -> bool:
        """True when the tensor-level amax sets a global fp32 scale above the stored per-unit
        scales (NVFP4's ``s_enc``): dequantizing then needs that amax too, and it is no scaling
        unit's amax (calibration searches it only as a whole, AWQ keeps the blocks that hold it)."""
        return self.uses_tensor_amax() and self.layout()[0] is not Granularity.TENSORWISE

    def takes_static_amax(self) -> bool:
        """True when a calibrated (static) amax can set the scales; False where every unit's scale
        comes from the unit itself (MX blocks)."""
        return True

    def scaled_mm_operand(self) -> bool:
        """True when the payload is FP8 under one fp32 scale per tensor or per row: an operand
        `torch._scaled_mm` multiplies as it is (the GEMM ops' fast path; on CPU, what
        `reference.fp8_gemm_cpu` computes)."""
        fmt = self.element_format()
        gran = self.layout()[0]
        return (
            fmt.is_float
            and fmt.bits == 8
            and self.scale_dtype() == torch.float32
            and gran in (Granularity.TENSORWISE, Granularity.ROWWISE)
        )

    def scale_dtype(self) -> torch.dtype:
        return torch.float32

    def has_zero_point(self) -> bool:
        """True when each unit has a zero point besides its scale (an asymmetric integer grid):
        its static amax then holds ``(-min, max)`` a unit and its scales ``(1 / scale, zero_point)``,
        a trailing dim of 2 in `scale_shape`."""
        return False

    def scale_max(self) -> float:
        """The scaled value an amax maps to in an amax-scaled family (FP8, INT): the scale is
        ``scale_max() / amax``. The element format's largest value, except on an integer FULL grid
        (`IntGrid`), where it is half a step above it."""
        return self.element_format().max_value

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
        then be derived from the rowwise usage by transposing both, unpacking packed payloads
        (what FSDP2's quantized all-gather does after the gather: `fsdp_layout.transpose_payload`).

        `columnwise_is_byte_transpose` is the narrower case a plain byte transpose serves."""
        return self.layout()[0] in (Granularity.TENSORWISE, Granularity.BLOCKWISE_2D) and not self.hadamard_transformed()

    def columnwise_is_byte_transpose(self) -> bool:
        """True when the columnwise usage is the rowwise payload's bytes transposed, with the very
        same scale tensor: one tensor-level scale and one byte per element (FP8 and INT8
        tensorwise). A subset of `columnwise_is_transpose`: 2-D blocks also need their scale grid
        transposed and packed payloads repacked. Tensor parallelism derives a reused operand's
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
        names: dict[str, type] = {type(self).__name__: type(self)}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                names[type(v).__name__] = type(v)
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
        Dynamo cannot hand a raised exception to the user (see docs/training.md). Traced code
        calls the function `shape_error` (torch 2.11: see `in_range`)."""
        return shape_error(self, shape)

    def padded_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...] | None:
        """The smallest shape at least `shape` (zero padding at the end of dims) that passes
        `check_shape`, or None where no padding helps (too few dims, an axis out of range)."""
        return padded_shape(self, shape)

    def scale_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """Shape of the scale tensor for a tensor of `shape` (`check_shape` must pass)."""
        return geometry.scale_shape(shape, self.layout())

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
        """Shape of the payload of a tensor of `shape` (packed formats: the last dim in bytes)."""
        shape = tuple(shape)
        fmt = self.element_format()
        if fmt.pack_elements == 1:
            return shape
        return shape[:-1] + (shape[-1] // fmt.pack_elements * fmt.pack_bytes,)

    def logical_shape(self, payload_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """Shape of the tensor a payload of `payload_shape` holds (inverse of `payload_shape`)."""
        shape = tuple(payload_shape)
        fmt = self.element_format()
        if fmt.pack_elements == 1:
            return shape
        return shape[:-1] + (shape[-1] // fmt.pack_bytes * fmt.pack_elements,)

    # --- reference numerics (each family writes them; tqcompile.kernels.reference runs them) --
    def reference_unit_amax(self, xf: torch.Tensor) -> torch.Tensor:
        """The static amax of each scaling unit of the transformed fp32 `xf` over its finite values,
        in `scale_shape`: the max magnitude (``(-min, max)`` where `has_zero_point`)."""
        return geometry.unit_amax(finite_abs(xf), self.layout())

    def reference_in_range(self, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """Where `x` lies within the range a static per-unit `amax` gives (the clipped STE passes
        the gradient there): `in_range`."""
        return in_range(self, x, amax)

    def reference_transform(self, xf: torch.Tensor) -> torch.Tensor:
        """The contiguous fp32 `xf` as the element format sees it (a transform along the last dim,
        such as NVFP4's Hadamard; the identity by default). Amaxes are taken after it."""
        return xf

    def reference_quantize(
        self, xf: torch.Tensor, amax: torch.Tensor | None, seed: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, scale_inv) of the transformed fp32 `xf`: the family's definition of its
        numerics in plain torch (`tqcompile.kernels.reference.quantize` states the conventions)."""
        raise TypeError(f"no reference kernel for quantizer type {type(self).__name__}")

    def reference_dequantize(
        self, data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor | None, shape: torch.Size
    ) -> torch.Tensor:
        """The fp32 values of a payload of logical `shape` (before `reference.dequantize` saturates
        them into the output dtype)."""
        raise TypeError(f"no reference kernel for quantizer type {type(self).__name__}")

    def _check_epsilon(self, max_value: float) -> None:
        eps = self.amax_epsilon
        if not (isinstance(eps, float) and math.isfinite(eps) and eps > 0 and max_value / eps < FP32_MAX):
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


Quantizer.__module__ = PUBLIC_MODULE
register_value_type(Quantizer)


def in_range(q: Quantizer, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Where `x` lies within the range the static per-unit `amax` of `q` gives: ``|x| <= amax``,
    or ``-lo <= x <= hi`` for a grid with zero points (`amax` holds (lo, hi) on its last dim).

    A function of the quantizer's answers, not a method: compiled code calls it with tensors, and
    torch 2.11's Dynamo calls a value opaque object's methods with constant arguments only."""
    layout = q.layout()
    if q.has_zero_point():
        lo, hi = geometry.expand(amax[..., 0], x.shape, layout), geometry.expand(amax[..., 1], x.shape, layout)
        return (x >= -lo) & (x <= hi)
    return x.abs() <= geometry.expand(amax, x.shape, layout)


def shape_error(q: Quantizer, shape: tuple[int, ...] | torch.Size) -> str | None:
    """`Quantizer.shape_error`, as a function (compiled code calls it with symbolic sizes)."""
    gran, axis, block = q.layout()
    shape = tuple(shape)
    name = q.family_name()
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
    group = q.element_format().pack_elements
    if group > 1 and (len(shape) == 0 or shape[-1] % group):
        return f"{name}: {q.element_format().codec.packing_rule()}, got shape {shape}"
    if q.hadamard_transformed() and shape[-1] % 16:
        return f"{name}: the Hadamard transform works on 16-element blocks of the last dim; got shape {shape}"
    return None


def padded_shape(q: Quantizer, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...] | None:
    """`Quantizer.padded_shape`, as a function."""
    gran, _, block = q.layout()
    shape = tuple(shape)
    if not shape or (gran is Granularity.BLOCKWISE_2D and len(shape) < 2):
        return None
    last = block if gran in (Granularity.BLOCKWISE_1D, Granularity.BLOCKWISE_2D) else 1
    last = math.lcm(last, q.element_format().pack_elements)
    if q.hadamard_transformed():
        last = math.lcm(last, 16)
    units = [1] * len(shape)
    units[-1] = last
    if gran is Granularity.BLOCKWISE_2D:
        units[-2] = block
    padded = tuple(-(-d // u) * u for d, u in zip(shape, units))
    return padded if shape_error(q, padded) is None else None
