"""Recipes: which quantizer each operand of each GEMM of a linear layer uses.

A linear layer runs three GEMMs (the one explanation of them in this library):

    fprop   y  = x  · Wᵀ    operands: input x (rowwise),      weight W (rowwise)
    dgrad   dx = dy · W     operands: grad dy (rowwise),      weight W (columnwise)
    wgrad   dW = dyᵀ · x    operands: grad dy (columnwise),   input x (columnwise)

"Rowwise" and "columnwise" say along which dim the operand is blocked: always the GEMM's
reduction dim (see `tqcompile.ops.gemm`). A `Recipe` names one quantizer per operand; where two
GEMMs share an operand with an equal quantizer, it is quantized once with both usages.

`tq.recipes.<name>()` are the named recipes; a Recipe is a frozen value object like a quantizer,
so `dataclasses.replace(tq.recipes.mxfp8(), wgrad_grad=None, wgrad_input=None)` is a new recipe.
"""

from __future__ import annotations

import dataclasses
import functools

# A Recipe is a value opaque type for the same reason a quantizer is (see tqcompile.quantizers).
from tqcompile._opaque import OpaqueBase, register_value_type
from tqcompile.formats import Format
from tqcompile.quantizers import (
    Float8Quantizer,
    Granularity,
    MXQuantizer,
    NVFP4Quantizer,
    Quantizer,
    ScaleRounding,
)
from tqcompile.quantizers.base import shape_error

__all__ = [
    "Recipe",
    "fp8_tensorwise",
    "fp8_rowwise",
    "fp8_rowwise_hp_wgrad",
    "fp8_blockwise",
    "mxfp8",
    "nvfp4",
    "fp8_delayed",
    "mxfp6",
    "RECIPES",
    "get",
]

_OPERANDS = ("fprop_input", "fprop_weight", "dgrad_grad", "dgrad_weight", "wgrad_grad", "wgrad_input")
_GEMM_PAIRS = (("fprop_input", "fprop_weight"), ("dgrad_grad", "dgrad_weight"), ("wgrad_grad", "wgrad_input"))
# A token count that is a multiple of every block size, to check what convert() can know ahead.
_PROBE_ROWS = 128


@functools.singledispatch
def delayed_scaling_applies(q: Quantizer) -> bool:
    """Whether delayed scaling (an amax history per operand) can drive `q`: registered per family;
    tensorwise FP8 only."""
    return False


@delayed_scaling_applies.register(Float8Quantizer)
def _(q: Float8Quantizer) -> bool:
    return q.granularity is Granularity.TENSORWISE


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Recipe(OpaqueBase):
    """The quantizer of each operand of each GEMM (see the module docstring).

    `wgrad_grad`/`wgrad_input` None: wgrad runs in high precision. `amax_history_len` > 0:
    delayed scaling of every operand, from a history of that many past amaxes kept in module
    buffers (all operands must be tensorwise FP8).
    """

    name: str
    fprop_input: Quantizer
    fprop_weight: Quantizer
    dgrad_grad: Quantizer
    dgrad_weight: Quantizer
    wgrad_grad: Quantizer | None = None
    wgrad_input: Quantizer | None = None
    amax_history_len: int = 0

    def __post_init__(self) -> None:
        for field in _OPERANDS:
            q = getattr(self, field)
            if not (isinstance(q, Quantizer) or (q is None and field.startswith("wgrad"))):
                allowed = "a tq.Quantizer" + (" or None (high-precision wgrad)" if field.startswith("wgrad") else "")
                raise ValueError(f"Recipe {self.name!r}: {field}={q!r} is not allowed; allowed: {allowed}")
            if q is not None and q.has_zero_point():
                raise ValueError(
                    f"Recipe {self.name!r}: {field}={q!r} is not allowed; zero points (IntGrid.ASYMMETRIC) are for PTQ "
                    "weights (tq.calibrate): the training GEMMs take scales only"
                )
        if (self.wgrad_grad is None) != (self.wgrad_input is None):
            raise ValueError(f"Recipe {self.name!r}: wgrad_grad and wgrad_input must both be quantizers or both None")
        for a, b in _GEMM_PAIRS:
            qa, qb = getattr(self, a), getattr(self, b)
            ha = qa is not None and qa.hadamard_transformed() and (qa.hadamard_seed,)
            hb = qb is not None and qb.hadamard_transformed() and (qb.hadamard_seed,)
            if qa is not None and ha != hb:
                raise ValueError(
                    f"Recipe {self.name!r}: {a}={qa!r} and {b}={qb!r} are operands of one GEMM; a Hadamard transform "
                    "only cancels when both use it with the same hadamard_seed"
                )
        if not isinstance(self.amax_history_len, int) or isinstance(self.amax_history_len, bool) or self.amax_history_len < 0:
            raise ValueError(f"Recipe {self.name!r}: amax_history_len={self.amax_history_len!r}; allowed: an int >= 0")
        if self.amax_history_len:
            for field in _OPERANDS:
                q = getattr(self, field)
                if q is not None and not delayed_scaling_applies(q):
                    raise ValueError(
                        f"Recipe {self.name!r}: delayed scaling (amax_history_len={self.amax_history_len}) needs tensorwise "
                        f"Float8Quantizers; {field}={q!r}"
                    )

    def unsupported_reason(self, in_features: int, out_features: int, num_tokens: int | None = None, *, backward: bool = True) -> str | None:
        """Why this recipe cannot serve a linear layer of these sizes, or None if it can.

        `num_tokens` is the layer's token count (batch x sequence); left out, a count that is a
        multiple of every block size is assumed, so only the feature sizes are checked.
        `backward=False` checks the forward GEMM's operands only (inference)."""
        return unsupported_reason(self, in_features, out_features, num_tokens, backward=backward)

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"Recipe({fields})"

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        names: dict[str, type] = {"Recipe": Recipe}
        for field in _OPERANDS:
            q = getattr(self, field)
            if q is not None:
                names.update(q.__fx_repr__()[1])
        return repr(self), names


register_value_type(Recipe)


def fp8_tensorwise() -> Recipe:
    """Current scaling, one fp32 scale per tensor: E4M3 forward operands, E5M2 gradients."""
    fwd, grad = Float8Quantizer(), Float8Quantizer(format=Format.E5M2)
    return Recipe("fp8_tensorwise", fwd, fwd, grad, fwd, grad, fwd)


def fp8_rowwise() -> Recipe:
    """One power-of-two fp32 scale per row of each operand (along K), E4M3 everywhere."""
    q = Float8Quantizer(granularity=Granularity.ROWWISE, power_of_two_scale=True)
    return Recipe("fp8_rowwise", q, q, q, q, q, q)


def fp8_rowwise_hp_wgrad() -> Recipe:
    """fp8_rowwise for fprop and dgrad; wgrad in high precision (the input is saved unquantized)."""
    return dataclasses.replace(fp8_rowwise(), name="fp8_rowwise_hp_wgrad", wgrad_grad=None, wgrad_input=None)


def fp8_blockwise() -> Recipe:
    """DeepSeek-V3 style: 1x128 blocks for activations and gradients, 128x128 for weights,
    E4M3 with power-of-two scales."""
    act = Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, power_of_two_scale=True)
    wgt = Float8Quantizer(granularity=Granularity.BLOCKWISE_2D, power_of_two_scale=True)
    return Recipe("fp8_blockwise", act, wgt, act, wgt, act, act)


def mxfp8() -> Recipe:
    """OCP MXFP8: E4M3 elements in 32-blocks with E8M0 scales, RCEIL rule (never saturates)."""
    q = MXQuantizer(format=Format.E4M3, scale_rounding=ScaleRounding.RCEIL)
    return Recipe("mxfp8", q, q, q, q, q, q)


def nvfp4(stochastic_rounding: bool = True) -> Recipe:
    """NVFP4: 16x16 weight tiles, 1x16 activation blocks, stochastic rounding of gradients,
    random Hadamard transform on both wgrad operands.

    `stochastic_rounding=False` rounds the gradients to nearest instead (recipe name
    "nvfp4_rne"): stochastic rounding draws its random numbers by element index, so a sharded
    gradient (tensor parallel) cannot equal the single-process one bit for bit; rounding to
    nearest can, at the cost of a biased gradient."""
    act, wgt = NVFP4Quantizer(), NVFP4Quantizer(block_2d=True)
    sr = bool(stochastic_rounding)
    return Recipe(
        "nvfp4" if sr else "nvfp4_rne",
        fprop_input=act,
        fprop_weight=wgt,
        dgrad_grad=NVFP4Quantizer(stochastic_rounding=sr),
        dgrad_weight=wgt,
        wgrad_grad=NVFP4Quantizer(stochastic_rounding=sr, hadamard=True),
        wgrad_input=NVFP4Quantizer(hadamard=True),
    )


def mxfp6() -> Recipe:
    """OCP MXFP6: E2M3 elements in 32-blocks with E8M0 scales (RCEIL) for the weight in every GEMM
    and the activations in the forward; the gradients, and the activations their wgrad GEMM meets, in
    MXFP8 E4M3 (RCEIL), whose wider exponent range gradients need. One weight quantizer, so FSDP2
    all-gathers the weight in 6 bits (docs/numerics/mxfp6.md)."""
    fp6 = MXQuantizer(format=Format.E2M3, scale_rounding=ScaleRounding.RCEIL)
    fp8 = MXQuantizer(format=Format.E4M3, scale_rounding=ScaleRounding.RCEIL)
    return Recipe("mxfp6", fprop_input=fp6, fprop_weight=fp6, dgrad_grad=fp8, dgrad_weight=fp6, wgrad_grad=fp8, wgrad_input=fp8)


def fp8_delayed(amax_history_len: int = 16) -> Recipe:
    """Delayed scaling: fp8_tensorwise with each scale taken from the max of the last
    `amax_history_len` amaxes, kept in module buffers and passed to the ops."""
    return dataclasses.replace(fp8_tensorwise(), name="fp8_delayed", amax_history_len=amax_history_len)


class _UnknownRecipe(KeyError):
    def __str__(self) -> str:  # KeyError's own quotes the message like a key
        return str(self.args[0])


class _Recipes(dict):
    """{name: constructor}; looking up an unknown name raises a KeyError that names it and the allowed ones."""

    def __missing__(self, name):
        raise _UnknownRecipe(f"unknown recipe {name!r}; allowed: {', '.join(self)}")


RECIPES = _Recipes(
    (f.__name__, f) for f in (fp8_tensorwise, fp8_rowwise, fp8_rowwise_hp_wgrad, fp8_blockwise, mxfp8, nvfp4, fp8_delayed, mxfp6)
)


def get(name: str) -> Recipe:
    """The named recipe `name` (one of `RECIPES`)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; allowed: {', '.join(RECIPES)}")
    return RECIPES[name]()


def unsupported_reason(recipe: Recipe, in_features: int, out_features: int, num_tokens: int | None = None, *, backward: bool = True) -> str | None:
    """`Recipe.unsupported_reason`, as a function: compiled code calls it with a symbolic token
    count, and torch 2.11's Dynamo calls a value opaque object's methods with constants only."""
    m = _PROBE_ROWS if num_tokens is None else num_tokens
    shapes = {
        "fprop_input": (m, in_features),
        "fprop_weight": (out_features, in_features),
        "dgrad_grad": (m, out_features),
        "dgrad_weight": (in_features, out_features),
        "wgrad_grad": (out_features, m),
        "wgrad_input": (in_features, m),
    }
    for field, shape in shapes.items():
        q = getattr(recipe, field)
        if q is None or (not backward and not field.startswith("fprop")):
            continue
        # shape_error, not check_shape in a try: traced code gets a plain string (tqcompile.ops.errors).
        e = shape_error(q, shape)
        if e is None:
            continue
        if num_tokens is not None and m in shape:
            return f"{field} operand of shape {shape} ({m} tokens = batch x sequence): {e}"
        return f"{field} operand of shape {shape}: {e}"
    return None
